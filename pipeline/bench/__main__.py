"""``python -m pipeline.bench <name> [--out FILE] [...]``: dispatch to
``pipeline.bench.<name>.main(argv)``."""

import importlib
import pkgutil
import sys

import pipeline.bench as bench
from pipeline.bench.common import exit_on_signals

# a bench's name on the command line -> its module, where they differ (async is a keyword;
# weights names the load, weight_updates the module)
MODULES = {"async": "async_", "weights": "weight_updates"}
NOT_BENCHES = {"__main__", "common"}  # this dispatcher; helpers the benches share


def available() -> list[str]:
    """The bench names: every module or package here with a main(argv), by command name."""
    names = {v: k for k, v in MODULES.items()}
    found = (m.name for m in pkgutil.iter_modules(bench.__path__) if m.name not in NOT_BENCHES)
    return sorted(names.get(m, m) for m in found)


def main(argv: list[str]) -> int:
    names = available()
    if not argv or argv[0] not in names:
        print(f"usage: python -m pipeline.bench {{{','.join(names)}}} --out FILE [...]")
        return 2
    argv = [MODULES.get(argv[0], argv[0]), *argv[1:]]
    exit_on_signals()  # SIGTERM / SIGHUP run every bench's clean-up, as Ctrl-C does
    return importlib.import_module(f"pipeline.bench.{argv[0]}").main(argv[1:]) or 0


sys.exit(main(sys.argv[1:]))
