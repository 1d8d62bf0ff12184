"""The run's supervision and account (run-level, the launcher's): ``supervisor.py``,
``progress.py``, ``cpu_meter.py``, ``prometheus.py``, ``summary.py`` with
``summary_fields.py``, ``accounting.py``."""
