"""The launcher's CPU meter (pipeline/run/cpu_meter.py) on real processes: a pool's CPU is
that of its whole process group (a child it started included), another group's is not
counted, and a process that exits keeps the CPU it was last seen with."""

import os
import signal
import subprocess
import sys
import time

from pipeline.run.cpu_meter import CpuMeter, read_stat, shares_text
from pipeline.streams import wait_until

BURN = "import subprocess, sys; subprocess.run([sys.executable, '-c', 'while True: pass'])"


def _start(code: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code], start_new_session=True)


def test_a_pool_is_its_process_group_and_an_exit_keeps_its_cpu():
    busy, idle = _start(BURN), _start("import time; time.sleep(120)")
    meter = CpuMeter()
    groups = {"busy": busy.pid, "idle": idle.pid}
    try:

        def burned() -> bool:
            meter.sample(groups)
            return meter.totals().get("busy", 0.0) >= 0.5

        assert wait_until(burned, 30, every_s=0.2), meter.totals()
        totals = meter.totals()
        # the burning child (the group's only busy process) is counted, its parent idles
        assert read_stat(str(busy.pid))[2] < 0.3 < totals["busy"]
        assert totals["idle"] < 0.3  # the interpreter's start-up only
        assert os.getpid() not in {pid for pid, _ in meter.seen}  # not in either group
        time.sleep(1.1)
        meter.sample(groups)
        assert meter.recent["busy"] > meter.recent["idle"]
        os.killpg(busy.pid, signal.SIGKILL)  # the burner and its parent gone
        busy.wait()
        before = meter.totals()["busy"]
        meter.sample(groups)
        assert meter.totals()["busy"] >= before  # kept from when it was last seen
        record = meter.record()
        assert set(record["cpu_s"]) == {"busy", "idle"} and record["cores"] >= 1
        assert record["share"]["busy"] > record["share"]["idle"]
        text = shares_text(record["share"], record["cores"])
        assert text.index("busy") < text.index("idle")  # busiest first
    finally:
        for p in (busy, idle):
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
