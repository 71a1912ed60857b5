"""The layer map of docs/architecture.md holds for every import, files stay small, and the README's
technique table points to the files that apply each switch."""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "tokenmill"


def layers() -> dict[str, int]:
    """'tokenmill.model' / 'tokenmill.errors' -> floor, from the table in docs/architecture.md (entries of
    one row share it: ``rows`` maps each entry to its row)."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    table = text.split("<!-- layers:start -->")[1].split("<!-- layers:end -->")[0]
    out = {}
    for row in table.splitlines():
        cells = [c.strip() for c in row.strip().strip("|").split("|")]
        if len(cells) < 4 or not cells[0].isdigit():
            continue
        for name in re.findall(r"`([^`]+)`", cells[1]):
            out["tokenmill." + name.rstrip("/").removesuffix(".py")] = int(cells[0])
            ROWS["tokenmill." + name.rstrip("/").removesuffix(".py")] = cells[1]
    return out


ROWS: dict[str, str] = {}


def owner(module: str, floors: dict[str, int]) -> str | None:
    """The layer-table entry that holds ``module`` (longest prefix)."""
    best = None
    for name in floors:
        if (module == name or module.startswith(name + ".")) and (best is None or len(name) > len(best)):
            best = name
    return best


def imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) for every tokenmill import in ``path``, lazy ones included."""
    tree = ast.parse(path.read_text())
    rel = path.relative_to(SRC.parent).with_suffix("")
    package = ".".join(rel.parts[:-1]) if rel.name != "__init__" else ".".join(rel.parts[:-1])
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.startswith("tokenmill")]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against the package
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            if not mod.startswith("tokenmill"):
                continue
            if mod == "tokenmill":  # from tokenmill import config -> tokenmill.config
                found += [(node.lineno, f"tokenmill.{a.name}") for a in node.names]
            else:
                found.append((node.lineno, mod))
    return found


def test_layer_table_covers_every_source_file():
    floors = layers()
    assert floors["tokenmill.errors"] == 0 and floors["tokenmill.cli"] == max(floors.values())
    missing = [str(p.relative_to(SRC)) for p in SRC.rglob("*.py")
               if p.name != "__init__.py" or p.parent != SRC
               if owner(".".join(p.relative_to(SRC.parent).with_suffix("").parts), floors) is None]
    assert not missing, f"not in docs/architecture.md's layer table: {missing}"


def test_no_import_runs_up_or_sideways():
    floors = layers()
    bad = []
    for path in SRC.rglob("*.py"):
        me = owner(".".join(path.relative_to(SRC.parent).with_suffix("").parts), floors)
        if me is None:
            continue
        for line, mod in imports(path):
            target = owner(mod, floors)
            if target is None or ROWS[target] == ROWS[me]:  # the package face (__version__), or its own row
                continue
            if floors[target] >= floors[me]:
                bad.append(f"{path.relative_to(SRC)}:{line} ({me}, floor {floors[me]}) imports {mod} "
                           f"(floor {floors[target]})")
    assert not bad, "\n".join(bad)


def test_files_stay_small():
    sizes = {p.relative_to(SRC).as_posix(): len(p.read_text().splitlines()) for p in SRC.rglob("*.py")}
    assert sizes["train/trainer.py"] <= 350
    big = {k: v for k, v in sizes.items() if v > 500}
    assert not big, big


def test_readme_technique_table_points_to_where_each_switch_is_applied():
    """Each row's "applied in" files exist and mention the row's config fields (one grep finds them)."""
    readme = (ROOT / "README.md").read_text()
    rows = [r for r in readme.splitlines() if r.startswith("| ") and r.count("|") == 4 and "`" in r]
    checked = 0
    for row in rows:
        _, technique, switch, applied, _ = (c.strip() for c in row.split("|"))
        files = re.findall(r"`([\w/]+\.py)`", applied)
        if not files:
            continue
        fields = [f.split(".")[-1] for f in re.findall(r"`([a-z_]+\.[a-z_*]+)`", switch)]
        for f in files:
            assert (SRC / f).is_file(), f"{technique}: {f} does not exist"
        text = "".join((SRC / f).read_text() for f in files)
        for name in fields:
            assert name.rstrip("*") in text, f"{technique}: {files} never mention {name}"
        checked += 1
    assert checked >= 20
