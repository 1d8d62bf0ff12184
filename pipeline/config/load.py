"""Loading: the schema registered for Hydra (``conf/config.yaml`` extends it), a saved
config file merged onto it (:func:`load_config`), and the keys that changed name or
were removed - the command line's and a file's old keys fail with a message naming
the new key, or saying what replaced a removed one."""

from __future__ import annotations

import os
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from pipeline.config.redis import MIGRATE_SHARDS
from pipeline.config.schema import Config, validate

# sections renamed: old -> new (the ``engine`` group of sampling settings became
# ``sampling``; ``actor.engine`` alone names the engine)
RENAMED_SECTIONS = {"engine": "sampling"}
ENGINE_KIND = "engine.kind was replaced by actor.engine"
# keys removed with what they did: key -> what replaced it and how to move
REMOVED_KEYS = {"redis.shard_urls": MIGRATE_SHARDS}


def register() -> None:
    """Register the schema so Hydra's ``conf/config.yaml`` can extend it."""
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name="schema", node=Config)


def renamed_key(key: str) -> str | None:
    """What ``key`` (``engine.temperature``; ``engine`` the config group) is called now:
    a message naming the new key (or what replaced a removed one: REMOVED_KEYS), None
    for a key that kept its name."""
    if key in REMOVED_KEYS:
        return f"{key} was removed: {REMOVED_KEYS[key]}"
    head, dot, rest = key.partition(".")
    if head not in RENAMED_SECTIONS:
        return None
    new = RENAMED_SECTIONS[head]
    if key == "engine.kind":
        return f"{ENGINE_KIND}: write actor.engine=hf (or vllm, auto)"
    if not dot:
        return (
            f"the {head} config group is now {new} (conf/{new}/): write {new}=NAME; "
            f"its keys are {new}.KEY (actor.engine picks the engine)"
        )
    return f"{key} is now {new}.{rest} (actor.engine picks the engine)"


def expand_shorthands(overrides: list[str]) -> list[str]:
    """Command-line overrides with ``redis.tls=true|false`` spelled out as
    ``redis.tls.enabled=...`` (``redis.tls`` is a section: ``redis.tls.ca=...``, ...);
    the launcher applies this to its arguments before Hydra reads them, and
    :func:`load_config` to a pool's. ValueError naming the new key for a renamed one
    (``engine.temperature=0.5``: :func:`renamed_key`)."""
    out = []
    for o in overrides:
        key, eq, value = o.partition("=")
        bare = key.lstrip("+~")
        if eq or key != bare:  # key=value, +key=value, ~key: a config key, not a flag
            moved = renamed_key(bare)
            if moved:
                raise ValueError(f"{o}: {moved}")
        if eq and bare == "redis.tls":
            o = f"{key}.enabled={value}"
        out.append(o)
    return out


def check_experiment_sections(argv: list[str], config_dir: str) -> None:
    """An experiment file (conf/exp/, or one on the user's ``hydra.searchpath``) that
    still has a renamed section (``engine:``): Hydra would say only "Key 'engine' not
    in 'Config'", so compose once with ``argv``'s overrides and, for that failure
    alone, raise a ValueError naming the new section. Any other composition problem
    is left to Hydra, which reports it as it always does."""
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf.errors import ConfigKeyError

    overrides = [a for a in argv if "=" in a and not a.startswith("-")]
    try:
        with initialize_config_dir(version_base=None, config_dir=config_dir):
            compose(config_name="config", overrides=overrides)
    except HydraException as e:
        cause = e.__cause__ or e.__context__
        key = getattr(cause, "full_key", "") if isinstance(cause, ConfigKeyError) else ""
        head = (key or "").partition(".")[0]
        if key in REMOVED_KEYS:
            raise ValueError(
                f"an experiment file in {' '.join(overrides)} sets {key}, which was removed: "
                f"{REMOVED_KEYS[key]}; drop it from that file"
            ) from None
        if head in RENAMED_SECTIONS:
            new = RENAMED_SECTIONS[head]
            raise ValueError(
                f"an experiment file in {' '.join(overrides)} has an `{head}:` section: it "
                f"is now `{new}:` ({head}.KEY is now {new}.KEY; actor.engine picks the "
                "engine); rename the section in that file"
            ) from None


def check_renamed(raw: DictConfig, path: str) -> None:
    """A config file's keys that changed name or were removed: ValueError naming the new
    ones. An empty ``redis.shard_urls`` (every config.yaml an older version saved has
    one) is dropped: it names no shard."""
    for key, why in REMOVED_KEYS.items():
        section, _, leaf = key.rpartition(".")
        if OmegaConf.select(raw, key) is None:
            continue
        if OmegaConf.select(raw, key):
            raise ValueError(f"{path}: {key} is set: {why}")
        OmegaConf.select(raw, section).pop(leaf)
    if OmegaConf.select(raw, "engine.kind") is not None:
        raise ValueError(
            f"{path}: {ENGINE_KIND}; write actor: {{engine: hf}} (or vllm) and drop engine.kind"
        )
    # the old switch was a bool; today's preprocessor.reference is a section (replay_routes)
    if isinstance(OmegaConf.select(raw, "preprocessor.reference"), bool):
        raise ValueError(
            f"{path}: preprocessor.reference was folded into preprocessor.scorers; "
            "write preprocessor.scorers: [reference] (true) or [] (false) instead"
        )
    for old, new in RENAMED_SECTIONS.items():
        if old in raw:
            section = raw[old]
            keys = list(section) if isinstance(section, DictConfig) and len(section) else ["KEY"]
            moved = ", ".join(f"{old}.{k} is now {new}.{k}" for k in keys)
            raise ValueError(f"{path}: {moved}; rename the file's `{old}:` section to `{new}:`")


def load_config(path: str, overrides: list[str] | None = None) -> Any:
    """Load a saved config file onto the schema; errors name the bad key."""
    if not os.path.exists(path):
        raise ValueError(f"config file {path} does not exist; pass --config RUN_DIR/config.yaml")
    try:
        raw = OmegaConf.load(path)
        check_renamed(raw, path)
        tls = OmegaConf.select(raw, "redis.tls")
        if isinstance(tls, bool):  # the shorthand redis: {tls: true}
            raw.redis.tls = {"enabled": tls}
        cfg = OmegaConf.merge(OmegaConf.structured(Config), raw)
        if overrides:
            cfg = OmegaConf.merge(cfg, OmegaConf.from_dotlist(expand_shorthands(overrides)))
    except OmegaConfBaseException as e:
        raise ValueError(f"bad config {path}: {e}") from None
    validate(cfg)
    return cfg
