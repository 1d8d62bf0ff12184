"""Measure an environment's episodes at version 0: how often the untrained model calls
the tool, turns per episode, tool outcomes, reward. No Redis, no trainer::

    python -m actor.measure_episodes +exp=calc [--groups 8] [overrides...]

Runs ``--groups`` groups of ``task.group_size`` episodes with the configured engine
(``actor.engine``) through the actor's own EpisodeRunner (actor/episodes.py) and
prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import Counter
from pathlib import Path

from actor.engines import make_engine
from actor.episodes import EpisodeRunner, episode_counts
from pipeline.envs import load_env
from pipeline.runtime import model_path


def measure(cfg, groups: int) -> dict:
    engine = make_engine(cfg, model_path(cfg), cfg.run.seed)
    try:
        env_cls = load_env(cfg.task.env)
        runner = EpisodeRunner(cfg, engine, engine.tokenizer, env_cls, cfg.task.seed)
        counts, rewards, t0 = Counter(), [], time.monotonic()
        called = 0
        for _ in range(groups):
            ((_prompt, eps),) = runner.run([runner.tasks.sample()], cfg.task.group_size)
            counts.update(episode_counts(eps))
            rewards += [ep.reward for ep in eps]
            called += sum(any(o for o in ep.outcomes) for ep in eps)
        runner.close()
    finally:
        engine.close()
    n = counts["episodes"]
    return {
        "env": cfg.task.env,
        "engine": cfg.actor.engine,
        "episodes": n,
        "tool_call_rate": round(called / n, 3),
        "turns_per_episode": round(counts["turns"] / n, 3),
        "reward_mean": round(sum(rewards) / n, 3),
        "outcomes": {k[5:]: v for k, v in sorted(counts.items()) if k.startswith("tool.")},
        "seconds": round(time.monotonic() - t0, 1),
    }


def compose(overrides: list[str]):
    """The launcher's composition (conf/, the typed schema, the checks) without a run."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from omegaconf import OmegaConf

    from pipeline.config import Config, validate
    from pipeline.config.load import expand_shorthands, register

    register()
    conf = str(Path(__file__).resolve().parent.parent / "conf")
    with initialize_config_dir(version_base=None, config_dir=conf):
        raw = hydra_compose(config_name="config", overrides=expand_shorthands(overrides))
    cfg = OmegaConf.merge(OmegaConf.structured(Config), raw)
    validate(cfg)
    return cfg


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, default=8)
    args, overrides = parser.parse_known_args(argv)
    cfg = compose(overrides)
    if cfg.task.kind != "env":
        raise SystemExit("measure_episodes needs task.kind=env (e.g. +exp=calc)")
    print(json.dumps(measure(cfg, args.groups)))


if __name__ == "__main__":
    main()
