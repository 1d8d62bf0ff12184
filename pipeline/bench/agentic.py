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

Weight swaps while tools run (``--swap-every S``, default 4 s; 0: none): during every
timed run a thread publishes a new version every S seconds as the actor's weight
receiver would (stages one of two weight sets, the model's own and the same x1.01,
while the engine generates, then ``swap``), and records for each swap how many tool
calls were running (``EpisodeRunner.steps_running``), the lock's hold and the added
gap between the forward passes around it (``EngineStats.gaps_since``: how much longer
than the usual gap); a swap never waits for a tool (tools never hold the engine's lock:
tests/test_episode_actor.py). The trainer's idle share needs the whole pipeline: a run's
``summary.json`` ``trainer_wait``. Writes JSON (``--out``) and a markdown table beside it.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import threading
import time
from datetime import date

from pipeline.bench.common import LoadProbe, device_name, percentile, print_table, write_json

COLUMNS = ["repeat", "mode", "groups", "episodes", "wall_s", "episodes_per_s"]
COLUMNS += ["tokens_per_s", "turns_per_episode", "tool_calls", "engine_empty_share"]
COLUMNS += ["swaps", "swaps_with_tools_running", "lock_ms_p50", "added_gap_ms_p50"]
COLUMNS += ["added_gap_ms_max"]


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m pipeline.bench agentic", description=__doc__)
    p.add_argument("--out", default=f"bench/results/agentic-cpu-{date.today()}.json")
    p.add_argument("--groups", type=int, default=6, help="groups per run")
    p.add_argument("--repeats", type=int, default=2, help="interleaved repeats of both")
    p.add_argument("--delay", default="0.5,2.0", help="tool seconds per call: low,high")
    p.add_argument("--warmup", type=int, default=2, help="groups per mode first, not timed")
    p.add_argument(
        "--swap-every", type=float, default=4.0, help="seconds between new versions; 0: none"
    )
    p.add_argument("overrides", nargs="*", help="config overrides (e.g. actor.engine=hf)")
    args = p.parse_args(argv)
    if args.swap_every < 0 or min(args.groups, args.repeats) < 1 or args.warmup < 0:
        p.error("--swap-every must be >= 0, --groups and --repeats >= 1, --warmup >= 0")
    return args


class Swapper:
    """A new version every ``every_s`` seconds while a run goes, as the weight receiver
    publishes them: stage (while generation goes on), then ``swap`` under the engine's
    lock. Per swap: the tool calls running when it began, the lock's hold (ms); the
    added gaps come from the engine's own records afterwards (:meth:`stop`)."""

    def __init__(self, engine, runner, path: str, dtype: str, every_s: float, tmp: str):
        from pipeline.bench.vllm import Published, versions_of

        self.engine, self.runner, self.every_s = engine, runner, every_s
        self.sets = [
            Published(hf, 64.0, os.path.join(tmp, f"weights-{i}.safetensors"))
            for i, hf in enumerate(versions_of(path, dtype))
        ]
        self.events: list[dict] = []
        self.error: BaseException | None = None

    def start(self) -> None:
        self.events, self._stop = [], threading.Event()
        self.gaps_seen = self.engine.stats.gaps_since(self.engine.stats.gaps_total)[1]
        self._thread = threading.Thread(target=self._run, name="bench-swapper", daemon=True)
        self._thread.start()

    def _stage(self, weights, version: int) -> None:
        if hasattr(self.engine, "rpc"):  # vllm: the worker reads the buckets from the file
            weights.stage(self.engine, version)
        else:
            from pipeline.bench.vllm import file_source

            deadline = time.monotonic() + 300
            self.engine.stage(weights.announce(version), file_source(weights.path), deadline)

    def _run(self) -> None:
        try:
            while not self._stop.wait(self.every_s):
                version = self.engine.version + 1
                self._stage(self.sets[version % 2], version)
                tools = self.runner.steps_running
                self.engine.swap(version)
                held = self.engine.stats.recent_swaps[-1]
                self.events.append({"version": version, "tools_running": tools, "lock_ms": held.ms})
        except BaseException as e:  # reported by stop(): the run's figures would be wrong
            self.error = e

    def stop(self) -> dict:
        self._stop.set()
        self._thread.join(600)
        if self.error is not None:
            raise RuntimeError(f"a swap failed: {self.error!r}") from self.error
        gaps, _ = self.engine.stats.gaps_since(self.gaps_seen)
        added = [g.added_ms for g in gaps if g.ms is not None]
        ev = self.events
        return {
            "swaps": len(ev),
            "swaps_with_tools_running": sum(e["tools_running"] > 0 for e in ev),
            "lock_ms_p50": round(percentile([e["lock_ms"] for e in ev], 50), 2) if ev else None,
            "added_gap_ms_p50": round(percentile(added, 50), 1) if added else None,
            "added_gap_ms_max": round(max(added), 1) if added else None,
            "added_gaps_measured": len(added),
        }


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


def measure(mode: str, engine, runner, cfg, groups: int, swapper=None) -> dict:
    empty0 = engine.empty_s() if hasattr(engine, "empty_s") else None
    t0 = time.monotonic()
    if swapper is not None:
        swapper.start()
    try:
        if mode == "sync":
            eps = run_sync(runner, cfg, groups)
        else:
            eps = run_async(engine, runner, cfg, groups)
    finally:
        swaps = swapper.stop() if swapper is not None else {}
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
        **swaps,
    }


def main(argv: list[str]) -> int:
    from actor.engines import make_engine
    from actor.episodes import EpisodeRunner
    from actor.measure_episodes import compose
    from pipeline.config import pool_dtype
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
        swapper = None
        if args.swap_every > 0:
            tmp = tempfile.mkdtemp(prefix="bench-agentic-")
            swapper = Swapper(
                engine, runner, model_path(cfg), pool_dtype(cfg, "actor"), args.swap_every, tmp
            )
        modes = ("sync", "async") if engine.streaming else ("sync",)  # hf: no streaming
        for mode in modes:  # the engine's first requests and both loops warmed up
            measure(mode, engine, runner, cfg, args.warmup)
        for repeat in range(args.repeats):
            for mode in modes if repeat % 2 == 0 else modes[::-1]:
                got = measure(mode, engine, runner, cfg, args.groups, swapper)
                row = {"repeat": repeat, **got}
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
        f.write(f"{cfg.task.group_size} per run after {args.warmup} untimed; load {load}; ")
        f.write(f"a new version every {args.swap_every:g} s (0: none)\n\n")
        f.write("| " + " | ".join(COLUMNS) + " |\n|" + "---|" * len(COLUMNS) + "\n")
        for r in rows:
            f.write("| " + " | ".join(str(r.get(c)) for c in COLUMNS) + " |\n")
    print(f"wrote {md}")
    return 0
