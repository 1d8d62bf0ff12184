"""``python -m pipeline.bench agentic``: multi-turn episodes with a slow tool, the
streaming episode loop (async) against the turn-by-turn one (sync), on one engine.

One engine (``actor.engine``, default vllm; SmolLM2-135M-Instruct) on ``+exp=calc``
whose calculator takes ``--delay`` seconds per call (``task.env_args.tool_delay_s``,
uniform in [low, high]); interleaved repeats of the two actor loops over the same
number of groups:

- ``sync``: the batch loop's EpisodeRunner.run (actor/episodes.py): the open episodes'
  turns together, then their tool calls, then the next turn: the engine waits for
  the slowest tool of each turn;
- ``async``: actor/episode_stream.py's drive_episodes: each episode's turn a request
  of its own, its tool call on the environments' thread while the engine goes on
  with the other episodes' turns.

Both loops first run ``--warmup`` groups untimed. Per run: wall seconds, episodes/s,
sampled tokens/s, turns per episode, tool calls, and the engine's empty share (wall
time with no request of this actor in it: vllm).
Not measured here (they need the whole pipeline): the trainer's idle share and the
stall at swaps while tools run; a swap never waits for a tool (tools never hold the
engine's lock: tests/test_episode_actor.py). Writes JSON (``--out``) and a markdown
table beside it.
"""

from __future__ import annotations

import argparse
import os
import time
from datetime import date

from pipeline.bench.common import LoadProbe, device_name, print_table, write_json

COLUMNS = ["repeat", "mode", "groups", "episodes", "wall_s", "episodes_per_s"]
COLUMNS += ["tokens_per_s", "turns_per_episode", "tool_calls", "engine_empty_share"]


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m pipeline.bench agentic", description=__doc__)
    p.add_argument("--out", default=f"bench/results/agentic-cpu-{date.today()}.json")
    p.add_argument("--groups", type=int, default=6, help="groups per run")
    p.add_argument("--repeats", type=int, default=2, help="interleaved repeats of both")
    p.add_argument("--delay", default="0.5,2.0", help="tool seconds per call: low,high")
    p.add_argument("--warmup", type=int, default=2, help="groups per mode first, not timed")
    p.add_argument("overrides", nargs="*", help="config overrides (e.g. actor.engine=hf)")
    return p.parse_args(argv)


def run_sync(runner, cfg, groups: int) -> list:
    eps, done = [], 0
    while done < groups:
        n = min(cfg.sampling.prompts_per_batch, groups - done)
        out = runner.run([runner.tasks.sample() for _ in range(n)], cfg.task.group_size)
        eps += [ep for _prompt, group in out for ep in group]
        done += n
    return eps


def run_async(engine, runner, cfg, groups: int) -> list:
    from actor.episode_stream import drive_episodes
    from actor.stream import open_target

    started, finished = [0], []

    def admit() -> bool:
        if started[0] >= groups:
            return False
        started[0] += 1
        return True

    drive_episodes(
        engine,
        runner,
        cfg.task.group_size,
        open_target(cfg),
        admit=admit,
        finished=finished.append,
        stop=lambda: len(finished) >= groups,
        tick=lambda _open: None,
    )
    return [ep for grp in finished for ep in grp.episodes]


def measure(mode: str, engine, runner, cfg, groups: int) -> dict:
    empty0 = engine.empty_s() if hasattr(engine, "empty_s") else None
    t0 = time.monotonic()
    if mode == "sync":
        eps = run_sync(runner, cfg, groups)
    else:
        eps = run_async(engine, runner, cfg, groups)
    wall = time.monotonic() - t0
    tokens = sum(len(ep.logprobs) for ep in eps)
    empty = None if empty0 is None else (engine.empty_s() - empty0) / wall
    return {
        "mode": mode,
        "groups": groups,
        "episodes": len(eps),
        "wall_s": round(wall, 2),
        "episodes_per_s": round(len(eps) / wall, 3),
        "tokens_per_s": round(tokens / wall, 1),
        "turns_per_episode": round(sum(len(ep.offsets) for ep in eps) / len(eps), 2),
        "tool_calls": sum(1 for ep in eps for o in ep.outcomes if o),
        "engine_empty_share": None if empty is None else round(empty, 3),
    }


def main(argv: list[str]) -> int:
    from actor.engines import make_engine
    from actor.episodes import EpisodeRunner
    from actor.measure_episodes import compose
    from pipeline.envs import load_env
    from pipeline.runtime import model_path

    args = parse(argv)
    # vLLM's CPU KV cache (GiB): bounded, as pipeline/bench/vllm.py bounds it (unset, a
    # worker took 12.6 GB here and the kernel killed it)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    low, high = (float(x) for x in args.delay.split(","))
    overrides = ["+exp=calc", "actor.engine=vllm", "actor.vllm.enforce_eager=true"]
    overrides += [f"+task.env_args.tool_delay_s=[{low},{high}]", *args.overrides]
    cfg = compose(overrides)
    t0 = time.monotonic()
    engine = make_engine(cfg, model_path(cfg), cfg.run.seed)
    start_s = time.monotonic() - t0
    rows, probe = [], LoadProbe()
    try:
        runner = EpisodeRunner(cfg, engine, engine.tokenizer, load_env(cfg.task.env), 0)
        modes = ("sync", "async") if engine.streaming else ("sync",)  # hf: no streaming
        for mode in modes:  # the engine's first requests and both loops warmed up
            measure(mode, engine, runner, cfg, args.warmup)
        for repeat in range(args.repeats):
            for mode in modes if repeat % 2 == 0 else modes[::-1]:
                row = {"repeat": repeat, **measure(mode, engine, runner, cfg, args.groups)}
                print(row, flush=True)
                rows.append(row)
        runner.close()
    finally:
        engine.close()
    load = probe.end()
    print_table(rows, COLUMNS)
    payload = {
        "bench": "agentic",
        "device": device_name("cpu"),
        "engine": cfg.actor.engine,
        "model": cfg.model.name,
        "engine_start_s": round(start_s, 1),
        "tool_delay_s": [low, high],
        "group_size": cfg.task.group_size,
        "prompts_per_batch": cfg.sampling.prompts_per_batch,
        "max_turns": cfg.task.episode.max_turns,
        "max_new_tokens": cfg.sampling.max_new_tokens,
        "load": load,
        "rows": rows,
    }
    write_json(args.out, payload)
    md = args.out.removesuffix(".json") + ".md"
    with open(md, "w") as f:
        f.write(
            f"# agentic bench ({payload['device']}, {payload['engine']}, {payload['model']})\n\n"
        )
        f.write(f"tool delay {low}-{high} s per call; {args.groups} groups of ")
        f.write(f"{cfg.task.group_size} per run after {args.warmup} untimed; load {load}\n\n")
        f.write("| " + " | ".join(COLUMNS) + " |\n|" + "---|" * len(COLUMNS) + "\n")
        for r in rows:
            f.write("| " + " | ".join(str(r.get(c)) for c in COLUMNS) + " |\n")
    print(f"wrote {md}")
    return 0
