"""The config options every config-taking command shares (``train``, ``config``, ``profile``, ``bench``
sizing, ``estimate``): ``--preset``, ``--config``, ``--run-dir``, ``--resume`` and one ``--section.field``
option per config field, generated from the config definitions."""

from __future__ import annotations

import argparse

from tokenmill import config as C
from tokenmill.errors import ConfigError


def add_config_args(p: argparse.ArgumentParser) -> None:
    """--preset / --config / --run-dir / --resume and one --section.field option per config field."""
    p.add_argument("--preset", help=f"start from a shipped preset: {', '.join(C.preset_names())}")
    p.add_argument("--config", action="append", default=[], metavar="FILE.toml",
                   help="TOML config file(s), applied after the preset, in order")
    p.add_argument("--run-dir", help="run directory; None: runs/<preset>-<date-time>")
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --run-dir")
    for sname, scls in C.sections().items():
        g = p.add_argument_group(f"[{sname}] {scls.__doc__.strip()}")
        for key, (_tp, default, doc) in C.field_specs().items():
            if key.startswith(sname + "."):
                # SUPPRESS: an option not given stays out of the namespace (and out of argparse's own
                # "(default: ...)" suffix; the config default is named in the help instead).
                g.add_argument(f"--{key}", dest=f"cfg:{key}", metavar="VALUE", default=argparse.SUPPRESS,
                               help=f"{doc} (default: {default!r})".replace("%", "%%"))


def config_from_args(args: argparse.Namespace, base_files: tuple[str, ...] = ()) -> C.Config:
    """The config of ``--preset``, ``base_files`` (a resumed run's own config.toml), ``--config`` files and
    ``--section.field`` overrides, in that order (later wins)."""
    overrides = {k[4:]: v for k, v in vars(args).items() if k.startswith("cfg:") and v is not None}
    return C.resolve(args.preset, [*base_files, *args.config], overrides)


def parse_config_args(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """Parse ``argv``; an unknown ``--section.field`` is a :class:`ConfigError` naming the closest key."""
    args, extra = parser.parse_known_args(argv)
    if extra:
        bad = extra[0].split("=")[0]
        if bad.startswith("--") and "." in bad:
            raise ConfigError(f"unknown config key '{bad[2:]}'.{C.suggest(bad[2:], list(C.field_specs()))}")
        key = C.closest_key(bad.lstrip("-"), list(C.field_specs())) if bad.startswith("--") else None
        if key:  # a bare field name from another tool (--lr, --max_iters): name the tokenmill key
            raise ConfigError(f"unknown option '{bad}'. Did you mean '--{key}'? (config keys are --section.field)")
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    return args
