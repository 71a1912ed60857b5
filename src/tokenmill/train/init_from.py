"""``train.init_from``: start a run from the weights of another model (fine-tuning), not from a random init.

The source is a tokenmill run directory (its newest good checkpoint, single file or sharded DCP), one
checkpoint of a run (``RUN/checkpoints/step_XXXXXXXX.pt`` or ``.dcp``), or a local Hugging Face folder
of a class :mod:`tokenmill.model.hf` converts: ``GPT2LMHeadModel``, ``LlamaForCausalLM``,
``Qwen2ForCausalLM``, ``Qwen3ForCausalLM``, ``MistralForCausalLM`` (``config.json`` + ``model.safetensors``,
or shards with their ``*.index.json``, or ``pytorch_model.bin`` read with ``weights_only=True``).

- **Shape from the source.** Every architecture field (``model.vocab_size``, ``n_layer``, ``n_head``,
  ``n_embd``, ``n_kv_head``, ``head_dim``, ``intermediate_size``, ``pos_emb``, ``rope_*``, ``norm_type``,
  ``norm_eps``, ``mlp``, ``bias``, ``qkv_bias``, ``qk_norm``, ``tie_embeddings``: ``config.shape_fields()``)
  is the source's; ``model.block_size`` may be smaller than the source's context (learned positions:
  the first position embeddings are kept), never larger (a Mistral/Qwen sliding window shorter than
  the context caps it); a tied source may be untied (``model.tie_embeddings=false``, e.g. for pipeline
  parallelism: the head starts as a copy of the token embedding). A value chosen explicitly
  (on the command line or in a ``--config`` file; in Python: a value other than the field's default)
  that contradicts the source is a :class:`~tokenmill.errors.ConfigError` naming both. The run keeps
  its own forms of the same math (attention kernel, fused or separate q/k/v, vocabulary padding,
  norm/GELU form, dropout, loss form).
- **Fresh optimisation.** The optimizer state, the lr schedule, the data stream and the step start at
  0: a new run whose first weights are the source's (``--resume`` continues a run instead).
- **The checkpoint wins.** Once the run directory holds a checkpoint (``--resume``, a restarted
  torchrun worker) the source is not read at all: the run continues from its own checkpoint.
- **Before parallelisation.** The weights are loaded into the plain GPT that
  :func:`~tokenmill.train.parallelize.build_model` builds, before any switch, so pipeline split,
  tensor parallelism and FSDP split the loaded values.
- **Same tokenizer.** The data's vocabulary must be the source's (and, for a run, its tokenizer the
  same kind; a smaller one only when both tokenizer.json files hold the same tokens, as a Qwen
  tokenizer's for a model with padded embedding rows); otherwise a :class:`~tokenmill.errors.DataError` says to tokenize the text with
  ``tokenmill prepare --tokenizer-from SOURCE``.
- A run with ``train.max_steps = 0`` saves the loaded weights as its step-0 checkpoint (a converted
  model, e.g. to ``tokenmill export`` or ``tokenmill eval`` it).
"""

from __future__ import annotations

import copy
import json
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch

from tokenmill import checkpoint
from tokenmill import config as C
from tokenmill.checkpoint.files import DCP_NAME, FILE_NAME
from tokenmill.errors import CheckpointError, ConfigError, DataError
from tokenmill.model import GPT, hf, hf_families
from tokenmill.model.build import lora_model_roles
from tokenmill.model.gpt import adapt_state_dict

__all__ = ["InitSource", "adopt_shape", "check_weights", "explicit_keys", "find_source", "prepare_init_from"]



@dataclass
class InitSource:
    """A model to start from: ``kind`` 'hf' (a Hugging Face folder of class ``architecture``) or 'run' (a
    tokenmill run's ``checkpoint``); ``fields``: its shape (:data:`C.shape_fields()` and ``block_size``, its
    longest context, ``context_why`` says what limits it); ``tokenizer_json``: the source's
    ``tokenizer.json``, when it has one."""

    path: Path
    kind: str
    fields: dict[str, Any]
    checkpoint: Optional[Path] = None
    tokenizer_json: Optional[Path] = None
    architecture: Optional[str] = None
    context_why: str = "its block_size"

    def describe(self) -> str:
        if self.kind == "hf":
            return f"the Hugging Face {self.architecture} folder {self.path}"
        return f"the run {self.path} (checkpoint {self.checkpoint.name})"

    def weights(self, model_cfg: C.ModelConfig, vocab_size: int) -> dict[str, torch.Tensor]:
        """A state dict for ``GPT(model_cfg, vocab_size)`` (the run's forms: fused or separate q/k/v,
        vocabulary padding, a shorter block_size), on the CPU."""
        if vocab_size != self.fields["vocab_size"]:
            raise ConfigError(f"the model's vocabulary ({vocab_size}) is not the one of {self.describe()} "
                              f"({self.fields['vocab_size']}).")
        if self.kind == "hf":
            _, sd = hf.load_hf(self.path, base=model_cfg, block_size=model_cfg.block_size)
            return sd
        model, _, _ = checkpoint.load_model(self.path, self.checkpoint)
        sd = model.state_dict()
        if "wpe.weight" in sd:  # learned positions: the first block_size
            sd["wpe.weight"] = sd["wpe.weight"][: model_cfg.block_size]
        with torch.device("meta"):
            target = GPT(model_cfg, vocab_size)
        return adapt_state_dict(sd, target)

    def load(self, model_cfg: C.ModelConfig, vocab_size: int, data: Any) -> dict[str, torch.Tensor]:
        """Check the run's data (a :class:`~tokenmill.data.DataSources`) against the source, then
        return :meth:`weights` (for the trainer)."""
        self.check_data(data.vocab_size, data.data_dir)
        weights = self.weights(model_cfg, vocab_size)
        check_weights(weights, self.describe())
        return weights

    def check_data(self, data_vocab: int, data_dir: Optional[Path]) -> None:
        """The data must be tokenized as the source was: the same vocabulary size and, when both have a
        ``tokenizer.json``, the same tokens at the same ids; a smaller vocabulary only when both have
        one (a model whose embedding has more rows than its tokenizer ids, as Qwen's). ``data_dir``
        None: synthetic tokens."""
        vocab = self.fields["vocab_size"]
        data_tok = Path(data_dir) / "tokenizer.json" if data_dir is not None else None
        fewer_ok = data_vocab < vocab and data_tok is not None and _same_tokens(self.tokenizer_json, data_tok, True)
        if data_vocab != vocab and not fewer_ok:
            what = f"a vocabulary of {data_vocab} ids, but {self.describe()} has {vocab}"
        elif data_tok is not None and not _same_tokens(self.tokenizer_json, data_tok):
            what = (f"a tokenizer.json whose tokens differ from those of {self.describe()} ({self.tokenizer_json}), "
                    f"though both have {vocab} ids")
        else:
            return
        raise DataError(
            f"train.init_from: the data in '{data_dir}' has {what}: the source's embeddings are indexed by "
            "another tokenizer's ids. Fix: tokenize your text with the source's "
            f"tokenizer: `tokenmill prepare TEXT --out DIR --tokenizer-from {self.path}`, then train with "
            "--data.path DIR."
        )


def find_source(path: str | Path) -> InitSource:
    """The source ``path`` names (reads configs and checkpoint metadata, no weights of a DCP folder);
    :class:`CheckpointError` when it is none of the accepted forms."""
    p = Path(path).expanduser()
    if not p.exists():
        raise CheckpointError(f"train.init_from: '{p}' does not exist; pass a tokenmill run directory, one of its "
                              "checkpoints, or a local Hugging Face model folder.")
    if p.is_dir() and (p / hf.CONFIG_NAME).is_file():  # a Hugging Face folder (any class is checked)
        return _hf_source(p)
    if FILE_NAME.match(p.name) or DCP_NAME.match(p.name):  # one checkpoint of a run
        run_dir, ckpt, state = p.parent.parent, p, checkpoint.read_state(p)
    else:
        found = checkpoint.read_latest(p) if p.is_dir() else None
        if found is None:
            raise CheckpointError(
                f"train.init_from: '{p}' is neither a tokenmill run directory with a checkpoint (RUN/checkpoints/) "
                "nor a Hugging Face model folder (config.json + model.safetensors or pytorch_model.bin)."
            )
        run_dir, (ckpt, state) = p, found
    try:
        cfg = C.from_dict(state["config"])
    except (KeyError, ConfigError) as e:
        raise CheckpointError(f"train.init_from: checkpoint {ckpt} has no readable config ({e}).") from None
    vocab = state.get("vocab_size") or cfg.model.vocab_size
    if vocab is None:
        raise CheckpointError(f"train.init_from: checkpoint {ckpt} does not record its vocabulary size.")
    fields = {k: getattr(cfg.model, k) for k in C.shape_fields()}
    fields.update(vocab_size=int(vocab), block_size=cfg.model.block_size)
    own = [run_dir / "tokenizer", *([Path(cfg.data.path)] if cfg.data.path else [])]
    tok_json = next((f / "tokenizer.json" for f in own if (f / "meta.json").is_file()), None)
    return InitSource(run_dir, "run", fields, ckpt, tok_json if tok_json and tok_json.is_file() else None)


def _hf_source(p: Path) -> InitSource:
    """A Hugging Face folder as a source: its class, shape and what limits its context."""
    c = hf.read_hf_config(p)
    arch = hf.hf_architecture(c, str(p))
    why = "its n_positions: there are no position embeddings beyond it"
    if arch != hf.GPT2:
        s = hf_families.check_config(c, arch, str(p))
        why = (f"its sliding_window: {arch} attends only to the last {s.window} positions, tokenmill to all"
               if s.window and s.window < s.max_positions else "its max_position_embeddings")
    return InitSource(p, "hf", hf.hf_model_fields(c), tokenizer_json=p / "tokenizer.json", architecture=arch,
                      context_why=why)


def _same_tokens(a: Optional[Path], b: Path, strict: bool = False) -> bool:
    """Whether two tokenizer.json files map the same tokens to the same ids (when either is missing or
    unreadable, nothing to compare: True, or False when ``strict``)."""
    if a is None or not a.is_file() or not b.is_file():
        return not strict
    try:
        ta, tb = (json.loads(p.read_text(encoding="utf-8")) for p in (a, b))

        def tokens(t: dict) -> tuple:
            return t["model"]["vocab"], sorted((x["id"], x["content"]) for x in t.get("added_tokens") or [])

        return tokens(ta) == tokens(tb)
    except (OSError, ValueError, KeyError, TypeError, RecursionError):  # nested too deep: not comparable either
        return not strict


def adopt_shape(cfg: C.Config, src: InitSource, explicit: Optional[Iterable[str]] = None) -> C.Config:
    """A copy of ``cfg`` with the source's model shape. ``explicit``: the 'section.field' keys the user
    chose (command line, ``--config`` files); None: every model field that differs from its default
    counts as chosen. A chosen value that contradicts the source is a :class:`ConfigError`."""
    out = copy.deepcopy(cfg)
    default = C.ModelConfig()
    chosen_keys = set(explicit) if explicit is not None else None
    for name, theirs in src.fields.items():
        ours = getattr(out.model, name)
        chosen = (f"model.{name}" in chosen_keys) if chosen_keys is not None else ours != getattr(default, name)
        if name == "block_size":
            if chosen and ours > theirs:
                raise ConfigError(
                    f"model.block_size {ours} exceeds the context of train.init_from {src.describe()} ({theirs} "
                    f"positions, {src.context_why}). Use --model.block_size <= {theirs}."
                )
            if not chosen:
                out.model.block_size = theirs
        elif ours != theirs:
            if chosen and name == "tie_embeddings" and theirs:  # untie: the head starts as a copy of wte
                continue
            if chosen and not (name == "vocab_size" and ours is None):
                raise ConfigError(
                    f"model.{name} = {ours!r} conflicts with train.init_from {src.describe()}, whose model has "
                    f"{name} = {theirs!r}: a fine-tuning run takes the model's shape from its source. Drop "
                    f"--model.{name} (or set it to {_cli(theirs)})."
                )
            setattr(out.model, name, theirs)
    try:
        return C.validate(out)  # the source's shape too: an absurd one (config/size.py) stops before any weight
    except ConfigError as e:
        raise ConfigError(f"with the model shape of train.init_from {src.describe()}: {e}") from None


def _cli(v: Any) -> str:
    return str(v).lower() if isinstance(v, bool) else str(v)


def explicit_keys(overrides: Iterable[str], config_files: Iterable[str]) -> set[str]:
    """The 'section.field' keys a user chose: command-line overrides and the keys of ``--config`` files
    (not a preset's)."""
    keys = set(overrides)
    for path in config_files:
        keys |= set(C.flatten(C.load_toml(path), str(path)))
    return keys


def prepare_init_from(cfg: C.Config, has_checkpoints: bool, quiet: bool = False
                      ) -> tuple[C.Config, Optional[InitSource]]:
    """For the trainer: ``(cfg with the source's shape, source)``, or ``(cfg, None)`` when there is no
    ``train.init_from`` or the run directory already holds checkpoints (they win). Checks a prepared
    data folder's vocabulary early (``data.path``), before the datasets are opened."""
    if not cfg.train.init_from or has_checkpoints:
        if cfg.lora.rank and not has_checkpoints and not quiet:
            print(f"tokenmill: warning: lora.rank {cfg.lora.rank} without train.init_from: LoRA freezes the base "
                  "model and trains only the adapters, and this base is randomly initialised, so the run learns "
                  "low-rank corrections to random weights. To fine-tune a trained model add --train.init_from "
                  "RUN_DIR or HF_FOLDER; to train every weight, --lora.rank 0.", file=sys.stderr, flush=True)
        return cfg, None
    src = find_source(cfg.train.init_from)
    cfg = adopt_shape(cfg, src)
    C.check_lora_targets(cfg)  # lora.targets against the source's MLP
    if cfg.data.source == "tokens" and cfg.data.path:
        from tokenmill.data.meta import read_meta

        src.check_data(int(read_meta(cfg.data.path)["vocab_size"]), Path(cfg.data.path))
    elif cfg.data.source == "tokens" and not cfg.data.mixture:
        _check_embedded_corpus(src, cfg.data)
    if not quiet:
        lora = cfg.lora  # the roles the model's blocks have (a mixture of experts: 'experts', no dense MLP roles)
        how = (f"LoRA adapters of rank {lora.rank} on {','.join(lora_model_roles(cfg.model, lora))}, its "
               "weights frozen" if lora.rank else "its weights")
        print(f"tokenmill: fine-tuning from {src.describe()}: {how}, a fresh optimizer and schedule from step 0")
    return cfg, src


_EMBEDDED_VOCAB = {"bytes": 256, "gpt2": 50257}  # data.tokenizer -> its ids ('bpe': data.bpe_vocab_size)


def _check_embedded_corpus(src: InitSource, data: C.DataConfig) -> None:
    """Without data.path (or data.mixture) the run would train on the embedded corpus, tokenized by
    ``data.tokenizer``: refused before it is prepared, unless that tokenizer has the source's vocabulary, with
    the one command that prepares text with the source's own tokenizer."""
    vocab, theirs = _EMBEDDED_VOCAB.get(data.tokenizer, data.bpe_vocab_size), src.fields["vocab_size"]
    if vocab == theirs:
        return  # e.g. a run that trained on the embedded corpus: check_data compares the tokenizers later
    p = src.path
    has_tok = src.kind == "run" or (p / "tokenizer.json").is_file() or (
        (p / "vocab.json").is_file() and (p / "merges.txt").is_file())
    missing = "" if has_tok else (f" ({p} holds no tokenizer.json: point --tokenizer-from at the tokenizer.json the "
                                  "model was released with)")
    raise DataError(
        f"train.init_from {src.describe()}: no --data.path was given, so the run would train on tokenmill's embedded "
        f"corpus tokenized by its own '{data.tokenizer}' tokenizer ({vocab} ids), but the model's embeddings are "
        f"indexed by its tokenizer's {theirs} ids. Tokenize your text with the model's tokenizer: `tokenmill "
        f"prepare TEXT --out DIR --tokenizer-from {p}`{missing}, then train with --data.path DIR."
    )


def check_weights(weights: dict[str, torch.Tensor], where: str) -> None:
    """Imported weights must be real numbers: integer or quantised tensors (int8, fp8, packed 4-bit) are
    refused, as casting them to float would train on their raw codes; a NaN or Inf names its tensor (it
    is the source that is broken, not the learning rate)."""
    for name, t in weights.items():
        if not isinstance(t, torch.Tensor):
            raise CheckpointError(f"train.init_from: '{name}' in {where} is not a tensor ({type(t).__name__}).")
        if not t.is_floating_point() or t.element_size() < 2 or t.is_quantized:
            raise CheckpointError(
                f"train.init_from: '{name}' in {where} is {t.dtype}, not a float16/bfloat16/float32 weight: "
                "quantised or integer checkpoints are not supported; use the unquantised (bf16 or fp32) release "
                "of the model.")
        if not bool(torch.isfinite(t).all()):
            bad = int((~torch.isfinite(t)).sum())
            raise CheckpointError(f"train.init_from: '{name}' in {where} holds {bad} non-finite value(s) (NaN or "
                                  "Inf): the source is damaged; fine-tuning from it would stop at the first step.")

