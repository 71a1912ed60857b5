"""Task scores through EleutherAI's lm-evaluation-harness: ``tokenmill eval PATH... --tasks NAMES`` and
``eval.tasks`` during training.

- **The model** (:func:`load_source`): a run directory's newest good checkpoint (or ``--checkpoint``; any layout,
  LoRA merged: :func:`tokenmill.checkpoint.load_model`) with the run's tokenizer, or a local Hugging Face folder
  of a family tokenmill reads (GPT-2, Llama, Qwen2, Qwen3, Mistral; its context capped at 4096 tokens) with its
  own tokenizer. It is wrapped as an lm-eval model by :class:`tokenmill.train.lm_eval_model.TokenmillLM`.
- **The tasks** (:func:`task_manager`): lm-eval's own names (its task index, which it builds by reading every
  task file it ships: about 15 s), and those of ``--include-path DIR`` (lm-eval's custom tasks: a YAML file per
  task beside its data; when every name is found there, lm-eval's own index is not built). An unknown name is
  one line with the closest names.
- **The run** (:func:`run_tasks`): lm-eval's ``evaluate`` with the task set-up of its ``simple_evaluate`` (the
  tasks' own few-shot counts unless ``num_fewshot``, 0 when a task has none; its seeds: 0 for Python's
  ``random``, 1234 for numpy, torch and the few-shot sampler), without the environment report
  ``simple_evaluate`` adds (it starts processes: pip, git). The random states are restored afterwards.
- **The results**: lm-eval's table (``lm_eval.utils.make_table``), or one table of every model side by side;
  lm-eval's results JSON (``--log-samples``: with every document's requests and responses) written atomically
  to ``RUN/tasks-<time>.json`` for a run, to ``--out FILE`` when given (a Hugging Face folder is never written to).
- **During training** (``[eval]`` section, :class:`TaskEval`): the tasks every ``eval.tasks_every_steps`` steps
  and at the end, ``eval.tasks_limit`` documents each; the scores (``tasks/TASK/METRIC``) logged to
  metrics.jsonl, TensorBoard and W&B, put in summary.json and the progress line, their time counted as
  evaluation (outside the steady-state tokens/s). Under torchrun with a replicated model (one process per rank,
  DDP) each rank scores its share of the documents; sharded models (FSDP, TP, PP) are refused at set-up: each
  rank would need the whole model.
"""

from __future__ import annotations

import contextlib
import difflib
import json
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch

from tokenmill import atomic
from tokenmill.errors import CheckpointError, ConfigError
from tokenmill.paths import check_output

__all__ = ["TaskEval", "eval_and_log", "evals_due", "load_source", "run_cli", "run_tasks", "scores", "task_manager"]

INSTALL = "pip install 'tokenmill[eval]'"
MAX_CONTEXT = 4096  # a Hugging Face folder's context here, at most (as tokenmill chat)
SEEDS = {"random": 0, "numpy": 1234, "torch": 1234, "fewshot": 1234}  # lm-eval's simple_evaluate defaults


def require_lm_eval() -> None:
    """One line naming the extra when lm-eval (or transformers, its tokenizers) is not installed."""
    try:
        import lm_eval  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as e:
        raise ConfigError(f"task evaluation runs EleutherAI's lm-evaluation-harness, which is not installed ({e.name} "
                          f"is missing). Fix: {INSTALL}") from None


def task_names(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise ConfigError("--tasks names no task; give lm-eval task names, comma-separated (e.g. hellaswag,arc_easy).")
    return names


def task_manager(names: list[str], include_path: Optional[str] = None):
    """lm-eval's ``TaskManager`` that knows ``names`` (only ``include_path``'s tasks when all are there); an
    unknown name is a :class:`ConfigError` with the closest known names."""
    import logging

    from lm_eval.tasks import TaskManager

    logging.getLogger("lm_eval").setLevel(logging.WARNING)
    paths = [p.strip() for p in (include_path or "").split(",") if p.strip()]
    for p in paths:
        if not Path(p).expanduser().is_dir():
            raise ConfigError(f"--include-path '{p}' is not a folder; give the folder of your task YAML files.")
    paths = [str(Path(p).expanduser()) for p in paths]
    if paths:
        local = TaskManager(include_path=paths, include_defaults=False)
        if all(n in local.all_tasks for n in names):
            return local
    manager = TaskManager(include_path=paths or None)
    check_names(names, manager.all_tasks, paths)
    return manager


def check_names(names: list[str], known: list[str], paths: list[str] = ()) -> None:
    """:class:`ConfigError` for the first name that is neither a task, group or tag ``known`` nor a YAML file."""
    for n in names:
        if n in known or (n.endswith((".yaml", ".yml")) and Path(n).is_file()):
            continue
        close = difflib.get_close_matches(n, known, n=3, cutoff=0.6)
        hint = f" Closest: {', '.join(close)}." if close else ""
        where = f" or in --include-path {', '.join(paths)}" if paths else ""
        raise ConfigError(f"unknown task '{n}': not among lm-eval's {len(known):,} tasks, groups and tags{where}.{hint}"
                          " `lm-eval ls tasks` lists them.")


# ----------------------------------------------------------------------------------------------
# The model


@dataclass
class Source:
    """A model to score: a run (``kind`` 'run') or a Hugging Face folder ('hf'), its GPT and tokenizer."""

    path: Path
    kind: str
    model: Any
    tokenizer: Any
    checkpoint: Optional[Path] = None
    step: Optional[int] = None
    stop_ids: set = field(default_factory=set)


def check_source(path: str | Path) -> str:
    """'run' or 'hf' for ``path``, checked without loading weights: one line for a missing path, a run with no
    checkpoint, a folder of a family tokenmill does not read."""
    from tokenmill import checkpoint
    from tokenmill.model import hf
    from tokenmill.train.init_from import find_source
    from tokenmill.train.sample import check_has_checkpoint

    p = Path(path).expanduser()
    if (p / hf.CONFIG_NAME).is_file():
        find_source(p)  # the family and its config, as train.init_from checks them
        return "hf"
    check_has_checkpoint(p)
    if not checkpoint.list_checkpoints(p):
        raise CheckpointError(f"{p} has no checkpoint (no {p / 'checkpoints'}/step_*): train first, or pass a run "
                              "directory with checkpoints or a Hugging Face model folder.")
    return "run"


def load_source(path: str | Path, checkpoint_path: Optional[str] = None, chat: bool = False) -> Source:
    """The model and tokenizer of a run directory or a Hugging Face folder (see the module doc), on the CPU."""
    from tokenmill.checkpoint.files import DCP_NAME, FILE_NAME

    p = Path(path).expanduser()
    if check_source(p) == "hf":
        return _load_folder(p, chat)
    from tokenmill import checkpoint

    model, cfg, ckpt = checkpoint.load_model(p, checkpoint_path)
    m = FILE_NAME.match(ckpt.name) or DCP_NAME.match(ckpt.name)
    tok, stops = None, set()
    if cfg.data.source != "synthetic":
        from tokenmill.checkpoint import tokenizer_dir

        tok, stops = run_tokenizer(tokenizer_dir(p, cfg), cfg, chat, str(p))
    return Source(p, "run", model, tok, ckpt, int(m.group(1)) if m else None, stops if tok is not None else set())


def _load_folder(p: Path, chat: bool) -> Source:
    from tokenmill.model import GPT, hf
    from tokenmill.train.init_from import find_source

    src = find_source(p)
    mcfg, sd = hf.load_hf(p, block_size=min(src.fields["block_size"], MAX_CONTEXT))
    model = GPT(mcfg, mcfg.vocab_size)
    model.load_state_dict(sd)
    tok = None
    if any((p / f).is_file() for f in ("tokenizer.json", "vocab.json", "tokenizer.model")):
        import transformers

        try:
            tok = transformers.AutoTokenizer.from_pretrained(str(p), local_files_only=True)
        except Exception as e:  # transformers raises many kinds for a broken folder
            raise CheckpointError(f"{p}: its tokenizer cannot be loaded by transformers ({str(e).strip()[:200]}).") from None
    stops = _end_ids(hf.read_hf_config(p))
    if (p / "generation_config.json").is_file():  # the end ids transformers' generate stops at
        from tokenmill.filecheck import read_json

        stops |= _end_ids(read_json(p / "generation_config.json", "generation config", CheckpointError))
    if chat and tok is not None and not tok.chat_template:
        raise ConfigError(f"--apply-chat-template: {p} has no chat template (tokenizer_config.json, chat_template.jinja).")
    return Source(p, "hf", model, tok, stop_ids=stops)


def _end_ids(config: dict) -> set:
    """A config's ``eos_token_id`` (an id or a list of ids) as a set; anything else: none."""
    eos = config.get("eos_token_id")
    return {e for e in (eos if isinstance(eos, list) else [eos]) if isinstance(e, int) and not isinstance(e, bool)}


def run_tokenizer(tok_dir: Path, cfg: Any, chat: bool, name: str) -> tuple[Any, set]:
    """The transformers tokenizer of a run and the ids that end a generation: the files ``tokenmill export``
    writes (with the chat template, its special tokens and end ids, of the run's chat data or its
    ``train.init_from``), built in a temporary folder. ``chat``: a template is required."""
    import transformers

    from tokenmill.checkpoint.export import find_chat_files, write_chat_files
    from tokenmill.data.tokenizers import write_hf_tokenizer_for_data
    from tokenmill.errors import PathError
    from tokenmill.filecheck import read_json

    tmp = Path(tempfile.mkdtemp(prefix="tokenmill-tasks-"))
    try:
        _, skipped = write_hf_tokenizer_for_data(tok_dir, tmp, cfg.model.block_size)
        if skipped:
            raise ConfigError(f"{name}: its tokenizer has no Hugging Face form, which lm-eval needs ({skipped}).")
        try:
            files = find_chat_files(tok_dir, cfg)
        except (CheckpointError, PathError):
            if chat:
                raise
            files = None  # as an export: the template is left out, the tokens stay
        if files is not None and files.template is not None:
            write_chat_files(tmp, files)
        elif chat:
            raise ConfigError(f"--apply-chat-template: {name} has no chat template "
                              f"({files.missing or 'it was not trained on chat data and its train.init_from has none'}).")
        gen = tmp / "generation_config.json"
        stops = _end_ids(read_json(gen, "generation config", CheckpointError)) if gen.is_file() else set()
        return transformers.AutoTokenizer.from_pretrained(str(tmp), local_files_only=True), stops
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def make_lm(src: Source, device: torch.device, batch_size: int, autocast_dtype: Optional[torch.dtype] = None,
            rank: int = 0, world_size: int = 1):
    """``src`` as an lm-eval model on ``device``; a model without a tokenizer is one line (the tasks are text)."""
    from tokenmill.train.lm_eval_model import TokenmillLM

    if src.tokenizer is None:
        why = "it was trained on synthetic tokens" if src.kind == "run" else "the folder has no tokenizer files"
        raise ConfigError(f"{src.path} has no tokenizer ({why}): lm-eval's tasks are text, to be turned into the "
                          "model's ids. Evaluate a run trained on text, or a folder with its tokenizer.json.")
    return TokenmillLM(src.model.to(device), src.tokenizer, device, batch_size, autocast_dtype, str(src.path), rank,
                       world_size, src.stop_ids)


def autocast_for(device: torch.device) -> Optional[torch.dtype]:
    """bf16 autocast on a CUDA GPU with bf16, else None (fp32)."""
    from tokenmill.train.precision import bf16_supported

    return torch.bfloat16 if bf16_supported(device) else None


# ----------------------------------------------------------------------------------------------
# Running lm-eval


@contextlib.contextmanager
def _kept_random_state():
    """Python's, numpy's and torch's random states (CPU and CUDA) as they were before."""
    import random

    import numpy as np

    py, npy, cpu = random.getstate(), np.random.get_state(), torch.get_rng_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    try:
        yield
    finally:
        random.setstate(py)
        np.random.set_state(npy)
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)


def run_tasks(lm: Any, names: list[str], manager: Any, num_fewshot: Optional[int] = None, limit: Optional[float] = None,
              chat: bool = False, log_samples: bool = False, bootstrap_iters: int = 100000) -> Optional[dict]:
    """lm-eval's results dict for ``names`` (None on a rank other than 0); see the module doc."""
    import random

    import numpy as np
    from lm_eval.evaluator import evaluate

    loaded = manager.load(names)
    for task in loaded["tasks"].values():
        own = task.get_config("num_fewshot")
        if num_fewshot is not None and own != 0:  # a task that fixes 0 shots keeps them (as simple_evaluate)
            task.set_config(key="num_fewshot", value=num_fewshot)
        elif own is None:
            task.set_config(key="num_fewshot", value=0)
        task.set_fewshot_seed(seed=SEEDS["fewshot"])
    with _kept_random_state():
        random.seed(SEEDS["random"])
        np.random.seed(SEEDS["numpy"])
        torch.manual_seed(SEEDS["torch"])
        return evaluate(lm=lm, task_dict=loaded, limit=limit, bootstrap_iters=bootstrap_iters, log_samples=log_samples,
                        apply_chat_template=chat, fewshot_as_multiturn=chat)


def scores(results: dict) -> dict[str, float]:
    """The numbers of lm-eval's results as ``tasks/TASK/METRIC`` (``/FILTER`` unless it is 'none'), standard
    errors left out."""
    out = {}
    for section in ("groups", "results"):
        for task, metrics in (results.get(section) or {}).items():
            for key, v in metrics.items():
                metric, _, filt = key.partition(",")
                if not filt or "_stderr" in metric or isinstance(v, bool) or not isinstance(v, (int, float)):
                    continue
                out[f"tasks/{task}/{metric}" + ("" if filt == "none" else f"/{filt}")] = float(v)
    return out


def results_json(results: dict) -> str:
    from lm_eval.utils import handle_non_serializable

    return json.dumps(results, indent=2, default=handle_non_serializable, ensure_ascii=False) + "\n"


def compare_table(names: list[str], all_scores: list[dict[str, float]]) -> str:
    """One Markdown table: a row per task and metric, a column per model."""
    keys = list(dict.fromkeys(k for s in all_scores for k in s))
    head = "| task | metric | " + " | ".join(names) + " |\n|---|---|" + "---:|" * len(names)
    rows = []
    for k in keys:
        _, task, metric = k.split("/", 2)
        vals = [f"{s[k]:.4f}" if k in s else "-" for s in all_scores]
        rows.append(f"| {task} | {metric} | " + " | ".join(vals) + " |")
    return "\n".join([head, *rows])


# ----------------------------------------------------------------------------------------------
# tokenmill eval PATH... --tasks NAMES


def run_cli(args: Any) -> int:
    """``tokenmill eval PATH... --tasks NAMES`` (see the module doc): every input checked (paths, task names)
    before any model loads or anything is written."""
    from tokenmill.train.device import resolve_device

    require_lm_eval()
    names = task_names(args.tasks)
    paths = list(args.paths or []) + ([args.run_dir] if args.run_dir else [])
    if not paths:
        raise ConfigError("tokenmill eval needs a run directory or a Hugging Face folder: tokenmill eval PATH --tasks ...")
    if args.batches is not None or args.data_path is not None:
        raise ConfigError("--batches and --data.path choose the validation loss's windows; with --tasks the documents "
                          "are the tasks' (--limit N takes the first N of each).")
    if args.limit is not None and args.limit <= 0:
        raise ConfigError(f"--limit must be > 0 (documents per task, or a fraction below 1), got {args.limit}.")
    out = Path(args.out).expanduser() if args.out else None
    if out is not None and (out.is_dir() or not out.parent.is_dir()):
        raise ConfigError(f"--out '{out}': give a file path in an existing folder for the results JSON.")
    kinds = [check_source(p) for p in paths]
    if out is not None:  # never over what is read: a model folder, a run's checkpoints and tokenizer, the tasks
        read = {"--include-path": args.include_path, "--checkpoint": args.checkpoint}
        for p, kind in zip(paths, kinds):
            if kind == "hf":
                read[f"the model folder {p}"] = p
            else:
                read |= {f"the checkpoints of {p}": Path(p).expanduser() / "checkpoints",
                         f"the tokenizer of {p}": Path(p).expanduser() / "tokenizer"}
        check_output(out, read)
    if args.checkpoint and len(paths) > 1:
        raise ConfigError("--checkpoint names one checkpoint: evaluate one run with it.")
    device = resolve_device(args.device, "--device")
    manager = task_manager(names, args.include_path)
    limit = int(args.limit) if args.limit is not None and args.limit >= 1 else args.limit
    every, written = [], []
    for p, kind in zip(paths, kinds):
        src = load_source(p, args.checkpoint, args.apply_chat_template)
        lm = make_lm(src, device, args.batch_size or 8, autocast_for(device))
        r = run_tasks(lm, names, manager, args.num_fewshot, limit, args.apply_chat_template, args.log_samples)
        del lm, src.model
        r["tokenmill"] = {"source": str(p), "kind": kind, "checkpoint": str(src.checkpoint) if src.checkpoint else None,
                          "step": src.step, "batch_size": args.batch_size or 8, "limit": limit,
                          "num_fewshot": args.num_fewshot, "device": str(device),
                          "precision": "bf16-autocast" if autocast_for(device) else "fp32",
                          "apply_chat_template": args.apply_chat_template, "date": time.strftime("%Y-%m-%dT%H:%M:%S")}
        every.append(r)
        if kind == "run" and out is None:
            written.append(_results_path(Path(p).expanduser()))
            atomic.write_text(written[-1], results_json(r))
    _report(paths, every, out, written)
    return 0


def _results_path(run: Path) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    path, n = run / f"tasks-{stamp}.json", 2
    while path.exists():
        path, n = run / f"tasks-{stamp}-{n}.json", n + 1
    return path


def _report(paths: list, every: list[dict], out: Optional[Path], written: list[Path]) -> None:
    from lm_eval.utils import make_table

    for p, r in zip(paths, every):
        print(f"{p}" + (f" (step {r['tokenmill']['step']})" if r["tokenmill"]["step"] is not None else ""))
        print(make_table(r))
        if r.get("groups"):
            print(make_table(r, "groups"))
    if len(every) > 1:
        print(compare_table([str(p) for p in paths], [scores(r) for r in every]))
    if out is not None:
        atomic.write_text(out, results_json(every[0] if len(every) == 1 else {str(p): r for p, r in zip(paths, every)}))
        print(f"results written to {out}")
    elif written:
        print("results written to " + ", ".join(map(str, written)))
    if any(r["tokenmill"]["kind"] == "hf" for r in every) and out is None:
        print("tokenmill: note: a Hugging Face folder's results are not written into it; pass --out FILE to keep "
              "them.", file=sys.stderr)


# ----------------------------------------------------------------------------------------------
# During training: the [eval] section


class TaskEval:
    """The ``eval.tasks`` of a run: checked at set-up (lm-eval installed, the names known, a tokenizer, a
    replicated model), run by :func:`eval_and_log` when due."""

    def __init__(self, cfg: Any, world: Any, data_dir: Optional[Path]):
        require_lm_eval()
        self.names = task_names(cfg.eval.tasks)
        if world.sharded:
            raise ConfigError("eval.tasks scores a whole model on each rank: it works with one process or DDP, not "
                              f"with a sharded model ({world.layout()}). Export the checkpoints and run tokenmill eval.")
        if data_dir is None:
            raise ConfigError("eval.tasks needs the run's tokenizer (lm-eval's tasks are text), but this run trains "
                              "on synthetic tokens; train on a prepared folder or the embedded corpus.")
        self.cfg, self.world = cfg, world
        self.manager = task_manager(self.names, cfg.eval.include_path)
        self.tokenizer, self.stops = run_tokenizer(Path(data_dir), cfg, False, "this run")
        p = cfg.train.precision
        self.autocast = {"bf16-autocast": torch.bfloat16, "fp16-autocast": torch.float16}.get(p)

    @classmethod
    def for_run(cls, cfg: Any, world: Any, data_dir: Optional[Path]) -> Optional[TaskEval]:
        return cls(cfg, world, data_dir) if cfg.eval.tasks else None

    def due(self, step: int) -> bool:
        every = self.cfg.eval.tasks_every_steps
        return step == self.cfg.train.max_steps or bool(every and step % every == 0)

    def run(self, model: Any) -> dict[str, float]:
        """The scores of ``model`` (rank 0; {} elsewhere), its train/eval mode and attention kept."""
        from tokenmill.parallel import unwrap
        from tokenmill.train.lm_eval_model import TokenmillLM

        gpt = unwrap(model)
        was, saved = gpt.training, (gpt.doc_eot_id, gpt.doc_start_flag)
        gpt.doc_eot_id = gpt.doc_start_flag = None  # one document per sequence, as lm-eval scores them
        try:
            lm = TokenmillLM(gpt, self.tokenizer, self.world.device, self.cfg.train.batch_size, self.autocast,
                             "this run", self.world.rank, self.world.size, self.stops)
            limit = self.cfg.eval.tasks_limit or None
            r = run_tasks(lm, self.names, self.manager, limit=limit, bootstrap_iters=0)
        finally:
            gpt.doc_eot_id, gpt.doc_start_flag = saved
            gpt.train(was)
        return scores(r) if r is not None else {}


def evals_due(tr: Any, step: int) -> bool:
    """Whether the validation loss or the task scores are due after ``step`` (a step before the last)."""
    every = tr.cfg.train.eval_every_steps
    val = bool(tr.val) and bool(every) and step % every == 0
    return val or (tr.tasks is not None and tr.tasks.due(step))


def eval_and_log(tr: Any, step: int) -> None:
    """The trainer's evaluation at ``step``: the validation loss (when the run has validation batches and it is
    due) and the task scores (when due), each logged and shown; their time counted as evaluation."""
    t = tr.cfg.train
    if tr.val and (step == t.max_steps or (t.eval_every_steps and step % t.eval_every_steps == 0)):
        t0 = time.perf_counter()
        with tr.metrics.outside("eval"):
            v = tr.evaluate()
        tr.writer.write({"step": step, "val_loss": v, "eval_ms": 1000 * (time.perf_counter() - t0)})
        tr.progress.log(f"step {step:>6} | val_loss {v:.4f}")
        tr.last["val_loss"] = v
    if tr.tasks is not None and tr.tasks.due(step):
        t0 = time.perf_counter()
        with tr.metrics.outside("eval"):
            got = tr.tasks.run(tr.model)
        if got:
            tr.writer.write({"step": step, **got, "tasks_ms": 1000 * (time.perf_counter() - t0)})
            tr.progress.log(f"step {step:>6} | " + " | ".join(f"{k[6:]} {v:.4f}" for k, v in got.items()))
            tr.last.update(got)



