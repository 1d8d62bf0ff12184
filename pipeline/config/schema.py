"""The whole config: :class:`Config`, one field per section (each section's dataclass
and checks live in its own module of pipeline/config/), and :func:`validate`, which
runs every section's checks in this order."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pipeline.config.actor import ActorConfig, validate_actor
from pipeline.config.eval import EvalConfig, validate_eval
from pipeline.config.model import ModelConfig, validate_model
from pipeline.config.preprocessor import PreprocessorConfig, validate_preprocessor
from pipeline.config.redis import RedisConfig, validate_redis
from pipeline.config.run import (
    LaunchConfig,
    MetricsConfig,
    PipelineConfig,
    RunConfig,
    validate_launch,
    validate_metrics,
    validate_pipeline,
)
from pipeline.config.sampling import SamplingConfig, validate_sampling
from pipeline.config.task import TaskConfig, validate_task
from pipeline.config.trainer import TrainerConfig, validate_trainer
from pipeline.config.weights import WeightsConfig, validate_weights


@dataclass
class Config:
    run_dir: str = ""  # empty: outputs/<timestamp>, chosen by the launcher
    run: RunConfig = field(default_factory=RunConfig)
    redis: RedisConfig = field(default_factory=RedisConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    preprocessor: PreprocessorConfig = field(default_factory=PreprocessorConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    launch: LaunchConfig = field(default_factory=LaunchConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    weights: WeightsConfig = field(default_factory=WeightsConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)


SECTION_CHECKS = (  # in Config's field order
    validate_redis,
    validate_model,
    validate_sampling,
    validate_task,
    validate_actor,  # resolves actor.engine=auto first (resolve_engine)
    validate_preprocessor,
    validate_trainer,
    validate_launch,
    validate_metrics,
    validate_weights,
    validate_eval,
    validate_pipeline,
)


def validate(cfg: Any) -> None:
    """Raise ValueError naming the key and the fix for every bad value
    (``actor.engine=auto`` is resolved on the way: ``resolve_engine``)."""
    for check in SECTION_CHECKS:
        check(cfg)
