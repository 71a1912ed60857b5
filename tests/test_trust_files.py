"""Trust, third pass (issue 28, classes 1-3), through the real command line in this process:

1. containment: a file name that a file supplies (a shard index's weight_map, a saved dataset's state.json or
   dataset_dict.json, a meta.json shard) must stay inside the folder the user named, judged on the name as
   written; a Hugging Face cache folder of symlinks into ../../blobs/ still loads;
2. values read from files: wrong types, out-of-range values and nesting 100,000 deep at every file-read entry
   point end with one line naming the file and the field, never a traceback (``tokenmill/filecheck.py``);
3. numbers at the edge of floats: infinite, NaN and underflowing values on flags, in config files and as
   mixture weights are refused at once naming the field.
"""

import json
import shutil
import time
from pathlib import Path

import pytest

from tokenmill.cli import main

transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install 'tokenmill[hf]')")
pytest.importorskip("safetensors", reason="safetensors is not installed (pip install 'tokenmill[hf]')")

COMMON = ["--log.progress", "plain", "--log.tensorboard", "false", "--train.device", "cpu",
          "--train.eval_batches", "0", "--train.precision", "fp32"]
DEEP = "[" * 100_000 + "]" * 100_000
SHARD = "model-00001-of-00001.safetensors"


def cli(argv, capsys) -> tuple[int, str]:
    """``tokenmill ARGV`` in this process: (exit code, stdout + stderr); a traceback fails the test."""
    capsys.readouterr()
    try:
        rc = main([str(a) for a in argv])
    except SystemExit as e:
        rc = e.code
    except BaseException as e:  # noqa: BLE001 - exactly what must never happen
        pytest.fail(f"tokenmill {argv} raised {type(e).__name__}: {str(e)[:500]}")
    out = capsys.readouterr()
    return rc, out.out + out.err


def error_line(out: str) -> str:
    """The one error line of a refused command (and nothing that looks like a traceback)."""
    assert "Traceback" not in out, out[-3000:]
    lines = [x for x in out.splitlines() if x.startswith("tokenmill: ") and "error" in x.split(":")[1]]
    assert len(lines) == 1, out[-3000:]
    return lines[0]


def _records(folder: Path) -> None:
    """A folder as ``datasets.Dataset.save_to_disk`` writes it (one Arrow stream, state.json naming it)."""
    import pyarrow as pa

    folder.mkdir(parents=True)
    table = pa.table({"text": [f"record {i}: the cat sat on the mat." for i in range(40)]})
    with pa.OSFile(str(folder / "data-00000-of-00001.arrow"), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as w:
        w.write_table(table)
    (folder / "state.json").write_text(json.dumps({"_data_files": [{"filename": "data-00000-of-00001.arrow"}],
                                                   "_fingerprint": "0", "_split": None}))


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A bytes data folder (256 ids); tiny GPT-2 and Llama folders of 256 ids, one GPT-2 sharded with an index;
    a saved dataset and a saved DatasetDict; a secret folder beside them."""
    import torch

    d = tmp_path_factory.mktemp("files")
    (d / "text").mkdir()
    (d / "text" / "a.txt").write_text("the cat sat on the mat and the dog ate the bone. " * 200)
    assert main(["prepare", str(d / "text"), "--out", str(d / "data"), "--tokenizer", "bytes", "--no-progress"]) == 0
    torch.manual_seed(0)
    transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=256, n_positions=64, n_embd=32, n_layer=1, n_head=2)).save_pretrained(d / "gpt2")
    transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=64)).save_pretrained(d / "llama")
    shutil.copytree(d / "gpt2", d / "sharded")
    from safetensors import safe_open

    with safe_open(str(d / "sharded" / "model.safetensors"), "pt") as f:
        names = list(f.keys())
    (d / "sharded" / "model.safetensors").rename(d / "sharded" / SHARD)
    (d / "sharded" / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {n: SHARD for n in names}}))
    _records(d / "hfds")
    _records(d / "hfdd" / "train")
    (d / "hfdd" / "dataset_dict.json").write_text(json.dumps({"splits": ["train"]}))
    _records(d / "secret" / "train")
    return d


def _copy(world: Path, name: str, tmp_path: Path) -> Path:
    out = tmp_path / name
    shutil.copytree(world / name, out, symlinks=True)
    return out


def _train_from(world: Path, tmp_path: Path, source: Path) -> list:
    return ["train", "--preset", "tiny", "--data.path", world / "data", "--run-dir", tmp_path / "run",
            "--train.init_from", source, "--train.max_steps", 1, "--model.block_size", 32, *COMMON]


# ENTRY -> (the folder it reads, the file in it, the command that reads it)
ENTRIES = {
    "gpt2-config": ("gpt2", "config.json", lambda w, t, f: _train_from(w, t, f)),
    "llama-config": ("llama", "config.json", lambda w, t, f: _train_from(w, t, f)),
    "shard-index": ("sharded", "model.safetensors.index.json", lambda w, t, f: _train_from(w, t, f)),
    "meta": ("data", "meta.json", lambda w, t, f: ["train", "--preset", "tiny", "--data.path", f, "--run-dir",
                                                   t / "run", "--train.max_steps", 1, *COMMON]),
    "state": ("hfds", "state.json", lambda w, t, f: ["prepare", f, "--out", t / "out", "--tokenizer", "bytes",
                                                     "--no-progress"]),
    "dataset-dict": ("hfdd", "dataset_dict.json", lambda w, t, f: ["prepare", f, "--out", t / "out", "--tokenizer",
                                                                   "bytes", "--no-progress"]),
}


def hostile(world: Path, tmp_path: Path, entry: str, edit) -> tuple[list, Path]:
    """A copy of the entry's folder with its file edited (``edit(doc)`` returns the new document, or text to
    write as is); the command that reads it, and the folder."""
    name, file, command = ENTRIES[entry]
    folder = _copy(world, name, tmp_path)
    path = folder / file
    doc = edit(json.loads(path.read_text()))
    path.write_text(doc if isinstance(doc, str) else json.dumps(doc))
    return command(world, tmp_path, folder), folder


def at(path: tuple, value):
    """An edit setting ``doc[path[0]][path[1]]...`` to ``value`` (``'*'``: the first key of an object)."""
    def edit(doc):
        node = doc
        for k in path[:-1]:
            node = node[next(iter(node)) if k == "*" else k]
        node[next(iter(node)) if path[-1] == "*" else path[-1]] = value
        return doc
    return edit


# ------------------------------------------------------------------------------------------------
# 1. file names a file supplies stay inside the folder the user named


ESCAPES = {
    "shard-index": (("weight_map", "*"), "../elsewhere/weights.safetensors", "weight_map['"),
    "meta": (("splits", "train", "shards", 0, "file"), "../text/a.txt", "split 'train' (its 'file')"),
    "state": (("_data_files", 0, "filename"), "../secret/train/data-00000-of-00001.arrow", "_data_files[0].filename"),
    "dataset-dict": (("splits", 0), "../secret/train", "splits[0]"),
}


@pytest.mark.parametrize("entry", list(ESCAPES))
@pytest.mark.parametrize("how", ["climbing", "absolute"])
def test_a_file_name_leaving_the_folder_is_refused_naming_the_entry(world, tmp_path, capsys, entry, how):
    """The named file exists and is readable (the attack works without the check): refused, nothing written."""
    path, name, field = ESCAPES[entry]
    folder = ENTRIES[entry][0]
    if how == "absolute":
        name = str((world / folder / name).resolve())
    if entry == "shard-index":  # the weights a hostile index points to: real ones, outside the folder
        (tmp_path / "elsewhere").mkdir()
        shutil.copy(world / "sharded" / SHARD, tmp_path / "elsewhere" / "weights.safetensors")
        if how == "absolute":
            name = str(tmp_path / "elsewhere" / "weights.safetensors")
    assert Path(world / folder / name if how == "climbing" else name).exists() or entry == "shard-index"
    argv, _ = hostile(world, tmp_path, entry, at(path, name))
    rc, out = cli(argv, capsys)
    line = error_line(out)
    assert rc != 0 and field in line and repr(name) in line and "inside the folder" in line, line
    assert ENTRIES[entry][1] in line
    assert not (tmp_path / "out").exists() and not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.slow
def test_a_hugging_face_cache_folder_of_symlinks_still_loads(world, tmp_path, capsys):
    """snapshots/REV/ holds links into ../../blobs/ (as the Hugging Face cache lays it out): the names are
    inside the folder, so it trains, from a sharded index too."""
    blobs, snap = tmp_path / "cache" / "blobs", tmp_path / "cache" / "snapshots" / "abc123"
    blobs.mkdir(parents=True)
    snap.mkdir(parents=True)
    for i, f in enumerate(sorted((world / "sharded").iterdir())):
        shutil.copy(f, blobs / f"blob{i}")
        (snap / f.name).symlink_to(Path("..", "..", "blobs", f"blob{i}"))
    rc, out = cli(_train_from(world, tmp_path, snap), capsys)
    assert rc == 0, out[-3000:]
    assert list((tmp_path / "run" / "checkpoints").iterdir())


# ------------------------------------------------------------------------------------------------
# 2. every value read from a file is checked for its type and range where it is read


WRONG = {  # kind -> values of the wrong type (a JSON bool is not an int, "false" is not a bool)
    int: [None, "2", [2], True, 2.5, {"a": 1}],
    float: [None, "1e-5", [1e-5], True, {"a": 1}],
    bool: ["false", "true", 0, 1, [True]],
    str: [None, 3, ["x"], {"a": 1}, True],
    dict: [None, [], "x", 3],
    list: [None, {}, "x", 3],
}
FIELDS = {  # entry -> (path, kind, out-of-range values)
    "gpt2-config": [(("n_layer",), int, [0, -1]), (("layer_norm_epsilon",), float, [-1.0]),
                    (("tie_word_embeddings",), bool, []), (("scale_attn_weights",), bool, []),
                    (("activation_function",), str, [])],
    "llama-config": [(("hidden_size",), int, [0, -32]), (("rms_norm_eps",), float, [0.0, -1e-6]),
                     (("attention_bias",), bool, []), (("tie_word_embeddings",), bool, []),
                     (("architectures",), list, [[], ["LlamaForCausalLM"] * 2]), (("architectures", 0), str, ["x"]),
                     (("model_type",), str, ["gpt3"])],
    "shard-index": [(("weight_map",), dict, []), (("weight_map", "*"), str, [""])],
    "meta": [(("vocab_size",), int, [0, -5]), (("tokenizer",), dict, []), (("tokenizer", "eot_id"), int, [-1, 256, 10**9]),
             (("splits", "train", "shards", 0, "file"), str, [""]), (("splits", "train", "shards", 0, "tokens"), int, [-1])],
    "state": [(("_data_files",), list, []), (("_data_files", 0, "filename"), str, [""])],
    "dataset-dict": [(("splits",), list, []), (("splits", 0), str, [""])],
}
NULLABLE = {("tokenizer", "eot_id"), ("architectures",), ("model_type",)}  # null: no end-of-text id; ask the other key
CASES = [(e, path, v) for e, fields in FIELDS.items() for path, kind, rng in fields for v in WRONG[kind] + rng
         if not (v is None and path in NULLABLE)]


@pytest.mark.parametrize("entry,path,value", CASES, ids=[f"{e}-{'.'.join(map(str, p))}-{v!r:.12}" for e, p, v in CASES])
def test_a_wrong_value_in_a_file_is_one_line_naming_the_file_and_the_field(world, tmp_path, capsys, entry, path, value):
    argv, _ = hostile(world, tmp_path, entry, at(path, value))
    t0 = time.perf_counter()
    rc, out = cli(argv, capsys)
    line = error_line(out)
    field = next(k for k in reversed(path) if isinstance(k, str) and k != "*")
    assert rc != 0 and ENTRIES[entry][1] in line and field in line, line
    assert time.perf_counter() - t0 < 10 and not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.parametrize("entry", list(ENTRIES))
def test_a_whole_file_of_the_wrong_shape_is_refused(world, tmp_path, capsys, entry):
    """The document itself a list, a string or 100,000 arrays deep (RecursionError in every JSON reader)."""
    for body in (DEEP, "[1, 2]", '"x"', '{"a": ' * 50_000 + "1" + "}" * 50_000):
        shutil.rmtree(tmp_path, ignore_errors=True)
        tmp_path.mkdir()
        argv, _ = hostile(world, tmp_path, entry, lambda doc, body=body: body)
        rc, out = cli(argv, capsys)
        line = error_line(out)
        assert rc != 0 and ENTRIES[entry][1] in line, line
        if body.startswith(("[[", '{"a": {')):
            assert "nested too deep" in line, line


def test_deep_toml_is_refused_in_a_config_file_and_a_recorded_config(world, tmp_path, capsys):
    for body in ("[train]\nmax_steps = " + DEEP, "[train]\nx = " + "{a=" * 100_000 + "1" + "}" * 100_000):
        (tmp_path / "deep.toml").write_text(body)
        rc, out = cli(["config", "--preset", "tiny", "--config", tmp_path / "deep.toml"], capsys)
        line = error_line(out)
        assert rc == 2 and "deep.toml" in line and "nested too deep" in line, line
        (tmp_path / "run").mkdir(exist_ok=True)
        (tmp_path / "run" / "config.toml").write_text(body)
        rc, out = cli(["train", "--resume", "--run-dir", tmp_path / "run", *COMMON], capsys)
        line = error_line(out)
        assert rc == 2 and "config.toml" in line and "nested too deep" in line, line


def test_a_jsonl_record_nested_too_deep_is_a_bad_record_not_a_traceback(world, tmp_path, capsys):
    (tmp_path / "in").mkdir()
    good = [json.dumps({"text": f"doc {i} the cat sat"}) for i in range(20)]
    (tmp_path / "in" / "a.jsonl").write_text("\n".join([*good, '{"text": ' + DEEP + "}"]) + "\n")
    rc, out = cli(["prepare", tmp_path / "in", "--out", tmp_path / "out", "--tokenizer", "bytes", "--no-progress"],
                  capsys)
    assert "Traceback" not in out and "nested too deep" in out, out[-3000:]
    assert "a.jsonl" in out and (rc != 0 or (tmp_path / "out" / "meta.json").is_file())


def test_string_booleans_mean_what_they_say_nowhere(world, tmp_path, capsys):
    """"false" was read as true for tie_word_embeddings (dropping the untied head) and refused with a message
    saying it was true for attention_bias: both are refused now, saying the value is a string."""
    for entry, key in (("gpt2-config", "tie_word_embeddings"), ("llama-config", "attention_bias")):
        argv, _ = hostile(world, tmp_path / entry, entry, at((key,), "false"))
        rc, out = cli(argv, capsys)
        line = error_line(out)
        assert f"'{key}' must be true or false, got 'false'" in line and "config.json" in line, line


# ------------------------------------------------------------------------------------------------
# 3. numbers at the edge of what floats can hold


EDGES = ["inf", "-inf", "nan", "1e999999999", "-1e999999999", "1e-999999999", "1e-400"]
NUMERIC = ["optim.lr", "optim.weight_decay", "optim.grad_clip", "model.dropout", "data.cpu_work_ms"]


@pytest.mark.parametrize("value", EDGES)
@pytest.mark.parametrize("key", NUMERIC)
def test_an_edge_number_is_refused_at_once_on_a_flag_and_in_a_file(tmp_path, capsys, key, value):
    section, name = key.split(".")
    (tmp_path / "c.toml").write_text(f"[{section}]\n{name} = {value}\n")
    for argv in (["config", "--preset", "tiny", f"--{key}={value}"],
                 ["config", "--preset", "tiny", "--config", tmp_path / "c.toml"]):
        t0 = time.perf_counter()
        rc, out = cli(argv, capsys)
        assert time.perf_counter() - t0 < 15  # "at once" on a loaded 2-core machine; the hang this guards ran past 45 s
        line = error_line(out)
        assert rc == 2 and key in line and ("finite" in line or "too small" in line), line


def test_an_integer_of_5000_digits_is_refused_in_a_file_and_on_a_flag(world, tmp_path, capsys):
    (tmp_path / "c.toml").write_text(f"[train]\nmax_steps = {'9' * 5000}\n")
    rc, out = cli(["config", "--preset", "tiny", "--config", tmp_path / "c.toml"], capsys)
    assert rc == 2 and "c.toml" in error_line(out) and "digits" in error_line(out), out
    rc, out = cli(["config", "--preset", "tiny", "--train.max_steps", "9" * 5000], capsys)
    assert rc == 2 and "train.max_steps" in error_line(out), out
    argv, _ = hostile(world, tmp_path, "meta", at(("vocab_size",), 0))
    (tmp_path / "data" / "meta.json").write_text((tmp_path / "data" / "meta.json").read_text().replace(
        '"vocab_size": 0', '"vocab_size": ' + "9" * 5000))
    rc, out = cli(argv, capsys)
    assert rc != 0 and "meta.json" in error_line(out) and "digits" in error_line(out), out


@pytest.mark.parametrize("value", ["1e999999999", "1e-999999999", "1/1e-999999999", "nan", "inf"])
def test_an_edge_mixture_weight_is_refused_at_once(world, tmp_path, capsys, value):
    t0 = time.perf_counter()
    rc, out = cli(["train", "--preset", "tiny", "--data.mixture", f"{world / 'data'}:{value},{world / 'hfds'}:1",
                   "--run-dir", tmp_path / "run", "--train.max_steps", 1, *COMMON], capsys)
    assert time.perf_counter() - t0 < 15  # on a loaded machine; Fraction('1e999999999') ran for minutes
    line = error_line(out)
    assert rc == 2 and "data.mixture" in line and value.split("/")[-1] in line, line


def test_an_edge_number_given_to_a_command_option_is_refused(world, capsys):
    for value in ("1e-999999999", "inf", "nan"):
        rc, out = cli(["sample", "--run-dir", world, "--temperature", value], capsys)
        assert rc == 2 and "--temperature" in out and "Traceback" not in out, out


@pytest.mark.parametrize("value", [10**400, -(10**400)])
def test_an_integer_beyond_the_float_range_is_refused_where_a_number_is_read(value):
    """JSON holds integers of any size: one beyond what a float holds is a wrong value named with its field
    (``math.isfinite`` on it would raise OverflowError instead)."""
    from tokenmill.errors import DataError
    from tokenmill.filecheck import get

    with pytest.raises(DataError, match=r"summary.json: 'wall_s' must be a number, got [-]?1000"):
        get(json.loads(json.dumps({"wall_s": value})), "wall_s", float, "summary.json")
    assert get({"n": 12}, "n", int, "x.json", lo=1) == 12
