"""The layout the imports must keep.

- The floors: the base (pipeline/ modules below the run-level tools) imports no pool, the
  pools (actor/, preprocessor/, trainer/) import only the base, the run-level tools sit
  above; import-linter's contracts in pyproject.toml say it and ``lint-imports`` checks
  them (``make lint`` runs it too), and every pipeline module is placed on one floor.
- The tests' own layout: a test module never imports another test module. Shared fakes and
  builders live in modules that hold no test (tests/*_builders.py, tests/weight_peers.py,
  tests/vllm_fake.py, tests/vllm_real.py, ...) and shared fixtures in tests/conftest.py, so a
  test file can be read, moved or deleted without breaking another.
"""

from __future__ import annotations

import ast
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
