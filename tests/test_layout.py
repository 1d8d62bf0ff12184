"""The tests' own layout: a test module never imports another test module. Shared fakes and
builders live in modules that hold no test (tests/*_builders.py, tests/weight_peers.py,
tests/vllm_fake.py, tests/vllm_real.py, ...) and shared fixtures in tests/conftest.py, so a
test file can be read, moved or deleted without breaking another."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent


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
