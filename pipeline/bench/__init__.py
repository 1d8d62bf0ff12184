"""Benchmarks: ``python -m pipeline.bench <name> --out FILE``. Each prints a
table and writes JSON; ratios are measured side by side in one run."""
