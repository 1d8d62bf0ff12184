"""``python -m pipeline.bench <name> [--out FILE] [...]``: dispatch to
``pipeline.bench.<name>.main(argv)``."""

import importlib
import pkgutil
import sys

import pipeline.bench as bench
from pipeline.bench.common import exit_on_signals


def available() -> list[str]:
    return sorted(m.name for m in pkgutil.iter_modules(bench.__path__) if not m.ispkg)


def main(argv: list[str]) -> int:
    names = available()
    argv = [{"async": "async_"}.get(argv[0], argv[0]), *argv[1:]] if argv else argv  # keyword
    if not argv or argv[0] not in names:
        print(f"usage: python -m pipeline.bench {{{','.join(names)}}} --out FILE [...]")
        return 2
    exit_on_signals()  # SIGTERM / SIGHUP run every bench's clean-up, as Ctrl-C does
    return importlib.import_module(f"pipeline.bench.{argv[0]}").main(argv[1:]) or 0


sys.exit(main(sys.argv[1:]))
