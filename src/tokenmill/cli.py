"""Command line: ``tokenmill COMMAND``; ``tokenmill --help`` lists every command (argparse builds the
list from the sub-parsers, so it cannot go stale).

Config overrides are ``--section.field VALUE`` (or ``--section.field=VALUE``); every field is
listed with its documentation by ``tokenmill train --help``.
"""

from __future__ import annotations

import argparse
import difflib
import io
import sys
import time
from pathlib import Path

from tokenmill import __version__, signals
from tokenmill import config as C
from tokenmill.args import add_config_args, config_from_args, parse_config_args
from tokenmill.config.options import number
from tokenmill.errors import ConfigError, SampleError, TokenmillError, TrainingError, describe_os_error
from tokenmill.paths import one_folder

__all__ = ["add_config_args", "build_parser", "config_from_args", "main"]


CONFIG_COMMANDS = {"train", "config", "profile", "estimate"}


def default_run_dir(args: argparse.Namespace) -> Path:
    return Path("runs") / f"{args.preset or 'run'}-{time.strftime('%Y%m%d-%H%M%S')}"


def cmd_train(args: argparse.Namespace) -> int:
    if args.resume:  # the run's own config.toml, then --config files and flags on top
        if not args.run_dir:
            raise ConfigError("--resume needs --run-dir (the run to continue).")
        run_dir = Path(args.run_dir)
        if not run_dir.is_dir():
            raise TrainingError(f"--resume: there is no run directory {run_dir}.{_closest_dir(run_dir)} Check "
                                "--run-dir, or start a new run without --resume.")
        saved = run_dir / "config.toml"
        cfg = config_from_args(args, (str(saved),) if saved.is_file() else ())
        if "cfg:train.init_from" in vars(args):  # the run's record of where it started stays as it was
            print("tokenmill: note: --resume continues from the run's own checkpoint; --train.init_from is "
                  "ignored (it only starts a new run).", file=sys.stderr)
            cfg.train.init_from = C.load_toml(saved).get("train", {}).get("init_from") if saved.is_file() else None
    else:
        cfg = config_from_args(args)
        run_dir = Path(args.run_dir) if args.run_dir else default_run_dir(args)
        if cfg.train.init_from:  # the model's shape from the source; an explicit conflicting choice is an error
            from tokenmill.train.init_from import adopt_shape, explicit_keys, find_source

            chosen = explicit_keys([k[4:] for k in vars(args) if k.startswith("cfg:")], args.config)
            cfg = adopt_shape(cfg, find_source(cfg.train.init_from), chosen)
    from tokenmill.train.trainer import train  # after the checks: a bad value stops before torch loads

    train(cfg, run_dir, resume=args.resume)
    return 0


def _closest_dir(path: Path) -> str:
    parent = path.parent if path.parent.is_dir() else None
    names = [p.name for p in parent.iterdir() if p.is_dir()] if parent else []
    match = difflib.get_close_matches(path.name, names, n=1, cutoff=0.6)
    return f" Did you mean {parent / match[0]}?" if match else ""


def cmd_sample(args: argparse.Namespace) -> int:
    from tokenmill.train.device import resolve_device
    from tokenmill.train.sample import load_run, sample_texts

    if args.max_new_tokens < 0 or args.temperature < 0 or args.top_k < 0 or args.num_samples < 1:
        raise SampleError("--max-new-tokens, --temperature and --top-k must be >= 0 and --num-samples >= 1 "
                          f"(got {args.max_new_tokens}, {args.temperature}, {args.top_k}, {args.num_samples}).")
    if not 0.0 < args.top_p <= 1.0:
        raise SampleError(f"--top-p must be in (0, 1] (1 = no nucleus filtering), got {args.top_p}.")
    try:
        args.prompt.encode("utf-8")
    except UnicodeEncodeError:
        raise SampleError("--prompt is not valid UTF-8 text; pass the prompt in UTF-8.") from None
    device = resolve_device(args.device, "--device")
    model, cfg, data_dir = load_run(args.run_dir, str(device), args.checkpoint)
    texts = sample_texts(model, data_dir, args.prompt, args.max_new_tokens, args.temperature, args.top_k or None,
                         args.top_p if args.top_p < 1.0 else None, args.num_samples, not args.no_kv_cache,
                         device=device, seed=args.seed)
    for i, text in enumerate(texts):
        if len(texts) > 1:
            print(f"--- sample {i + 1}/{len(texts)} ---")
        print(text)
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    from tokenmill.train.chat import ChatOptions, chat_loop, load_chat_model
    from tokenmill.train.device import resolve_device

    if args.max_new_tokens < 1 or args.temperature < 0 or args.top_k < 0 or (args.context is not None and args.context < 2):
        raise SampleError("--max-new-tokens must be >= 1, --temperature and --top-k >= 0 and --context >= 2 (got "
                          f"{args.max_new_tokens}, {args.temperature}, {args.top_k}, {args.context}).")
    if not 0.0 < args.top_p <= 1.0:
        raise SampleError(f"--top-p must be in (0, 1] (1 = no nucleus filtering), got {args.top_p}.")
    path = one_folder(args.path, args.run_dir, "chat: give one run directory or model folder: tokenmill chat PATH "
                      "(or --run-dir PATH)")
    device = resolve_device(args.device, "--device")
    cm = load_chat_model(path, args.chat_template, args.checkpoint, device, args.context)
    opts = ChatOptions(args.temperature, args.top_k or None, args.top_p if args.top_p < 1.0 else None,
                       args.max_new_tokens, args.seed)
    return chat_loop(cm, opts)


def _add_chat(sub) -> None:
    """The ``chat`` command's arguments."""
    p = sub.add_parser("chat", help="talk to a run's model or a Hugging Face folder through its chat template",
                       allow_abbrev=False)
    p.add_argument("path", nargs="?", help="a run directory or a Hugging Face model folder (Llama, Qwen2, Qwen3, "
                   "Mistral, GPT-2); --run-dir PATH works too, as train names a run's folder")
    p.add_argument("--run-dir", help=argparse.SUPPRESS)
    p.add_argument("--chat-template", metavar="FILE",
                   help="a Jinja chat template, for a model folder or run that has none (default: the model's own)")
    p.add_argument("--temperature", type=number(float), default=0.7, help="softmax temperature; 0 = greedy (default: 0.7)")
    p.add_argument("--top-p", type=number(float), default=1.0,
                   help="nucleus sampling: keep the most likely tokens up to this probability mass; 1 = off (default: 1.0)")
    p.add_argument("--top-k", type=number(int), default=0, help="keep the k most likely tokens; 0 = off (default: 0)")
    p.add_argument("--max-new-tokens", type=number(int), default=512, help="tokens per reply at most (default: 512)")
    p.add_argument("--seed", type=number(int, ge=0), default=0, help="random seed of the draws (default: 0)")
    p.add_argument("--context", type=number(int), default=None,
                   help="tokens of conversation the model sees at most (default: the run's block_size; a model "
                        "folder's context, at most 4096)")
    p.add_argument("--device", default="auto", help="cpu, cuda, mps or auto (default: auto)")
    p.add_argument("--checkpoint", help="a checkpoint file or folder of the run (default: the newest good one)")
    p.set_defaults(func=cmd_chat)


def cmd_export(args: argparse.Namespace) -> int:
    from tokenmill.checkpoint.export import export_hf

    r = export_hf(args.run_dir, args.out, args.checkpoint, overwrite=args.overwrite)
    print(f"exported {r.checkpoint} to {r.out_dir}: {', '.join(r.files)}")
    if r.tokenizer_skipped:
        print(f"tokenmill: note: no tokenizer files: {r.tokenizer_skipped}", file=sys.stderr)
    if r.chat_template:
        print(f"chat template from {r.chat_template} (chat_template.jinja, tokenizer_config.json)")
    elif r.chat_skipped:
        print(f"tokenmill: warning: no chat template written: {r.chat_skipped}. Copy the template into "
              f"{r.out_dir / 'chat_template.jinja'} yourself.", file=sys.stderr)
    print(f"load it with: transformers.{r.architecture}.from_pretrained({str(r.out_dir)!r})")
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    import json

    from tokenmill.train.device import resolve_device
    from tokenmill.train.evaluate import evaluate_run, format_result

    if args.tasks is not None:  # lm-eval's tasks on runs and Hugging Face folders (train/tasks.py)
        from tokenmill.train.tasks import run_cli

        return run_cli(args)
    if len(args.paths) + bool(args.run_dir) != 1:
        raise ConfigError("tokenmill eval gives the validation loss of one run: tokenmill eval RUN (or --run-dir "
                          "RUN); task scores of several runs or Hugging Face folders side by side need --tasks.")
    device = resolve_device(args.device, "--device")
    r = evaluate_run(args.run_dir or args.paths[0], args.data_path, args.batches, args.batch_size, args.checkpoint, device,
                     progress=not args.json)
    print(json.dumps(r, indent=2) if args.json else format_result(r))
    return 0


def cmd_config(args: argparse.Namespace) -> int:
    if args.update_readme:
        path, start, end = Path(args.update_readme), "<!-- config-reference:start -->", "<!-- config-reference:end -->"
        if not path.is_file():  # a folder, a FIFO (reading it would block), a device, nothing
            raise ConfigError(f"--update-readme {path}: not a regular file; give the README.md to update.")
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            raise ConfigError(f"--update-readme {path}: not UTF-8 text; give the README.md to update.") from None
        if start not in text or end not in text:
            raise ConfigError(f"{path} has no {start} ... {end} markers to fill.")
        head, rest = text.split(start, 1)
        path.write_text(head + start + "\n" + C.reference_markdown() + end + rest.split(end, 1)[1])
        print(f"updated the config reference in {path}")
        return 0
    print(C.reference_markdown() if args.reference else C.to_toml(config_from_args(args)), end="")
    return 0


def cmd_prepare(args: argparse.Namespace) -> int:
    from tokenmill.data.prepare_cli import run_prepare

    run_prepare(args)
    return 0


def _add_sample(sub) -> None:
    """The ``sample`` command's arguments."""
    p = sub.add_parser("sample", help="generate text from a run's checkpoint", allow_abbrev=False)
    p.add_argument("--run-dir", required=True, help="the run directory")
    p.add_argument("--prompt", default="\n", help="text to continue (default: a newline; empty: start from the end-of-text id)")
    p.add_argument("--max-new-tokens", type=number(int), default=200, help="tokens to generate (default: 200)")
    p.add_argument("--temperature", type=number(float), default=0.8, help="softmax temperature; 0 = greedy, the most likely token (default: 0.8)")
    p.add_argument("--top-k", type=number(int), default=200, help="keep the k most likely tokens; 0 = no top-k filtering (default: 200)")
    p.add_argument("--top-p", type=number(float), default=1.0,
                   help="nucleus sampling: keep the most likely tokens up to this probability mass; 1 = off (default: 1.0)")
    p.add_argument("--num-samples", type=number(int), default=1, help="independent samples of the prompt (default: 1)")
    p.add_argument("--seed", type=number(int, ge=0), default=0, help="random seed of the draws (default: 0)")
    p.add_argument("--device", default="cpu", help="cpu, cuda, mps or auto (default: cpu)")
    p.add_argument("--checkpoint", help="a checkpoint file or folder of the run (default: the newest good one)")
    p.add_argument("--no-kv-cache", action="store_true",
                   help="recompute the whole context at every token instead of caching keys/values (same tokens, "
                        "slower; for checking; default: the cache is on)")
    p.set_defaults(func=cmd_sample)


def _add_task_args(p) -> None:
    """``tokenmill eval --tasks``'s arguments (lm-eval; train/tasks.py)."""
    p.add_argument("--tasks", help="lm-eval tasks, comma-separated (e.g. hellaswag,arc_easy): task scores instead of "
                   "the validation loss; results to RUN/tasks-TIME.json (pip install 'tokenmill[eval]')")
    p.add_argument("--num-fewshot", type=number(int, ge=0), help="few-shot examples per document (default: each task's own)")
    p.add_argument("--limit", type=number(float, gt=0), help="documents per task (a fraction below 1: of each task)")
    p.add_argument("--include-path", metavar="DIR", help="a folder of your own task YAML files (lm-eval's --include-path)")
    p.add_argument("--apply-chat-template", action="store_true", help="prompts through the model's chat template")
    p.add_argument("--log-samples", action="store_true", help="keep every document's requests and responses in the JSON")
    p.add_argument("--out", metavar="FILE", help="write the results JSON here (a Hugging Face folder is never written to)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tokenmill", description="Train GPT-style language models close to the hardware limit, and see what "
        "each technique buys. Every command takes --help.")
    parser.add_argument("--version", action="version", version=f"tokenmill {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("train", help="train a GPT", allow_abbrev=False,
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_config_args(p)
    p.set_defaults(func=cmd_train)

    from tokenmill.data.prepare_cli import add_prepare_args

    p = sub.add_parser("prepare", help="tokenize text into a token folder", allow_abbrev=False)
    add_prepare_args(p)
    p.set_defaults(func=cmd_prepare)

    _add_sample(sub)
    _add_chat(sub)

    p = sub.add_parser("export", help="write a run's checkpoint as a Hugging Face folder (GPT-2, Llama, Qwen2, Qwen3, Mistral)", allow_abbrev=False)
    p.add_argument("--run-dir", required=True, help="the run directory")
    p.add_argument("--out", required=True, help="the folder to write (config.json, model.safetensors, tokenizer files)")
    p.add_argument("--checkpoint", help="a checkpoint file or folder of the run (default: the newest good one)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace a non-empty --out, only once the new folder is complete (default: a non-empty --out is an error)")
    p.set_defaults(func=cmd_export)

    p = sub.add_parser("eval", help="validation loss, perplexity and bits per byte of a run's checkpoint; with --tasks, "
                       "lm-eval task scores of runs and Hugging Face folders (docs/evaluation.md)", allow_abbrev=False)
    p.add_argument("paths", nargs="*", metavar="PATH", help="run directories or (with --tasks) Hugging Face folders")
    p.add_argument("--run-dir", help="the run directory (the result goes to RUN/eval.json)")
    p.add_argument("--data.path", dest="data_path", metavar="DATA",
                   help="a prepared folder with the run's tokenizer (default: the run's data)")
    p.add_argument("--batches", type=number(int, ge=1),
                   help="evaluate N batches spread over the val split, as training does with train.eval_batches=N "
                        "(default: the whole val split)")
    p.add_argument("--batch-size", type=number(int, ge=1), help="sequences per batch (default: the run's train.batch_size)")
    p.add_argument("--checkpoint", help="a checkpoint file or folder of the run (default: the newest good one)")
    p.add_argument("--device", default="auto", help="cpu, cuda, mps or auto (default: auto)")
    p.add_argument("--json", action="store_true", help="print the result as JSON (default: two lines of text)")
    _add_task_args(p)
    p.set_defaults(func=cmd_eval)

    p = sub.add_parser("config", help="print a resolved config as TOML, or the field reference", allow_abbrev=False)
    add_config_args(p)
    p.add_argument("--reference", action="store_true", help="print every field with its doc as Markdown")
    p.add_argument("--update-readme", metavar="README.md",
                   help="rewrite the config-reference section of this README in place")
    p.set_defaults(func=cmd_config)

    for register in _extensions():
        register(sub)
    return parser


def _extensions():
    """The ``register`` functions of the sub-commands living in their own packages (bench, profile and
    doctor, estimate); imported here, when the parser is built, so ``import tokenmill.cli`` stays light."""
    from tokenmill.bench.cli import register as bench
    from tokenmill.estimate.cli import register as estimate
    from tokenmill.profiling.cli import register as profiling

    return [bench, profiling, estimate]


def main(argv: list[str] | None = None) -> int:
    """Run one command. SIGINT/SIGTERM are handled from the first line on (``tokenmill.signals``); with
    ``argv`` None the process is ours, and a signal after the command ends it quietly."""
    signals.install()
    _paths_print_as_given()
    code = None
    try:
        code = _run(sys.argv[1:] if argv is None else argv)
        return code
    finally:
        signals.finish(owned=argv is None, code=code)


def _paths_print_as_given() -> None:
    """A path the user typed with bytes that are not UTF-8 (Python holds them as surrogates) is printed back
    as those bytes: stdout's 'strict' error handler would raise UnicodeEncodeError at the first report line."""
    out = sys.stdout
    if getattr(out, "errors", None) == "strict" and hasattr(out, "reconfigure"):
        try:
            out.reconfigure(errors="surrogateescape")
        except (ValueError, io.UnsupportedOperation):  # detached or closed: nothing will be printed anyway
            pass


def _run(argv: list[str]) -> int:
    try:
        parser = build_parser()
        sub = argv[0] if argv else None
        args = parse_config_args(parser, argv) if sub in CONFIG_COMMANDS else parser.parse_args(argv)
        code = args.func(args) or 0
        sys.stdout.flush()  # a closed pipe shows here, not at exit
        return code
    except BaseException as e:  # noqa: BLE001 - sorted by _outcome; anything else is a bug and re-raised
        code = _outcome(e)
        if code is None:
            raise
        return code


def _outcome(e: BaseException) -> int | None:
    """Print the one line for ``e`` and give the exit code; None: a bug (or SystemExit), keep it."""
    if isinstance(e, KeyboardInterrupt) or (signals.received() and not isinstance(e, SystemExit)):
        code, line = signals.outcome(e)  # a signal, whatever exception the unwinding ended in
        print(line, file=sys.stderr)
        return code
    if isinstance(e, BrokenPipeError):  # `tokenmill sample ... | head -1`: the reader has gone, quietly
        return signals.broken_pipe()
    if "torch.distributed" in sys.modules:  # under torchrun: another rank died (its error is in its output)
        from tokenmill.parallel.world import peer_failure

        if (line := peer_failure(e)) is not None:
            print(f"tokenmill: error: {line}", file=sys.stderr)
            return 1
    if isinstance(e, ConfigError):
        print(f"tokenmill: config error: {e}", file=sys.stderr)
        return 2
    if isinstance(e, TokenmillError):
        print(f"tokenmill: error: {e}", file=sys.stderr)
        return 1
    if isinstance(e, OSError):  # disk full, permission denied, read-only file system, a file where a folder goes
        print(f"tokenmill: error: {describe_os_error(e)}", file=sys.stderr)
        return 1
    return None
