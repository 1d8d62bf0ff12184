"""The layout the imports must keep.

- The floors: the base (pipeline/ modules below the run-level tools) imports no pool, the
  pools (actor/, preprocessor/, trainer/) import only the base, the run-level tools sit
  above; import-linter's contracts in pyproject.toml say it and ``lint-imports`` checks
  them (``make lint`` runs it too), and every pipeline module is placed on one floor.
- The docs name the same floors: README.md's floor table and Layout rows and
  pipeline/README.md's diagram and tables list each module on the floor the contracts put
  it on, and no other module there.
- The tests' own layout: a test module never imports another test module. Shared fakes and
  builders live in modules that hold no test (tests/*_builders.py, tests/weight_peers.py,
  tests/vllm_fake.py, tests/vllm_real.py, ...) and shared fixtures in tests/conftest.py, so a
  test file can be read, moved or deleted without breaking another.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import tomllib
from pathlib import Path

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
POOLS = ("actor", "preprocessor", "trainer")
BASE_CONTRACT = "the base imports no pool and no run-level tool"
POOLS_CONTRACT = "the pools import no run-level tool"


def contracts() -> dict[str, dict]:
    with open(ROOT / "pyproject.toml", "rb") as f:
        config = tomllib.load(f)["tool"]["importlinter"]
    assert sorted(config["root_packages"]) == sorted(["pipeline", *POOLS])
    return {c["name"]: c for c in config["contracts"]}


def test_the_floors_hold():
    """``lint-imports`` keeps every contract of pyproject.toml, on this checkout's code."""
    lint = Path(sys.executable).with_name("lint-imports")  # the venv's, beside python
    done = subprocess.run(  # from the root: it reads pyproject.toml and this checkout's code
        [str(lint), "--no-cache", "--no-logo"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, (
        "an import breaks a floor (base < pools < run-level tools); move the shared piece "
        "down into the base instead of importing up or across:\n" + done.stdout + done.stderr
    )


def test_every_pipeline_module_sits_on_one_floor():
    """Each module and package of pipeline/ is named once: as a base module (the base
    contract's source_modules) or as a run-level tool (both contracts' forbidden_modules),
    so a new module cannot slip past the floors unplaced."""
    by_name = contracts()
    base = set(by_name[BASE_CONTRACT]["source_modules"])
    above = set(by_name[BASE_CONTRACT]["forbidden_modules"]) - set(POOLS)
    assert set(POOLS) <= set(by_name[BASE_CONTRACT]["forbidden_modules"])
    assert set(by_name[POOLS_CONTRACT]["source_modules"]) == set(POOLS)
    assert set(by_name[POOLS_CONTRACT]["forbidden_modules"]) == above, (
        "the two contracts must name the same run-level tools"
    )
    assert not base & above, f"named on both floors: {sorted(base & above)}"
    found = {
        f"pipeline.{p.stem}"
        for p in (ROOT / "pipeline").iterdir()
        if (p.suffix == ".py" and p.stem != "__init__") or (p / "__init__.py").is_file()
    }
    assert found - base - above == set(), (
        f"pipeline modules on no floor: {sorted(found - base - above)}; add each to "
        "pyproject.toml's base contract (source_modules) or, if it sits above the pools, "
        "to both contracts' forbidden_modules"
    )
    assert (base | above) - found == set(), f"named but gone: {sorted((base | above) - found)}"


# ---- the docs name the same floors as the contracts -----------------------------------
# README.md's floor table and its Layout rows, pipeline/README.md's diagram and its two
# tables: written by hand, checked here against pyproject.toml (what lint-imports enforces)

# `name.py`, `name/` or a file of package name (`name/file.py`): a whole code span
MODULE_FILE = re.compile(r"`(\w+)(?:\.py|/|/[\w/]+\.py)`")


def table_rows(text: str, header: str) -> list[list[str]]:
    """The cells of each row of the Markdown table whose header line starts with
    ``header`` (the separator row left out)."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith(header)), None)
    assert start is not None, f"no table headed {header!r}"
    rows = []
    for line in lines[start + 1 :]:
        if not line.startswith("|"):
            break
        if not line.startswith("|---"):
            rows.append([c.strip() for c in line.strip().strip("|").split(" | ")])
    return rows


def outside_parentheses(cell: str) -> set[str]:
    """``pipeline.<name>`` for each `name.py` or `name/` of ``cell`` outside parentheses
    (inside them: a package's own files, which are not modules of pipeline/ itself);
    parentheses inside code spans do not count."""
    found, depth = set(), 0
    for part in re.split(r"(`[^`]*`)", cell):
        if part.startswith("`") and part.endswith("`") and len(part) > 1:
            m = MODULE_FILE.fullmatch(part)
            if m and depth == 0:
                found.add(f"pipeline.{m.group(1)}")
        else:
            depth += part.count("(") - part.count(")")
    return found


def readme_floors() -> list[tuple[str, str, set[str]]]:
    """(where, floor, modules) of README.md's floor table (``| floor | imports | modules
    |``) and of the two ``pipeline/`` rows of its Layout table."""
    text = (ROOT / "README.md").read_text()
    out = [
        (f"README.md floor table, {row[0]}", row[0], set(re.findall(r"`([\w.]+)`", row[2])))
        for row in table_rows(text, "| floor | imports | modules |")
    ]
    for row in table_rows(text, "| path | what |"):
        if row[0] in ("`pipeline/` (base)", "`pipeline/` (run-level)"):
            floor = "base" if "base" in row[0] else "run-level"
            out.append((f"README.md Layout, {floor}", floor, outside_parentheses(row[1])))
    return out


def pipeline_readme_floors() -> list[tuple[str, str, set[str]]]:
    """(where, floor, modules) of pipeline/README.md: the floors diagram at its top (labels
    ``run-level tools``, ``pools``, ``base``, continued on indented lines; parenthesised
    notes skipped), every base module named in the "Base modules by concern" table's file
    column, and the module each row of the "Run-level tools" table opens with."""
    text = (ROOT / "pipeline" / "README.md").read_text()
    block = next(b for b in text.split("```")[1::2] if "\nrun-level tools" in "\n" + b)
    labels = {"run-level tools": "run-level", "pools": "pools", "base": "base"}
    floors: dict[str, set[str]] = {}
    floor = None
    for line in block.splitlines():
        for label, name in labels.items():
            if line.startswith(label):
                floor, line = name, line[len(label) :]
        if floor is not None:
            names = re.findall(r"(\w+)(?:\.py|/)", re.sub(r"\(.*?\)", "", line))
            prefix = "" if floor == "pools" else "pipeline."
            floors.setdefault(floor, set()).update(prefix + n for n in names)
    out = [(f"pipeline/README.md diagram, {f}", f, names) for f, names in floors.items()]
    base_files = " ".join(
        row[1] for row in table_rows(section(text, "Base modules by concern"), "| concern |")
    )
    # its file column also names a package's own files (config/'s eval.py): base ones only
    mentioned = {f"pipeline.{n}" for n in re.findall(r"`(\w+)(?:\.py|/)", base_files)}
    out.append(("pipeline/README.md base modules table", "base (mentioned)", mentioned))
    tools = table_rows(section(text, "Run-level tools (above the pools)"), "| file |")
    opening = {f"pipeline.{m.group(1)}" for row in tools if (m := MODULE_FILE.match(row[0]))}
    out.append(("pipeline/README.md run-level tools table", "run-level", opening))
    return out


def test_the_docs_list_the_floors_of_the_contracts():
    """Every module a contract places on a floor is listed on that floor by README.md (its
    floor table and Layout rows) and pipeline/README.md (its diagram and its tables of
    base modules and run-level tools), and nothing is listed on a floor the contracts do
    not put it on, nor names a module that is not there."""
    by_name = contracts()
    want = {
        "base": set(by_name[BASE_CONTRACT]["source_modules"]),
        "pools": set(POOLS),
        "run-level": set(by_name[BASE_CONTRACT]["forbidden_modules"]) - set(POOLS),
    }
    listed = readme_floors() + pipeline_readme_floors()
    assert len(listed) == 10, f"a floor list was not found: {[w for w, _, _ in listed]}"
    problems = []
    for where, floor, names in listed:
        if floor == "base (mentioned)":  # one way only: the base modules among its names
            floor, names = "base", names & want["base"]
        if want[floor] - names:
            problems.append(f"{where}: lacks {sorted(want[floor] - names)}")
        if names - want[floor]:
            problems.append(
                f"{where}: lists {sorted(names - want[floor])}, which pyproject.toml's "
                f"contracts do not put on the {floor} floor"
            )
        gone = sorted(n for n in names if not exists(n))
        if gone:
            problems.append(f"{where}: lists {gone}, which are not modules of this checkout")
    assert not problems, (
        "the docs' floor lists disagree with pyproject.toml's [tool.importlinter] contracts "
        "(what lint-imports enforces): fix the docs, or move the module between the "
        "contracts' lists:\n" + "\n".join(problems)
    )


def section(text: str, title: str) -> str:
    head = f"\n## {title}\n"
    assert head in text, f"no '## {title}' section"
    return text.split(head, 1)[1].split("\n## ", 1)[0]


def exists(module: str) -> bool:
    path = ROOT.joinpath(*module.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def test_the_floor_lists_are_read_as_written():
    """The parsers: names inside parentheses are a package's own files, code spans'
    parentheses do not count, the diagram's labels and continuation lines are followed."""
    cell = "`a.py` (x; `b.py` (`C`), `c/`), `d/` (`Shards.of(cfg, ...)`), `e.py`; `f.py`"
    assert outside_parentheses(cell) == {"pipeline.a", "pipeline.d", "pipeline.e", "pipeline.f"}
    assert MODULE_FILE.fullmatch("`inspect/`") and not MODULE_FILE.fullmatch("`a.b`")
    assert MODULE_FILE.fullmatch("`run/summary.py`").group(1) == "run"  # a package's file


def is_test_module(dotted: str) -> bool:
    """``tests.test_x`` or ``tests.test_x.y`` (a module of tests/ named test_*)."""
    parts = dotted.split(".")
    return len(parts) >= 2 and parts[0] == "tests" and parts[1].startswith("test_")


def imports_of_test_modules(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, module) for every import of a test module in ``tree``, at any depth (function
    level too): ``import tests.test_x``, ``from tests.test_x import ...``,
    ``from tests import test_x`` and their relative forms (``from .test_x import ...``)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if is_test_module(a.name)]
        elif isinstance(node, ast.ImportFrom):
            base = "tests." * (node.level > 0) + (node.module or "")
            base = base.rstrip(".")
            if is_test_module(base):
                found.append((node.lineno, base))
            elif base == "tests":
                found += [
                    (node.lineno, f"tests.{a.name}")
                    for a in node.names
                    if is_test_module(f"tests.{a.name}")
                ]
    return found


def test_no_test_module_imports_another_test_module():
    offenders = []
    for path in sorted(TESTS.rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        offenders += [
            f"{path.relative_to(TESTS.parent)}:{line}: imports {mod}"
            for line, mod in imports_of_test_modules(tree)
        ]
    assert not offenders, (
        "a test module is imported from another module; move what is shared into a module "
        "that holds no test (tests/*_builders.py) or, for a fixture, tests/conftest.py:\n"
        + "\n".join(offenders)
    )


def test_the_check_sees_every_form_of_the_import():
    src = """
import tests.test_a
import tests.vllm_builders
from tests.test_b import x
from tests import test_c, vllm_fake
from .test_d import y
from . import test_e, conftest

def f():
    from tests.test_f.sub import z
"""
    got = [mod for _, mod in imports_of_test_modules(ast.parse(src))]
    assert got == [
        "tests.test_a",
        "tests.test_b",
        "tests.test_c",
        "tests.test_d",
        "tests.test_e",
        "tests.test_f.sub",
    ]


def test_a_moved_module_fails_naming_where_it_is_now():
    """pipeline/__init__.py MOVED: every old name is gone, its new one imports, and both an
    import of the old name and ``python -m`` of it fail naming the new one."""
    import importlib

    import pytest

    from pipeline import MOVED

    for old, new in MOVED.items():
        assert not exists(old), f"{old} is still there"
        importlib.import_module(new)
        with pytest.raises(ModuleNotFoundError, match=re.escape(f"moved to {new}")):
            importlib.import_module(old)
    for old in ("pipeline.redis_tls", "pipeline.redis_cluster_move"):  # documented commands
        done = subprocess.run(
            [sys.executable, "-m", old, "--help"], capture_output=True, text=True, cwd=ROOT
        )
        assert done.returncode != 0 and f"moved to {MOVED[old]}" in done.stderr, done.stderr
