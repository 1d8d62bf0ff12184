"""Config builders shared by the tests: conf/ composed with overrides onto the typed
schema (:func:`compose_config`), and a tiny run's config file for one pool process with
tight back-pressure (:func:`actor_config`: tests/test_backpressure.py's settings, also
what the start-up error tests of tests/test_redis_errors.py and tests/test_redis_tls.py
give their pools). No test lives here."""

from __future__ import annotations

import os

from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from pipeline.config import register
from pipeline.models import materialize_model
from tests.launching import ROOT, tiny_cache

CONF = os.path.join(os.path.dirname(__file__), "..", "conf")


def compose_config(overrides):
    register()
    with initialize_config_dir(config_dir=os.path.abspath(CONF), version_base=None):
        return compose(config_name="config", overrides=overrides)


# ---- a tiny run with tight back-pressure (groups of G, at most MAX_QUEUE queued)

MAX_QUEUE, PER_BATCH, G = 3, 2, 4


def actor_config(tmp_path, url: str, *extra: str) -> str:
    """The config file; ``extra``: more overrides, after these."""
    register()
    overrides = [
        "+exp=tiny",
        f"run_dir={tmp_path}",
        f"redis.url={url}",
        f"actor.max_queue_groups={MAX_QUEUE}",
        "actor.max_lag=1",
        f"sampling.prompts_per_batch={PER_BATCH}",
        "sampling.max_new_tokens=8",
        f"task.group_size={G}",
        *extra,
    ]
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        cfg = compose(config_name="config", overrides=overrides)
    cfg.model.path = materialize_model("tiny", tiny_cache(tmp_path / "cache"))
    path = str(tmp_path / "config.yaml")
    OmegaConf.save(cfg, path)
    return path
