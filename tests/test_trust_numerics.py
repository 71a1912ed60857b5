"""Numerics a user can trust: a NaN stop names a checkpoint that did not produce the NaN (the one that did
is set aside, kept but never loaded, so --resume goes on from a good one), and imported weights that are
integers, quantised or non-finite are refused naming the tensor."""


import pytest
import torch

from conftest import run_cli, tiny_cfg
from tokenmill import checkpoint as ckpt
from tokenmill.errors import TrainingError
from tokenmill.train.trainer import Callbacks, train


def poison_after(step_to_poison, holder):
    def hook(step):
        if step == step_to_poison:
            with torch.no_grad():
                next(holder["model"].parameters()).fill_(float("nan"))
    return hook


@pytest.mark.slow
@pytest.mark.parametrize("keep_last", [1, 2])
def test_nan_weights_saved_in_a_checkpoint_are_set_aside_and_resume_starts_before(tmp_path, keep_last):
    """Step 8's update leaves NaN weights, checkpoint 8 saves them (its losses were all finite), step 9's loss
    is NaN: checkpoint 8 is set aside and the message and --resume use checkpoint 4, even with keep_last 1."""
    cfg = tiny_cfg(**{"train.max_steps": 20, "checkpoint.every_steps": 4, "log.every_steps": 5,
                      "checkpoint.keep_last": keep_last})
    holder = {}
    with pytest.raises(TrainingError, match=r"loss became nan at step 9.*last good checkpoint is \S*step_00000004\.pt"
                                            r".*step_00000008\.pt\.nonfinite holds the weights that produced it"):
        train(cfg, tmp_path, quiet=True, callbacks=Callbacks(
            on_model_built=lambda m: holder.__setitem__("model", m), on_step_end=poison_after(8, holder)))
    assert [s for s, _ in ckpt.list_checkpoints(tmp_path)] == [4]
    assert (tmp_path / "checkpoints" / "step_00000008.pt.nonfinite").is_file()  # kept, not deleted
    summary = train(cfg, tmp_path, resume=True, quiet=True)  # the cause gone: resumes from step 4 and finishes
    assert summary["final_loss"] is not None and [s for s, _ in ckpt.list_checkpoints(tmp_path)][-1] == 20


def _tokenmill(*args):
    return run_cli(*args)


@pytest.fixture(scope="module")
def hf_source(tmp_path_factory):
    """A small random Llama folder (vocabulary 64, as the synthetic data)."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("safetensors")
    d = tmp_path_factory.mktemp("hf")
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    transformers.LlamaForCausalLM(cfg).save_pretrained(d)
    return d


@pytest.mark.slow
@pytest.mark.parametrize("damage, message", [
    (lambda t: t.to(torch.int8), "is torch.int8, not a float16/bfloat16/float32 weight"),
    (lambda t: t.to(torch.float8_e4m3fn), "is torch.float8_e4m3fn, not a float16/bfloat16/float32 weight"),
    (lambda t: t.index_fill(0, torch.tensor([0]), float("nan")), "non-finite value(s)"),
])
def test_damaged_imported_weights_are_refused_naming_the_tensor(hf_source, tmp_path, damage, message):
    from safetensors.torch import load_file, save_file

    path = hf_source / "model.safetensors"
    original = path.read_bytes()
    weights = load_file(path)
    weights["model.layers.1.mlp.up_proj.weight"] = damage(weights["model.layers.1.mlp.up_proj.weight"])
    save_file(weights, path, metadata={"format": "pt"})
    try:
        out = _tokenmill("train", "--preset", "tiny", "--data.source", "synthetic", "--model.vocab_size", "64",
                         "--train.init_from", str(hf_source), "--run-dir", str(tmp_path / "ft"),
                         "--train.max_steps", "1", "--model.block_size", "32")
        assert out.returncode != 0 and "Traceback" not in out.stderr, out.stderr
        assert "'blocks.1.mlp.c_fc.weight'" in out.stderr and message in out.stderr, out.stderr
        assert "learning rate" not in out.stderr.lower() and not (tmp_path / "ft" / "checkpoints").exists()
    finally:
        path.write_bytes(original)


@pytest.mark.slow
def test_sampling_a_diverged_run_says_so(tmp_path):
    from tokenmill.data import prepare

    (tmp_path / "a.txt").write_text("the cat sat on the mat. " * 400)
    data = prepare(tmp_path / "a.txt", tmp_path / "data", "bytes", workers=1, progress=False)
    run = tmp_path / "run"
    train(tiny_cfg(**{"train.max_steps": 1, "train.eval_batches": 0, "data.source": "tokens",
                      "data.path": str(data), "model.vocab_size": None}), run, quiet=True)
    [(_, path)] = ckpt.list_checkpoints(run)[-1:]
    state = torch.load(path, weights_only=True)
    state["model"]["ln_f.weight"].fill_(float("nan"))
    torch.save(state, path)
    out = _tokenmill("sample", "--run-dir", str(run), "--max-new-tokens", "3", "--prompt", "ab")
    assert out.returncode != 0 and "Traceback" not in out.stderr, out.stderr
    assert "logits are not finite" in out.stderr and "--checkpoint" in out.stderr, out.stderr
