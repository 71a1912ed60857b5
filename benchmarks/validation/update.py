"""Re-run the estimator over the published measurements and write what it gives back where it is recorded:

- ``benchmarks/validation/published.toml``: each case's ``memory_error`` / ``speed_error`` (the line after its
  ``id``; the rest of the file is left as written);
- ``docs/estimate.md``: the table between ``<!-- validation-table:start -->`` and ``<!-- validation-table:end -->``;
- ``src/tokenmill/estimate/uncertainty.py``: ``REGIME_ERRORS`` and ``OVERALL`` (the printed error ranges), and
  their table in ``docs/estimate.md`` (between ``<!-- regime-table:start -->`` and ``<!-- regime-table:end -->``).

``tests/test_estimate_validation.py`` checks that the three agree with a fresh run. The ``[summary]`` bounds are
not touched: they hold the means at what the estimator reached and are lowered by hand.

``--heldout`` runs ``benchmarks/validation/heldout.toml`` instead: the held-out cases, evaluated once after the
estimator is frozen and never used to choose anything. It prints their errors and means (overall and per regime)
and writes nothing, unless ``--write`` is given too: then the table between ``<!-- heldout-table:start -->`` and
``<!-- heldout-table:end -->`` in ``docs/estimate.md``, nothing else (heldout.toml records no errors).
``--fresh`` (with ``--heldout``) runs only the cases not evaluated yet: those without a ``spent = "YYYY-MM-DD"``
date (a case gets one when its single evaluation is done); with ``--write`` their table goes between
``<!-- heldout-fresh-table:start -->`` and ``<!-- heldout-fresh-table:end -->``, the spent cases' table untouched.

    python benchmarks/validation/update.py                      # rewrite the three files, print the errors and regimes
    python benchmarks/validation/update.py --check              # print only
    python benchmarks/validation/update.py --heldout [--write]  # the held-out set: print (and write its table)
    python benchmarks/validation/update.py --heldout --fresh [--write]  # only the cases without 'spent'
"""

from __future__ import annotations

import importlib
import re
import sys
from pathlib import Path

from tokenmill.estimate.uncertainty import regime_table
from tokenmill.estimate.validation import fresh, load, markdown_table, rounded, run_case, summarize

ROOT = Path(__file__).resolve().parents[2]
TOML = ROOT / "benchmarks" / "validation" / "published.toml"
HELDOUT = ROOT / "benchmarks" / "validation" / "heldout.toml"
DOC = ROOT / "docs" / "estimate.md"
UNCERTAINTY = ROOT / "src" / "tokenmill" / "estimate" / "uncertainty.py"


def _toml(text: str, results: list[dict]) -> str:
    by_id = {r["id"]: r for r in results}
    out: list[str] = []
    for line in text.splitlines():
        if re.match(r"(memory|speed)_error = ", line):
            continue  # rewritten below, after the case's id
        out.append(line)
        m = re.match(r'id = "([^"]+)"', line)
        if m and m.group(1) in by_id:
            r = by_id[m.group(1)]
            out += [f"{k} = {r[k]:.4f}" for k in ("memory_error", "speed_error") if r[k] is not None]
    return "\n".join(out) + "\n"


def _doc(text: str, table: str, name: str = "validation-table") -> str:
    start, end = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
    head, rest = text.split(start)
    return head + start + "\n" + table + "\n" + end + rest.split(end)[1]


def _uncertainty(text: str, summary: dict) -> str:
    t = regime_table(summary)

    def q(v) -> str:  # a Python literal with double quotes, as the file writes them
        return repr(v).replace("'", '"')

    rows = "".join(f"    {q(k)}: {q(v)},\n" for k, v in sorted(t["regimes"].items()))
    text = re.sub(r"(REGIME_ERRORS: dict\[.*?\] = \{\n)(.*?)(\}\n)", lambda m: m.group(1) + rows + m.group(3), text,
                  count=1, flags=re.S)
    overall = f'OVERALL = {{"memory": {q(t["overall"]["memory"])}, "speed": {q(t["overall"]["speed"])}}}'
    return re.sub(r"OVERALL = \{.*?\}", overall, text, count=1)


def _print(results: list[dict], regimes: bool = False) -> dict:
    """Each case's errors, then the means (and, with ``regimes``, the means per regime); returns the summary."""
    def pct(v, n: int) -> str:
        return "-" if v is None else f"{100 * v:.2f}% ({n} cases)"

    for r in results:
        mem = "" if r["memory_error"] is None else f"memory {100 * r['memory_error']:+6.1f}%"
        speed = "" if r["speed_error"] is None else f"tokens/s {100 * r['speed_error']:+6.1f}%"
        print(f"{r['id']:48s} {mem:17s} {speed}")
    s = summarize(results)
    if regimes:
        for key, v in s["regimes"].items():
            print(f"  {'/'.join(key):32s} memory {pct(v['memory'], v['n_memory']):20s} "
                  f"tokens/s {pct(v['speed'], v['n_speed'])}")
    print(f"mean absolute error: memory {pct(s['memory'], s['n_memory'])}, tokens/s {pct(s['speed'], s['n_speed'])}")
    return s


def heldout_cases(argv: list[str]) -> list:
    """The held-out cases to run: all of them, or with ``--fresh`` those without a ``spent`` date."""
    cases, _ = load(HELDOUT)
    return fresh(cases) if "--fresh" in argv else cases


def heldout(argv: list[str]) -> int:
    """The held-out set (``--fresh``: its unspent cases): errors printed; with ``--write``, the table written into
    docs/estimate.md (the fresh cases' table between its own markers)."""
    cases = heldout_cases(argv)
    if not cases:
        print("no held-out case without 'spent': nothing to evaluate" if "--fresh" in argv
              else "no held-out case in the file (the next collection goes there): nothing to evaluate")
        return 0
    results = [run_case(c) for c in cases]
    _print(results, regimes=True)
    if "--write" in argv:
        name = "heldout-fresh-table" if "--fresh" in argv else "heldout-table"
        DOC.write_text(_doc(DOC.read_text(), markdown_table(cases, results), name))
    return 0


def main(argv: list[str]) -> int:
    if "--heldout" in argv:
        return heldout(argv)
    if "--fresh" in argv:
        print("--fresh selects held-out cases: use it with --heldout (nothing run, nothing written)")
        return 2
    cases, bounds = load(TOML)
    results = [rounded(run_case(c)) for c in cases]  # the errors as the file records them, the means from those
    s = _print(results, regimes=True)  # each regime's means too: the bar is per regime
    print(f"bounds {bounds}")
    if "--check" not in argv:
        TOML.write_text(_toml(TOML.read_text(), results))
        DOC.write_text(_doc(DOC.read_text(), markdown_table(cases, results)))
        UNCERTAINTY.write_text(_uncertainty(UNCERTAINTY.read_text(), s))
        from tokenmill.estimate import uncertainty  # the table just written, for the doc

        importlib.reload(uncertainty)
        DOC.write_text(_doc(DOC.read_text(), uncertainty.regime_markdown(), "regime-table"))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
