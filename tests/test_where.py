"""The README's map can be trusted: every ``file:function`` (or ``file:Class.method``) in
its "Where is it" table exists, so a rename that forgets the table fails here; and what
the docs say about the config's per-section checks is what ``pipeline/config/`` holds.

Pure parsing (``ast``, no import of the code it names): fast, and it runs where torch or
vLLM are missing too.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
# `path/to/file.py:name` or `path/to/file.py:Class.method`, in backticks
REF = re.compile(r"`([\w./-]+\.py):([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)`")
# what a newcomer asks for first (issue 35): each must keep a row of its own
MECHANISMS = (
    "per-forward-pass lock",
    "staging",
    "swap",
    "version stamps: recorded",
    "version stamps: stored",
    "XADD-once",
    "WAIT",
    "dead letters",
    "staleness",
    "back-pressure",
    "advantages",
    "reference log-probs",
    "the loss",
    "weights-never-arrived",
    "episode turns",
    "episode journal",
    "replay",
    "metrics endpoint",
    "config validation",
    "supervision",
    "checkpoint and stream position",
)


def section(text: str, title: str) -> str:
    """The body of the ``## title`` section of a Markdown text."""
    head = f"\n## {title}\n"
    assert head in text, f"README.md has no '## {title}' section"
    return text.split(head, 1)[1].split("\n## ", 1)[0]


def where_rows(text: str) -> list[tuple[str, list[tuple[str, str]]]]:
    """(mechanism, [(file, dotted name), ...]) for each row of the "Where is it" table."""
    rows = []
    for line in section(text, "Where is it").splitlines():
        if not line.startswith("| ") or line.startswith(("| mechanism |", "|---")):
            continue
        cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
        assert len(cells) == 2, f"a row of two cells (mechanism | where): {line}"
        rows.append((cells[0], REF.findall(cells[1])))
    return rows


def missing(path: str, dotted: str) -> str | None:
    """Why ``path:dotted`` names nothing (None when it names a function or class there):
    ``dotted`` is a module-level def or class, then methods or nested classes inside."""
    file = ROOT / path
    if not file.is_file():
        return f"{path}: no such file"
    body = ast.parse(file.read_text(), filename=path).body
    for depth, part in enumerate(dotted.split(".")):
        found = next(
            (
                node
                for node in body
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
                and node.name == part
            ),
            None,
        )
        if found is None:
            where = path if depth == 0 else f"{path}:{'.'.join(dotted.split('.')[:depth])}"
            return f"{path}:{dotted}: {where} defines no {part}"
        body = found.body if isinstance(found, ast.ClassDef) else []
    return None


def test_every_name_in_the_where_table_exists():
    rows = where_rows(README.read_text())
    assert len(rows) >= len(MECHANISMS), f"the table has {len(rows)} rows"
    empty = [mechanism for mechanism, refs in rows if not refs]
    assert not empty, f"rows naming no `file:function`: {empty}"
    wrong = [why for _, refs in rows for path, dotted in refs if (why := missing(path, dotted))]
    assert not wrong, (
        "README.md's 'Where is it' table names what is not there (renamed or moved? "
        "update the table):\n" + "\n".join(wrong)
    )
    names = [mechanism for mechanism, _ in rows]
    lost = [m for m in MECHANISMS if not any(m.lower() in n.lower() for n in names)]
    assert not lost, f"mechanisms without a row in the 'Where is it' table: {lost}"


def test_the_where_check_sees_a_wrong_name():
    """The check itself: a real name passes; a renamed function, a method looked up at
    module level, a method of the wrong class and a missing file fail."""
    assert missing("trainer/batches.py", "admit") is None
    assert missing("actor/engines/vllm/worker/locked.py", "LockedWeights.wrap") is None
    assert missing("trainer/batches.py", "admitted") is not None
    assert missing("actor/engines/vllm/worker/locked.py", "wrap") is not None
    assert missing("actor/engines/vllm/worker/locked.py", "LockedWeights.unwrap") is not None
    assert missing("pipeline/streams/consumer.py", "Consumer.admit") is not None
    assert missing("trainer/no_such_module.py", "admit") is not None
    assert REF.findall("x `a/b.py:C.m` y `c.py:f` z `not a ref`") == [
        ("a/b.py", "C.m"),
        ("c.py", "f"),
    ]


def config_sections() -> tuple[list[str], set[str]]:
    """(the sections of pipeline/config/schema.py's Config, the validate_* functions in its
    SECTION_CHECKS), read with ast."""
    tree = ast.parse((ROOT / "pipeline/config/schema.py").read_text())
    sections, checks = [], set()
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == "Config":
            sections = [
                f.target.id
                for f in node.body
                if isinstance(f, ast.AnnAssign)
                and isinstance(f.annotation, ast.Name)
                and f.annotation.id.endswith("Config")
            ]
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "SECTION_CHECKS" for t in node.targets
        ):
            checks = {e.id for e in node.value.elts}
    assert sections and checks, "pipeline/config/schema.py: Config or SECTION_CHECKS not found"
    return sections, checks


def test_the_docs_say_which_config_sections_have_a_validate():
    """README.md and pipeline/README.md say every section but ``run`` has its
    ``validate_<section>`` (run by ``validate``): true of pipeline/config/."""
    sections, checks = config_sections()
    without = {s for s in sections if f"validate_{s}" not in checks}
    assert without == {"run"}, (
        f"sections without a validate_<section> in SECTION_CHECKS: {sorted(without)}; "
        "README.md ('Configuration') and pipeline/README.md say 'every section but `run`': "
        "make them say what is true"
    )
    for doc in (README, ROOT / "pipeline" / "README.md"):
        text = " ".join(doc.read_text().split())  # line breaks inside the sentence
        said = "for every section but `run`" in text
        assert said, f"{doc.relative_to(ROOT)} no longer says 'for every section but `run`'"
