"""launch.malloc: the launcher preloads tcmalloc into the pools' environment where it is
installed (vLLM's CPU build asks for it; the default job: 173.9 s against 191.6 s on
glibc, medians of 3 interleaved rounds)."""

from __future__ import annotations

import subprocess
import sys

import pytest
from omegaconf import OmegaConf

from pipeline.config import Config, validate
from pipeline.config.run import tcmalloc
from pipeline.launch import preload_malloc

needs_tcmalloc = pytest.mark.skipif(
    tcmalloc() is None, reason="libtcmalloc_minimal not installed (make setup installs it)"
)


@needs_tcmalloc
def test_auto_preloads_tcmalloc_into_what_the_pools_start():
    """A process started with the environment the launcher gives its pools runs on
    tcmalloc: its memory map holds the library (checked to fail with LD_PRELOAD unset)."""
    env = {"PATH": "/usr/bin:/bin", "LD_PRELOAD": "libfoo-not-there.so"}
    lib = preload_malloc("auto", env)
    assert lib and env["LD_PRELOAD"].split() == [lib, "libfoo-not-there.so"]
    assert preload_malloc("auto", env) == lib and env["LD_PRELOAD"].count("tcmalloc") == 1
    env["LD_PRELOAD"] = lib  # the library that is not there makes the loader warn
    maps = subprocess.run(
        [sys.executable, "-c", "print(open('/proc/self/maps').read())"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "tcmalloc" in maps


def test_system_leaves_the_environment_alone():
    env = {"LD_PRELOAD": "x.so"}
    assert preload_malloc("system", env) is None and env == {"LD_PRELOAD": "x.so"}


def test_a_missing_tcmalloc_asked_for_is_refused_with_the_fix(monkeypatch):
    monkeypatch.setattr("pipeline.config.run.tcmalloc", lambda: None)
    cfg = OmegaConf.structured(Config)
    cfg.launch.malloc = "tcmalloc"
    with pytest.raises(ValueError, match="apt-get install libtcmalloc-minimal4"):
        validate(cfg)
    cfg.launch.malloc = "jemalloc"
    with pytest.raises(ValueError, match="launch.malloc='jemalloc' is not supported"):
        validate(cfg)
    cfg.launch.malloc = "auto"  # not installed: glibc's, no error
    validate(cfg)
