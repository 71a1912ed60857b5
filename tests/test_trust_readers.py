"""Trust, issue 28 class 2, the readers converted last: every file a command reads from a folder the user names
(a run directory's summary.json / profile.json / metrics.jsonl / config.toml for ``tokenmill doctor`` and
``prepare --tokenizer-from RUN``, a prepared folder's meta.json for ``estimate``, a Hugging Face folder's
config.json / tokenizer_config.json, prepare's own journal) goes through :mod:`tokenmill.filecheck`: a wrong
type, a list for an object, nesting 100,000 deep or bytes that are not UTF-8 end with one line naming the file
(and the field), never a traceback.

The choices: a damaged summary.json or profile.json is refused (written atomically: damage is not a torn
write); a metrics.jsonl line that is not a metric record is skipped and counted in a warning naming its line
(a killed run tears its last line; the doctor and a resume read the rest); a config.toml value of the wrong
type for a field is left out of the doctor's findings, named in the warning; a damaged journal line ends the
journal there (a note names it) and the prepare resumes from the line before, or starts over.
"""

from __future__ import annotations

import copy
import importlib
import json
from pathlib import Path

import pytest

from conftest import tiny_cfg
from test_trust_files import cli, error_line  # the in-process command and its one error line
from tokenmill import config as C
from tokenmill.cli import main
from tokenmill.data import pipeline as pipeline_mod

prep = importlib.import_module("tokenmill.data.prepare")
ENCODE_PIECE = pipeline_mod.encode_piece
DEEP = "[" * 100_000 + "]" * 100_000
NOT_UTF8 = b'{"steps": "\xff\xfe"}\n'

# the files of a real `tokenmill profile --preset tiny` run on a CPU, cut to what the doctor reads
# (test_hand_built_files_have_the_real_ones_keys checks them against a real run)
SUMMARY = {"steps": 9, "start_step": 0, "final_loss": 4.18, "val_loss": 4.17, "params": 28544,
           "flops_per_token": 189696.0, "tokens_per_step": 128, "tokens_per_sec": 3781.7,
           "tokens_per_sec_min": 903.6, "tokens_per_sec_max": 6659.8, "tokens_per_sec_windows": [6659.8, 903.6],
           "step_time_ms": 33.85, "timing_windows": 2, "compile_s": None, "peak_alloc_mb_run": None,
           "peak_reserved_mb_run": None, "timing_from_step": 1, "mfu": None, "wall_s": 0.68, "warmup_s": 0.03,
           "eval_s": 0.005, "evals": 1, "checkpoint_s": 0.0, "checkpoints": 0, "log_s": 0.0015, "logs": 2,
           "device": "cpu", "torch": "2.13.0+cpu", "cuda": None, "world_size": 1, "layout": "single",
           "trainable_params": 28544, "peak_flops": None,
           "threads": {"intra_op": 1, "inter_op": 2, "cpu_count": 2, "local_world_size": 1}}
PHASE_MS = {"data": 3.36, "h2d": 0.04, "forward": 3.43, "backward": 4.79, "optimizer": 6.06}
METRICS = [{"step": s, "loss": 4.1, "lr": 8e-4, "grad_norm": 1.09, "tokens_per_sec": 6659.8, "mfu": None,
            **{f"{p}_ms": v for p, v in PHASE_MS.items()}, "step_ms": 19.22, "other_ms": 1.54} for s in (5, 9)]
METRICS.append({"step": 9, "val_loss": 4.175, "eval_ms": 5.27})
SRC = {"call": "aten::item", "op": "aten::item", "parent": "log", "region": "outside phases", "python": "",
       "per_step": 0.25, "ms_per_step": 0.0019}
PROFILE = {
    "version": 1, "device": "cpu", "schedule": {"wait": 2, "warmup": 2, "active": 4}, "tokens_per_step": 128,
    "breakdown": {"steps": [5, 6, 7, 8], "ms_per_step": {**PHASE_MS, "h2d": 0.09, "idle": 0.99, "step": 27.6},
                  "share": {"data": 0.12, "h2d": 0.003, "forward": 0.28, "backward": 0.24, "optimizer": 0.32,
                            "idle": 0.036},
                  "each_step_ms": {k: [v] * 4 for k, v in {**PHASE_MS, "step": 27.6}.items()},
                  "recompute": {"basis": "outermost forward operators", "ops_per_step": 0.0,
                                "ops_host_ms_per_step": 0.0, "host_ms_per_step": 0.0, "device_ms_per_step": None},
                  "outside": {"basis": "first to last forward operator", "eval_ms_per_step": 0.0,
                              "steps_with_eval": 0}},
    "host_busy": {"basis": "ATen operators", "busy_fraction": 0.41, "ops_per_step": 1995.0, "mean_op_us": 5.75},
    "device_busy": None,
    "top_ops": [{"name": "aten::addmm", "self_ms_per_step": 1.08, "share": 0.094, "calls_per_step": 1.0}],
    "top_kernels": [],
    "syncs": {"basis": "operators that would block", "per_step": 0.25, "ms_per_step": 0.0019, "sources": [SRC],
              "in_evaluation_per_step": 0.0},
    "memory": {"basis": "CPU allocations", "device": "cpu", "peak_mb": 0.63, "step_start_mb": 0.0,
               "transient_mb": 0.63, "peak_step": 8, "peak_at_ms": 11.7, "peak_at_fraction": 0.43,
               "peak_region": "backward", "peak_op": "autograd::engine", "top_live": []},
    "allocator": None, "per_block": None, "files": {"json": "profile.json"}, "notes": [],
}


def warning_lines(out: str) -> list[str]:
    assert "Traceback" not in out, out[-3000:]
    return [x for x in out.splitlines() if x.startswith("tokenmill: warning: ") or x.startswith("tokenmill: note: ")]


def run_dir(d: Path, summary=SUMMARY, profile=PROFILE, metrics=METRICS) -> Path:
    """A run directory as `tokenmill profile` writes it (None: that file left out)."""
    d.mkdir(parents=True, exist_ok=True)
    C.save(tiny_cfg(), d / "config.toml")
    for name, doc in (("summary.json", summary), ("profile.json", profile)):
        if doc is not None:
            (d / name).write_text(json.dumps(doc))
    if metrics is not None:
        (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in metrics))
    return d


def planted(doc: dict, path: tuple, value) -> dict:
    """A deep copy of ``doc`` with ``value`` at ``path`` (keys and list indices)."""
    out = copy.deepcopy(doc)
    at = out
    for k in path[:-1]:
        at = at[k]
    at[path[-1]] = value
    return out


def test_the_hand_built_run_is_read_as_it_is(tmp_path, capsys):
    """The baseline the damaged copies below start from: read with no warning, exit 0."""
    rc, out = cli(["doctor", run_dir(tmp_path / "run")], capsys)
    assert rc == 0 and not warning_lines(out), out
    assert "read profile.json, metrics.jsonl, summary.json" in out, out


# ----------------------------------------------------------------------------------------------
# summary.json and profile.json: refused, naming the file and the field


@pytest.mark.parametrize("name, path, value, says", [
    ("summary.json", ("tokens_per_step",), "128", "'tokens_per_step' must be an integer, got '128'"),
    ("summary.json", ("params",), True, "'params' must be an integer, got True"),
    ("summary.json", ("wall_s",), [0.68], "'wall_s' must be a number, got [0.68]"),
    ("summary.json", ("threads",), ["intra_op"], "'threads' must be an object, got ['intra_op']"),
    ("summary.json", ("threads", "cpu_count"), "2", "'threads.cpu_count' must be an integer, got '2'"),
    ("summary.json", ("tokens_per_sec_windows", 1), "fast", "'tokens_per_sec_windows[1]' must be a number"),
    ("profile.json", ("breakdown", "ms_per_step", "step"), "27.6", "'breakdown.ms_per_step.step' must be a number"),
    ("profile.json", ("breakdown", "share"), [0.1], "'breakdown.share' must be an object, got [0.1]"),
    ("profile.json", ("syncs", "sources", 0, "ms_per_step"), {"a": 1}, "'syncs.sources[0].ms_per_step' must be a "
                                                                       "number, got {'a': 1}"),
    ("profile.json", ("host_busy", "mean_op_us"), None, "'host_busy.mean_op_us' must be a number, got None"),
    ("profile.json", ("memory", "peak_region"), 7, "'memory.peak_region' must be a string, got 7"),
    ("profile.json", ("device",), ["cpu"], "'device' must be a string"),
], ids=lambda x: ".".join(map(str, x)) if isinstance(x, tuple) else None)
def test_a_wrong_value_in_summary_or_profile_is_one_line_naming_file_and_field(tmp_path, capsys, name, path, value,
                                                                              says):
    doc = {"summary.json": SUMMARY, "profile.json": PROFILE}[name]
    d = run_dir(tmp_path / "run", **{name.split(".")[0]: planted(doc, path, value)})
    rc, out = cli(["doctor", d], capsys)
    line = error_line(out)
    assert rc == 1 and f"{d / name}'" in line and says in line, line


@pytest.mark.parametrize("name", ["summary.json", "profile.json"])
@pytest.mark.parametrize("damage, says", [
    (b"[1, 2, 3]", "must hold an object, got [1, 2, 3]"),
    (DEEP.encode(), "is nested too deep"),
    (NOT_UTF8, "not UTF-8 text"),
    (b'{"steps": 9, "params": ', "is not valid JSON"),
    (b'{"tokens_per_step": 1e999}', "'tokens_per_step' must be an integer, got inf"),
], ids=["list", "deep", "not-utf8", "cut", "infinite"])
def test_a_damaged_summary_or_profile_is_one_line_naming_the_file(tmp_path, capsys, name, damage, says):
    d = run_dir(tmp_path / "run")
    (d / name).write_bytes(damage)
    rc, out = cli(["doctor", d], capsys)
    line = error_line(out)
    assert rc == 1 and f"{d / name}'" in line and says in line, line
    if name == "profile.json":
        assert "re-run `tokenmill profile`" in line


# ----------------------------------------------------------------------------------------------
# metrics.jsonl: a line that is not a metric record is skipped and counted, naming its line


@pytest.mark.parametrize("line, says", [
    (b"[1, 2]", "must hold an object (a metric record), got [1, 2]"),
    (b'{"step": 7, "loss": "4.1"}', "'loss' must be a number, got '4.1'"),
    (b'{"step": "7", "loss": 4.1}', "'step' must be an integer >= 0, got '7'"),
    (b'{"step": null, "loss": 4.1}', "'step' must be an integer >= 0, got None"),
    (b'{"step": 7, "event": 3}', "'event' must be a string, got 3"),
    (b'{"step": 7, "step_ms": {"a": 1}}', "'step_ms' must be a number"),
    (b'{"step": 7, "loss": 1e-999}', "too small for a float"),
    (DEEP.encode(), "is nested too deep"),
    (b'{"step": 7, "loss": "\xff"}', "is not UTF-8 text"),
], ids=["list", "str-loss", "str-step", "null-step", "int-event", "obj", "underflow", "deep", "not-utf8"])
def test_a_bad_metrics_line_is_skipped_with_a_warning_naming_it(tmp_path, capsys, line, says):
    d = run_dir(tmp_path / "run", profile=None)
    rows = (d / "metrics.jsonl").read_bytes().splitlines()
    (d / "metrics.jsonl").write_bytes(b"\n".join([rows[0], line, *rows[1:]]) + b"\n")  # line 2 of 4
    rc, out = cli(["doctor", d], capsys)
    warned = [w for w in warning_lines(out) if "metrics.jsonl" in w]
    assert rc == 0 and len(warned) == 1, out
    assert "skipped 1 unreadable line(s) (2;" in warned[0] and f"'{d / 'metrics.jsonl'}' line 2" in warned[0], warned
    assert says in warned[0], warned[0]
    assert "read metrics.jsonl, summary.json" in out  # the other rows still read


def test_metrics_with_no_readable_line_is_one_error(tmp_path, capsys):
    d = run_dir(tmp_path / "run", profile=None, summary=None)
    (d / "metrics.jsonl").write_bytes(b"[1]\n" + DEEP.encode() + b'\n{"step": "x"}\n')
    rc, out = cli(["doctor", d], capsys)
    line = error_line(out)
    assert rc == 1 and "metrics.jsonl' is unreadable" in line and "skipped 3 unreadable line(s) (1, 2, 3;" in line


def test_a_resume_drops_damaged_metric_lines_with_a_note(tmp_path, capsys):
    """On resume, lines after the checkpoint's step and lines that are not metric records go; a note counts the
    latter and names the first."""
    from tokenmill.train.metrics import read_metrics
    from tokenmill.train.resume import clean_metrics

    d = run_dir(tmp_path / "run", profile=None)
    with open(d / "metrics.jsonl", "ab") as f:
        f.write(b'{"step": 3, "loss": [4.0]}\n' + DEEP.encode() + b'\n{"step": 4, "lo')  # and a torn last line
    capsys.readouterr()
    clean_metrics(d, 5)
    err = capsys.readouterr().err
    assert "tokenmill: note: dropped 3 line(s) of metrics.jsonl" in err and "line 4: 'loss' must be a number" in err
    assert read_metrics(d) == METRICS[:1]


# ----------------------------------------------------------------------------------------------
# config.toml: the doctor leaves a wrong value out (the default is read) and says so


@pytest.mark.parametrize("field, value", [("model.n_head", '"x"'), ("model.n_head", "0"),
                                          ("model.block_size", "[1]"), ("checkpoint.every_steps", '"q"')])
def test_a_wrong_config_value_is_left_out_of_the_findings_naming_it(tmp_path, capsys, field, value):
    d = run_dir(tmp_path / "run", profile=None)
    section, name = field.split(".")
    text = (d / "config.toml").read_text()
    at = text.index(f"[{section}]")
    start = text.index(f"\n{name} = ", at) + 1
    end = text.index("\n", start)
    (d / "config.toml").write_text(text[:start] + f"{name} = {value}" + text[end:])
    rc, out = cli(["doctor", d], capsys)
    warned = [w for w in warning_lines(out) if "config.toml" in w]
    assert rc == 0 and len(warned) == 1, out
    assert f"Left out, read as this version's default: {field}." in warned[0], warned[0]


@pytest.mark.parametrize("damage, says", [(DEEP.replace("[", "a = [", 1).encode(), "is nested too deep"),
                                          (b"[train]\nbatch_size = \xff\n", "not UTF-8")])
def test_a_damaged_config_toml_is_one_line(tmp_path, capsys, damage, says):
    d = run_dir(tmp_path / "run", profile=None)
    (d / "config.toml").write_bytes(damage)
    rc, out = cli(["doctor", d], capsys)
    line = error_line(out)
    assert rc == 1 and f"{d / 'config.toml'}'" in line and says in line, line


# ----------------------------------------------------------------------------------------------
# estimate reads a prepared folder's meta.json; prepare --tokenizer-from reads a run's config.toml


def prepared(tmp_path: Path, capsys) -> Path:
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "c.jsonl").write_text("".join(json.dumps({"text": f"hello world {i} " * 5}) + "\n"
                                                      for i in range(60)))
    rc, out = cli(["prepare", tmp_path / "src", "--out", tmp_path / "data", "--tokenizer", "bytes", "--no-progress",
                   "--workers", "1"], capsys)
    assert rc == 0, out
    return tmp_path / "data"


@pytest.mark.parametrize("damage, says", [
    ({"vocab_size": "256"}, "'vocab_size' must be a positive integer, got '256'"),
    ({"vocab_size": 0}, "'vocab_size' must be a positive integer, got 0"),
    ({"splits": [1]}, "'splits' must be an object, got [1]"),
    (DEEP, "is nested too deep"),
    ([1, 2], "is not a tokenmill token folder description"),
], ids=["str", "zero", "list", "deep", "not-object"])
def test_estimate_refuses_a_damaged_meta_json_in_one_line(tmp_path, capsys, damage, says):
    data = prepared(tmp_path, capsys)
    meta = data / "meta.json"
    if isinstance(damage, dict):
        meta.write_text(json.dumps({**json.loads(meta.read_text()), **damage}))
    else:
        meta.write_text(damage if isinstance(damage, str) else json.dumps(damage))
    rc, out = cli(["estimate", "--preset", "tiny", "--data.path", data], capsys)
    line = error_line(out)
    assert rc == 1 and f"{meta}'" in line and says in line, line


@pytest.mark.parametrize("damage, says", [
    ('[data]\npath = 5\n', "[data]: 'path' must be a string, got 5"),
    ('data = [1]\n', "'data' must be an object, got [1]"),
    ('[data]\nsource = ["synthetic"]\n', "[data]: 'source' must be a string"),
    ('[data]\nbpe_vocab_size = "4096"\n', "[data]: 'bpe_vocab_size' must be a positive integer, got '4096'"),
    (DEEP.replace("[", "a = [", 1), "is nested too deep"),
    ('[data\n', "is not valid TOML"),
], ids=["path-int", "data-list", "source-list", "vocab-str", "deep", "invalid"])
def test_prepare_tokenizer_from_a_damaged_run_config_is_one_line(tmp_path, capsys, damage, says):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.toml").write_text(damage)
    (tmp_path / "c.txt").write_text("hello world\n" * 20)
    rc, out = cli(["prepare", tmp_path / "c.txt", "--out", tmp_path / "out", "--tokenizer-from", run,
                   "--no-progress"], capsys)
    line = error_line(out)
    assert rc == 1 and f"{run / 'config.toml'}'" in line and says in line, line


def test_prepare_tokenizer_from_a_run_reads_its_data_folder(tmp_path, capsys):
    """The positive case: a run's config.toml naming its prepared folder gives that folder's tokenizer."""
    data = prepared(tmp_path, capsys)
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.toml").write_text(f'[data]\npath = "{data}"\n')
    (tmp_path / "c.txt").write_text("hello world\n" * 20)
    rc, out = cli(["prepare", tmp_path / "c.txt", "--out", tmp_path / "out", "--tokenizer-from", run,
                   "--no-progress", "--workers", "1"], capsys)
    assert rc == 0 and "tokenizer bytes (256 ids)" in out, out


# ----------------------------------------------------------------------------------------------
# a Hugging Face folder's config.json / tokenizer_config.json (the end-of-sequence id)


def hf_folder(folder: Path, config=None, tokenizer_config=None) -> Path:
    """A tokenizer.json without <|endoftext|> (so the folder's files name the end id), and the two files."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    folder.mkdir(parents=True)
    vocab = {w: i for i, w in enumerate(["[UNK]", "</s>", "hello", "world", "<eos>"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(folder / "tokenizer.json"))
    for name, doc in (("config.json", config), ("tokenizer_config.json", tokenizer_config)):
        if doc is not None:
            (folder / name).write_text(doc if isinstance(doc, str) else json.dumps(doc))
    return folder


@pytest.mark.parametrize("config, tokenizer_config, eos", [
    (None, None, None),
    ({"eos_token_id": 1}, None, 1),
    ({"eos_token_id": [4, 1]}, None, 4),
    ({"eos_token_id": []}, {"eos_token": "</s>"}, 1),
    ({"eos_token_id": None}, {"eos_token": {"content": "<eos>", "special": True}}, 4),
    ({"eos_token_id": 99}, {"eos_token": None}, None),  # outside the vocabulary: not the tokenizer's
])
def test_the_folders_end_id_is_read_in_each_documented_form(tmp_path, config, tokenizer_config, eos):
    from tokenmill.data.tokenizers import load_hf_tokenizer_file

    folder = hf_folder(tmp_path / "hf", config, tokenizer_config)
    assert load_hf_tokenizer_file(folder / "tokenizer.json").eot_id == eos


@pytest.mark.parametrize("config, tokenizer_config, name, says", [
    ({"eos_token_id": "1"}, None, "config.json", "'eos_token_id' must be an integer >= 0, got '1'"),
    ({"eos_token_id": [1, "x"]}, None, "config.json", "'eos_token_id' must be an integer >= 0, got 'x'"),
    ({"eos_token_id": True}, None, "config.json", "'eos_token_id' must be an integer >= 0, got True"),
    ([1], None, "config.json", "must hold an object, got [1]"),
    (DEEP, None, "config.json", "is nested too deep"),
    (None, {"eos_token": 5}, "tokenizer_config.json", "'eos_token' must be a string, got 5"),
    (None, {"eos_token": {"content": ["</s>"]}}, "tokenizer_config.json", "eos_token: 'content' must be a string"),
    (None, "{", "tokenizer_config.json", "is not valid JSON"),
], ids=["str", "list-str", "bool", "list", "deep", "int-token", "content-list", "invalid"])
def test_prepare_from_a_damaged_hf_folder_is_one_line(tmp_path, capsys, config, tokenizer_config, name, says):
    folder = hf_folder(tmp_path / "hf", config, tokenizer_config)
    (tmp_path / "c.txt").write_text("hello world\n" * 20)
    rc, out = cli(["prepare", tmp_path / "c.txt", "--out", tmp_path / "out", "--tokenizer-from", folder,
                   "--no-progress"], capsys)
    line = error_line(out)
    assert rc == 1 and f"{folder / name}'" in line and says in line, line
    if "must be a" in says:
        assert "It must be" in line  # the forms the field may take


# ----------------------------------------------------------------------------------------------
# prepare's journal: a damaged line ends it there; the prepare resumes from the line before (or starts over)


def corpus(root: Path) -> Path:
    root.mkdir(parents=True)
    for f in range(3):
        (root / f"part-{f}.jsonl").write_text("".join(json.dumps({"text": f"record {f}.{i} " + "alpha beta " * (i % 7)})
                                                      + "\n" for i in range(150)))
    return root


def interrupt(tmp_path, monkeypatch, src: Path, stop: int) -> Path:
    """A prepare into ``out`` interrupted at its ``stop``-th piece (as Ctrl-C ends it); its journal."""
    calls = []

    def encode(piece):
        calls.append(piece)
        if len(calls) == stop:
            raise KeyboardInterrupt
        return ENCODE_PIECE(piece)

    monkeypatch.setattr(prep, "CHUNK_BYTES", 700)
    monkeypatch.setattr(prep, "COMMIT_SECONDS", 0.0)
    monkeypatch.setattr(pipeline_mod, "encode_piece", encode)
    assert main(["prepare", str(src), "--out", str(tmp_path / "out"), "--tokenizer", "bytes", "--workers", "1",
                 "--no-progress"]) == 130
    monkeypatch.setattr(pipeline_mod, "encode_piece", ENCODE_PIECE)
    return tmp_path / ".out.prepare" / "journal.jsonl"


def folder_files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.suffix == ".bin"}


@pytest.mark.parametrize("line, damage, says", [
    (3, b"[1, 2]", "must hold an object with 'file'"),
    (3, b'{"file": "0", "pos": null}', "'file' must be an integer >= 0, got '0'"),
    (4, DEEP.encode(), "is nested too deep"),
    (3, b"\xff\xfe", "is not UTF-8 text"),
    (4, "splits", "splits.train: 'tokens' must be an integer >= 0, got '10'"),
    (4, "counts", "counts: 'bad' must be an integer >= 0, got None"),
    (1, b'{"settings": [1]}', "'settings' must be an object"),
], ids=["list", "str-file", "deep", "not-utf8", "split-tokens", "counts", "header"])
def test_a_damaged_journal_line_resumes_from_the_line_before(tmp_path, monkeypatch, capsys, line, damage, says):
    src = corpus(tmp_path / "in")
    journal = interrupt(tmp_path, monkeypatch, src, stop=8)
    lines = journal.read_bytes().splitlines()
    assert len(lines) >= 5, lines  # the header and commits
    if damage in ("splits", "counts"):
        rec = json.loads(lines[line - 1])
        if damage == "splits":
            rec["splits"]["train"]["tokens"] = "10"
        else:
            rec["counts"]["bad"] = None
        damage = json.dumps(rec).encode()
    lines[line - 1] = damage
    journal.write_bytes(b"\n".join(lines) + b"\n")
    rc, out = cli(["prepare", src, "--out", tmp_path / "out", "--tokenizer", "bytes", "--workers", "1",
                   "--no-progress"], capsys)
    assert rc == 0 and "Traceback" not in out, out
    notes = [x for x in out.splitlines() if x.startswith("tokenmill: note:") and "journal" in x]
    assert len(notes) == 1 and f"{journal}' line {line}" in notes[0] and says in notes[0], out
    assert ("starts over" if line == 1 else "resumes from before that line") in notes[0]
    assert ("resuming an interrupted prepare" in out) == (line > 2), out
    rc, ref = cli(["prepare", src, "--out", tmp_path / "ref", "--tokenizer", "bytes", "--workers", "1",
                   "--no-progress"], capsys)
    assert rc == 0 and folder_files(tmp_path / "out") == folder_files(tmp_path / "ref")


def test_a_torn_last_journal_line_is_no_news(tmp_path, monkeypatch, capsys):
    """The line an interruption cut (no line end) ends the journal without a note."""
    src = corpus(tmp_path / "in")
    journal = interrupt(tmp_path, monkeypatch, src, stop=8)
    journal.write_bytes(journal.read_bytes() + b'{"file": 0, "po')
    rc, out = cli(["prepare", src, "--out", tmp_path / "out", "--tokenizer", "bytes", "--workers", "1",
                   "--no-progress"], capsys)
    assert rc == 0 and "resuming an interrupted prepare" in out and "tokenmill: note:" not in out, out


def test_a_pipe_whose_first_line_is_nested_too_deep_is_read_as_text(tmp_path, capsys):
    """Telling a pipe's kind parses its first line: JSON nested 50,000 deep there is text, not a traceback."""
    from test_trust_inputs import feed

    data = ('{"a": ' + "[" * 50_000 + "]" * 50_000 + "}\n").encode() + b"hello world\n" * 50
    rc, out = cli(["prepare", feed(data), "--out", tmp_path / "out", "--tokenizer", "bytes", "--workers", "1",
                   "--no-progress", "--val-fraction", "0"], capsys)
    assert rc == 0 and "Traceback" not in out, out
    assert json.loads((tmp_path / "out" / "meta.json").read_text())["splits"]["train"]["tokens"] >= len(data)


# ----------------------------------------------------------------------------------------------
# the hand-built files above match what a real run writes


@pytest.mark.slow
def test_hand_built_files_have_the_real_ones_keys(tmp_path, capsys):
    """A real `tokenmill profile` run: its files read cleanly, hold every key the hand-built ones do (so the
    damaged copies above are copies of real files), and a damaged copy of the real summary is refused."""
    rc, out = cli(["profile", "--preset", "tiny", "--data.source", "synthetic", "--model.vocab_size", "64",
                   "--train.device", "cpu", "--log.progress", "plain", "--log.tensorboard", "false",
                   "--train.precision", "fp32", "--run-dir", tmp_path / "run"], capsys)
    assert rc == 0, out
    d = tmp_path / "run"
    rc, out = cli(["doctor", d], capsys)
    assert rc == 0 and not warning_lines(out), out
    summary, profile = (json.loads((d / n).read_text()) for n in ("summary.json", "profile.json"))
    assert set(SUMMARY) <= set(summary) and set(SUMMARY["threads"]) <= set(summary["threads"])
    for key in ("breakdown", "host_busy", "syncs", "memory"):
        assert set(PROFILE[key]) <= set(profile[key]), key
    rows = [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines()]
    assert set(METRICS[0]) <= set(rows[0]) and set(METRICS[-1]) <= set(rows[-1])
    (d / "summary.json").write_text(json.dumps(planted(summary, ("tokens_per_sec",), "fast")))
    rc, out = cli(["doctor", d], capsys)
    assert rc == 1 and "'tokens_per_sec' must be a number, got 'fast'" in error_line(out)
