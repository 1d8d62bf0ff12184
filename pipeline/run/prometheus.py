"""The launcher's Prometheus (``metrics.prometheus=true``): Debian's ``prometheus``
scraping every pool of the run.

::

    reads   each pool's status hash: ``metrics_url`` (host:port of its /metrics), role
    writes  RUN_DIR/prometheus/prometheus.yml (scrape every metrics.prometheus_scrape_s),
            RUN_DIR/prometheus/targets.json (file-based service discovery, rewritten when a
            pool starts or restarts on a new port), RUN_DIR/prometheus/data (its storage),
            RUN_DIR/logs/prometheus.log
    runs    prometheus on metrics.http.host and a free port, in a session of its own,
            stopped with the run

After the run the storage stays: ``prometheus --config.file=RUN_DIR/prometheus/prometheus.yml
--storage.tsdb.path=RUN_DIR/prometheus/data`` shows it again (deploy/README.md).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
import urllib.request

from pipeline.prom import bind
from pipeline.redisd.server import free_port

BINARY = "prometheus"


def check_metrics(cfg) -> None:
    """Before anything starts: the host can be listened on; a fixed port only where one
    pool runs per host (the launcher runs several); the prometheus binary is there."""
    http = cfg.metrics.http
    if not (http.enabled or cfg.metrics.prometheus):
        return
    if int(http.port) != 0:
        raise ValueError(
            f"metrics.http.port={http.port}: the launcher runs several pools on this host, "
            "each needs its own port; use metrics.http.port=0 (a free port each, in its "
            "status hash) or set it per pool where one pool runs per host (systemd)"
        )
    bind(http.host, 0).close()  # a bad host: ValueError naming metrics.http.host
    if cfg.metrics.prometheus and shutil.which(BINARY) is None:
        raise ValueError(
            "metrics.prometheus=true but no prometheus binary on PATH: install Debian's "
            "prometheus (`make setup ARGS=metrics.prometheus=true` or `apt-get install "
            "prometheus`), or set metrics.prometheus=false"
        )


def config_text(targets: str, scrape_s: float) -> str:
    every, timeout = round(scrape_s * 1000), round(max(min(scrape_s, 10.0) * 0.8, 0.5) * 1000)
    return (
        "global:\n"  # Prometheus durations: whole units (ms)
        f"  scrape_interval: {every}ms\n"
        f"  scrape_timeout: {timeout}ms\n"
        f"  evaluation_interval: {every}ms\n"
        "scrape_configs:\n"
        "  - job_name: nonstop-rl\n"
        "    honor_labels: true\n"
        "    file_sd_configs:\n"
        f"      - files: ['{targets}']\n"
        "        refresh_interval: 5s\n"
    )


def targets_of(run: str, statuses: dict[str, dict[str, str]]) -> list[dict]:
    """Prometheus file-based discovery entries: one per pool with a ``metrics_url`` in its
    status hash (a restarted pool has written its new port there)."""
    return [
        {
            "targets": [st["metrics_url"]],
            "labels": {"run": run, "pool": name, "role": st.get("role", "")},
        }
        for name, st in sorted(statuses.items())
        if st.get("metrics_url")
    ]


def write_targets(path: str, targets: list[dict]) -> None:
    """Replace ``path`` at once (Prometheus never reads half a file)."""
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(targets, f, indent=1)
    os.replace(tmp, path)


class Prometheus:
    def __init__(self, cfg, run_dir: str):
        self.cfg, self.dir = cfg, os.path.join(run_dir, "prometheus")
        os.makedirs(os.path.join(self.dir, "data"), exist_ok=True)
        self.targets_path = os.path.join(self.dir, "targets.json")
        self.config_path = os.path.join(self.dir, "prometheus.yml")
        self.log_path = os.path.join(run_dir, "logs", "prometheus.log")
        self.targets: list[dict] | None = None
        self.proc: subprocess.Popen | None = None
        host = cfg.metrics.http.host
        self.address = f"[{host}]:" if ":" in host else f"{host}:"
        self.address += str(free_port(host))
        self.url = f"http://{self.address}"

    def start(self, timeout_s: float = 60.0) -> None:
        self.update({})
        with open(self.config_path, "w") as f:
            f.write(config_text(self.targets_path, float(self.cfg.metrics.prometheus_scrape_s)))
        os.makedirs(os.path.dirname(self.log_path), exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [
                    shutil.which(BINARY) or BINARY,
                    f"--config.file={self.config_path}",
                    f"--storage.tsdb.path={os.path.join(self.dir, 'data')}",
                    f"--web.listen-address={self.address}",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env=dict(os.environ, NONSTOP_RUN_DIR=os.path.dirname(self.dir)),  # the run's mark
            )
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise ValueError(
                    f"metrics.prometheus=true: prometheus exited ({self.proc.returncode}); "
                    f"see {self.log_path}"
                )
            try:
                with urllib.request.urlopen(self.url + "/-/ready", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise ValueError(f"metrics.prometheus=true: prometheus not ready in {timeout_s}s")
            time.sleep(0.2)

    def update(self, statuses: dict[str, dict[str, str]]) -> None:
        """Rewrite the targets file when the set of pools' endpoints changed."""
        run = self.cfg.run.name
        targets = [
            {
                "targets": [st["metrics_url"]],
                "labels": {"run": run, "pool": name, "role": st.get("role", "")},
            }
            for name, st in sorted(statuses.items())
            if st.get("metrics_url")
        ]
        if targets == self.targets:
            return
        tmp = self.targets_path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(targets, f, indent=1)
        os.replace(tmp, self.targets_path)
        self.targets = targets

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
