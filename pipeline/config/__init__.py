"""Typed configuration: one dataclass per section, registered in Hydra's ConfigStore.

Every pool reads the same composed config (``run_dir/config.yaml``) through
:func:`load_config`, which merges it onto these schemas so a wrong type or an
unknown key fails with the key's name, and :func:`validate` checks the values.
This file is the package's face: code imports ``from pipeline.config import X``.

==================  =============================================================
module              what
==================  =============================================================
schema.py           ``Config`` (one field per section) and ``validate``
load.py             Hydra glue (``register``), ``load_config``, renamed keys
                    (``engine.X`` -> ``sampling.X``) and removed ones
                    (``redis.shard_urls``), ``redis.tls=true`` shorthand
env.py              what the environment overrides: the run's secret, Redis URLs,
                    TLS files
checks.py           the checks the sections share; a pool's device and dtype
run.py              ``run``, ``pipeline`` (async | sync, CPU pinning), ``launch``,
                    ``metrics``
redis.py            ``redis`` and ``redis.tls``: TLS, Sentinel, Cluster partitions
model.py            ``model`` and ``model.lora``
sampling.py         ``sampling``: how every engine samples and batches
task.py             ``task``
actor.py            ``actor`` (``actor.engine``: hf | vllm | auto) and ``actor.vllm``
preprocessor.py     ``preprocessor`` and its scorers (``prm``, ``teacher``)
trainer.py          ``trainer``
weights.py          ``weights``: transport and update mode
eval.py             ``eval``: held-out evaluation
==================  =============================================================

Each section's module holds its dataclass, its field docs and its own
``validate_<section>``. Which vLLM versions the vllm engine was tested on is the
base's pipeline/vllm_versions.py (no pool is imported here).
"""

from pipeline.config.actor import (
    ActorConfig,
    VLLMConfig,
    resolve_eager,
    resolve_engine,
    validate_engine,
    validate_vllm,
)
from pipeline.config.checks import POOL_DTYPES, pool_dtype
from pipeline.config.env import (
    redis_tls,
    redis_url,
    refuse_shard_urls,
    run_secret,
    tls_files,
)
from pipeline.config.eval import EvalConfig
from pipeline.config.load import (
    check_experiment_sections,
    expand_shorthands,
    load_config,
    register,
)
from pipeline.config.model import LoraConfig, ModelConfig
from pipeline.config.preprocessor import (
    PRM_KINDS,
    SCORERS,
    PreprocessorConfig,
    PRMConfig,
    TeacherConfig,
    validate_scorers,
)
from pipeline.config.redis import (
    MIGRATE_SHARDS,
    REDIS_MODES,
    RedisConfig,
    TLSConfig,
    check_embedded_tls,
    min_replicas_acked,
    validate_mode,
    validate_shards,
    validate_tls,
)
from pipeline.config.run import (
    PIPELINE_MODES,
    CpusConfig,
    LaunchConfig,
    MetricsConfig,
    NiceConfig,
    PipelineConfig,
    RunConfig,
)
from pipeline.config.sampling import SamplingConfig
from pipeline.config.schema import Config, validate
from pipeline.config.task import TaskConfig
from pipeline.config.trainer import TrainerConfig
from pipeline.config.weights import WeightsConfig
from pipeline.vllm_versions import VLLM_MISSING

__all__ = [
    "MIGRATE_SHARDS",
    "POOL_DTYPES",
    "PIPELINE_MODES",
    "PRM_KINDS",
    "REDIS_MODES",
    "SCORERS",
    "VLLM_MISSING",
    "ActorConfig",
    "Config",
    "CpusConfig",
    "NiceConfig",
    "EvalConfig",
    "LaunchConfig",
    "LoraConfig",
    "MetricsConfig",
    "ModelConfig",
    "PRMConfig",
    "PipelineConfig",
    "PreprocessorConfig",
    "RedisConfig",
    "RunConfig",
    "SamplingConfig",
    "TLSConfig",
    "TaskConfig",
    "TeacherConfig",
    "TrainerConfig",
    "VLLMConfig",
    "WeightsConfig",
    "check_embedded_tls",
    "check_experiment_sections",
    "expand_shorthands",
    "load_config",
    "min_replicas_acked",
    "pool_dtype",
    "redis_tls",
    "redis_url",
    "register",
    "resolve_engine",
    "resolve_eager",
    "refuse_shard_urls",
    "run_secret",
    "tls_files",
    "validate",
    "validate_engine",
    "validate_mode",
    "validate_scorers",
    "validate_shards",
    "validate_tls",
    "validate_vllm",
]
