"""Episodes (``task.kind=env``): G multi-turn episodes per task, turn by turn on the engine
(the batch loop: the hf engine, sync mode; actor/episode_stream.py drives the same
EpisodeRunner without turn boundaries on a streaming engine in async mode).

::

    reads   the environment's tasks (task.env, pipeline/envs); the engine's sampled ids,
            log-probs and per-token versions of each turn
    writes  one rollout group per task (actor/publish.py send_group: each Sample an
            episode, pipeline/messages.py); the status hash's episode counters
            (episodes, turns, tool_calls, tool.<outcome>, infra_failures,
            episodes_spanning, episodes_resumed, episodes_restarted,
            episode_groups_taken_over); ``episodes`` fields on each ``group`` metrics
            record, an ``episode_group`` record per group opened or taken over; each
            finished turn to the episode journal (actor/journal.py), from which a group
            of a dead actor is taken over
    blocks  on the engine for each turn of the open episodes; on the turn's tool calls
            (bounded: task.episode budgets, pipeline/envs/tools.py)

Per turn, every open episode is one request from token ids (``engine.generate``),
its prompt the ids it holds: token in, token out (pipeline/envs/template.py). A
turn ends at EOS, at the episode's token room, or at the first of the
environment's stop strings (``</calc>``), kept as the sampled id that completed it.
The hf engine stops a row there itself (``HFEngine.stop_strings``: the decoded tail
of its sampled ids, checked each step). vLLM does not: the actor runs it with
``skip_tokenizer_init=True`` (token ids in and out, no detokenizer in the engine
core), and vLLM matches stop strings only in that detokenizer (``SamplingParams.stop``
needs ``detokenize=True``); ``stop_token_ids`` cannot say a string that spans several
ids (``</calc>`` is several ids, and its last, ``>``, ends other text too). So on vllm
a turn runs on to EOS or its budget and the stop string is found afterwards in the
decoded text (:func:`cut_at_stop`): the ids past it are dropped, which costs their
compute, never correctness (the kept ids, their log-probs and their versions are
exactly what was sampled). Each kept id keeps the version of the forward pass that sampled it, so
an episode that a swap lands in, inside a turn or between two, is stamped exactly
where it happened. A turn's prompt is computed again on the engine's live weights
(hf: no cache across requests; vllm: the prefix cache is salted per version,
actor/engines/vllm/requests.py, so earlier turns' KV is reused only under the
weights it was computed with).

The environment answers each turn (``step``): a tool's observation, appended
between the template's boundary ids (mask 0), or done with the reward. Tool calls
run on the runner's event loop, a thread of its own (here: between two turns); the
weight receiver swaps under the engine's lock on its own thread, so a tool never
delays a swap.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from actor.engines import Completion, Engine
from pipeline.envs import Environment, Step, Turn
from pipeline.envs.template import TurnTemplate
from pipeline.envs.tools import ToolBox, ToolLimits
from pipeline.messages import (
    Sample,
    pack_f32,
    pack_i32,
    pack_mask,
    pack_u8,
    rle_encode,
)

log = logging.getLogger(__name__)


@dataclass
class Journaled:
    """What the episode journal holds of an episode (actor/journal.py): the deltas
    written (the next one's ``seq``), and the ids (of those the episode still holds),
    sampled ids, turn offsets and tool outcomes they cover: the next delta starts
    after them."""

    deltas: int = 0
    ids: int = 0
    sampled: int = 0
    offsets: int = 0
    outcomes: int = 0


@dataclass
class Episode:
    """One episode as it grows: every id after the prompt and what the loss needs."""

    env: Environment
    tools: ToolBox
    ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    kept: list = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)
    outcomes: list[str] = field(default_factory=list)
    reward: float = 0.0
    done: bool = False
    finished: bool = False  # the last turn ended at EOS
    infra: bool = False
    exact: bool = True
    observed: int = 0  # ids of the last observation appended
    key: tuple[str, int] | None = None  # (group id, index) in the journal (actor/journal.py)
    resumed: bool = False  # taken over from the journal: its written turns kept
    restarted: bool = False  # taken over, begun again from reset (env not resumable)
    journaled: Journaled = field(default_factory=Journaled)  # what the journal holds of it

    def add_turn(self, out: Completion, n: int) -> None:
        self.offsets.append(len(self.ids))
        self.ids += out.tokens[:n]
        self.mask += [1] * n
        self.logprobs += out.logprobs[:n]
        self.versions += out.versions[:n]
        self.kept += out.kept[:n]
        self.exact &= out.versions_exact

    def add_observation(self, ids: list[int]) -> None:
        self.ids += ids
        self.mask += [0] * len(ids)
        self.observed = len(ids)

    def drop_observation(self) -> None:
        """Take back the last observation (no turn followed it: an episode ends sampled)."""
        if self.observed and self.mask[-1] == 0:
            del self.ids[-self.observed :], self.mask[-self.observed :]
            # a written observation: the next delta keeps the ids before it
            self.journaled.ids = min(self.journaled.ids, len(self.ids))
        self.observed = 0

    def mark_journaled(self, deltas: int) -> None:
        """The journal holds ``deltas`` deltas of this episode, covering all of it."""
        self.journaled = Journaled(
            deltas, len(self.ids), len(self.logprobs), len(self.offsets), len(self.outcomes)
        )

    def to_sample(self, index: int) -> Sample:
        mask_ids, mask_counts = pack_mask(self.kept)
        one_turn = len(self.offsets) == 1
        return Sample(
            index=index,
            completion_ids=pack_i32(self.ids),
            logprobs=pack_f32(self.logprobs),
            versions=rle_encode(self.versions),
            reward=float(self.reward),
            finished=self.finished,
            mask_ids=mask_ids,
            mask_counts=mask_counts,
            versions_exact=self.exact,
            # the one-turn episode is written as a plain completion (no mask, no offsets)
            loss_mask=b"" if one_turn else pack_u8(self.mask),
            turn_offsets=b"" if one_turn else pack_i32(self.offsets),
            tool_outcomes=list(self.outcomes),
            infra_failure=self.infra,
        )


@dataclass
class OpenGroup:
    """A task's G episodes, from their opening to their publishing."""

    problem: object
    prompt: list[int]
    episodes: list[Episode]
    group_id: str = ""  # the rollout group's id (the journal's key); "" without a journal


def cut_at_stop(tokenizer, tokens: list[int], stops: tuple[str, ...]) -> int | None:
    """The fewest leading ids whose text holds one of ``stops`` (None: no stop in them)."""
    if not stops or not any(s in tokenizer.decode(tokens) for s in stops):
        return None
    lo, hi = 1, len(tokens)
    while lo < hi:  # the text of a longer prefix holds what a shorter one's does
        mid = (lo + hi) // 2
        if any(s in tokenizer.decode(tokens[:mid]) for s in stops):
            hi = mid
        else:
            lo = mid + 1
    return lo


class EpisodeRunner:
    """Runs groups of episodes of one environment class on one engine."""

    def __init__(self, cfg, engine: Engine, tokenizer, env_cls: type, seed: int):
        self.cfg, self.engine, self.tokenizer, self.env_cls = cfg, engine, tokenizer, env_cls
        e = cfg.task.episode
        self.limits = ToolLimits(
            e.max_tool_calls,
            e.call_timeout_s,
            e.episode_tool_s,
            e.concurrency,
            e.max_observation_tokens,
        )
        self.template = TurnTemplate.of(
            tokenizer, env_cls.observation_role, getattr(engine, "stop_ids", ())
        )
        self.template.check()  # token in, token out reproduces apply_chat_template
        if env_cls.stop and hasattr(engine, "stop_strings"):
            # the tool-call closing tags as the engine's own stop strings (hf): a row
            # stops at the id that completes one. _cut still finds them post hoc, for
            # vllm (no stop strings: module doc) and the scripted test engines
            engine.stop_strings = tuple(env_cls.stop)
        if env_cls.stop and hasattr(engine, "stop_strings"):
            # the tool-call closing tags as the engine's own stop sequences (hf, vllm):
            # a turn ends at the id that completes one; _cut still finds it post hoc
            # (the scripted test engines have none, and an engine may run past it)
            engine.stop_strings = tuple(env_cls.stop)
        self.tasks = env_cls.tasks(dict(cfg.task.env_args), seed)
        # the environments' event loop, on a thread of its own: tool calls run there
        # while this thread drives the engine (the streaming loop goes on generating)
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="episode-tools")
        self._thread.daemon = True
        self._thread.start()
        self.gate = self.call(_semaphore(e.concurrency))
        self.journal = None  # actor/journal.py: set by the actor (the pool's Redis)
        self.env_errors: Counter = Counter()  # reset / step raised, by which
        self.on_env_error = None  # called with "reset" or "step" (the actor counts it)
        self.steps_running = 0  # environment steps (tool calls) in progress now

    def close(self) -> None:
        if self.journal is not None:
            self.journal.close()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=5)
        if not self._thread.is_alive():
            self.loop.close()

    def spawn(self, coro) -> concurrent.futures.Future:
        """Run ``coro`` on the environments' loop; its future."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def call(self, coro):
        """Run ``coro`` on the environments' loop and wait for its result."""
        return self.spawn(coro).result()

    def new_episodes(self, n: int) -> list[Episode]:
        eps = []
        for _ in range(n):
            tools = ToolBox(self.limits, self.gate)
            eps.append(Episode(self.env_cls(dict(self.cfg.task.env_args), tools), tools))
        return eps

    def openings(self, problems: list, eps: list[Episode], group_size: int) -> list[list[int]]:
        """Reset every episode; per problem, the prompt ids its G episodes share."""
        openings = self._all(ep.env.reset(problems[i // group_size]) for i, ep in enumerate(eps))
        prompts = [self.template.prompt(m) for m in openings]
        for i in range(0, len(eps), group_size):
            if any(p != prompts[i] for p in prompts[i : i + group_size]):
                raise ValueError(
                    f"{self.env_cls.__name__}.reset gave different opening messages to "
                    "the episodes of one task: a group shares one prompt"
                )
        return prompts[::group_size]

    def open_group(self, problem, group_size: int, group_id: str = "") -> OpenGroup | None:
        """G new episodes of ``problem``, reset, and (with a journal and a ``group_id``)
        written to the journal; None when the environment's ``reset`` raised (logged and
        counted in ``env_errors``: nothing was opened)."""
        eps = self.new_episodes(group_size)
        try:
            (prompt,) = self.openings([problem], eps, group_size)
        except Exception as e:
            self._env_failed("reset", e)
            self._all(ep.env.close() for ep in eps)
            return None
        grp = OpenGroup(problem, prompt, eps, group_id)
        if self.journal is not None and group_id:
            self.journal.open(group_id, problem, prompt, group_size)
            for k, ep in enumerate(eps):
                ep.key = (group_id, k)
        return grp

    def take_over(self) -> OpenGroup | None:
        """A group another actor left in the journal (actor/journal.py), resumed from its
        last written turns: episodes of a resumable environment go on from there
        (``restore``), the others, an episode with no turn written and one whose deltas
        the journal refused (a gap, a delta that does not fit: logged there), restart
        from ``reset`` (their deltas deleted); None when there is none (or no journal)."""
        from actor.journal import restore_episode

        taken = self.journal.take_over() if self.journal is not None else None
        if taken is None:
            return None
        opened, problem = taken.opened, taken.opened.problem
        prompt = np.frombuffer(opened.prompt_ids, dtype="<i4").tolist()
        eps = self.new_episodes(opened.group_size)
        for k, ep in enumerate(eps):
            ep.key, st = (opened.group_id, k), taken.states.get(k)
            keep = st is not None and (st.done or self.env_cls.resumable)
            if keep:
                restore_episode(ep, st)
                ep.resumed = True
                if not st.done:  # a finished episode's environment is never asked again
                    self._restore(ep, problem, st.env_state)
                continue
            ep.restarted = True
            # its deltas go (refused, or an environment that cannot resume): it writes anew
            self.journal.forget(opened.group_id, taken.fields.get(k, []))
            try:
                (again,) = self.openings([problem], [ep], 1)
            except Exception as e:  # the group cannot be published whole: it goes
                self._env_failed("reset", e)
                log.error("episode group %s dropped: an episode cannot restart", opened.group_id)
                self._all(x.env.close() for x in eps)
                self.journal.done(opened.group_id)
                return None
            if again != prompt:
                raise ValueError(
                    f"{self.env_cls.__name__}.reset gave another opening for problem "
                    f"{problem.id} than when group {opened.group_id} was opened: an episode "
                    "cannot restart in its group (reset must depend on the problem only)"
                )
        return OpenGroup(problem, prompt, eps, opened.group_id)

    def _restore(self, ep: Episode, problem, env_state: bytes) -> None:
        """``ep.env.restore``; one that raises ends the episode on its written turns as
        an infrastructure failure (logged, ``env_errors.restore``)."""
        from actor.journal import unpack_env_state

        try:
            self.call(ep.env.restore(problem, unpack_env_state(env_state)))
        except Exception as e:
            self._env_failed("restore", e)
            ep.drop_observation()
            ep.done = ep.infra = True

    def written(self, ep: Episode) -> None:
        """Episode ``ep`` finished a turn (or ended): write what it added since its last
        write to the journal (a delta: actor/journal.py)."""
        if self.journal is None or ep.key is None:
            return
        from actor.journal import episode_delta, pack_env_state

        gid, k = ep.key
        if self.journal.write(gid, episode_delta(ep, k, pack_env_state(ep.env))):
            ep.mark_journaled(ep.journaled.deltas + 1)

    def run(self, problems: list, group_size: int, should_stop=lambda: False, on_turn=None):
        """G episodes per problem, to their ends; per problem (prompt ids, episodes).
        None when ``should_stop`` cut a turn short (nothing is published).
        ``on_turn(open)``: before each turn, how many episodes are open (0 at the end)."""
        groups = [self.open_group(p, group_size) for p in problems]
        if any(g is None for g in groups):
            raise ValueError(f"{self.env_cls.__name__}.reset raised (logged above)")
        done = self.drive(groups, should_stop, on_turn)
        return None if done is None else [(g.prompt, g.episodes) for g in done]

    def drive(self, groups: list[OpenGroup], should_stop=lambda: False, on_turn=None):
        """Every open episode of ``groups`` turn by turn to its end; ``groups``, or None
        when ``should_stop`` cut a turn short. Each episode's next turn is its own (a
        group taken over may hold episodes at different turns)."""
        eps = [ep for grp in groups for ep in grp.episodes]
        prompts = [grp.prompt for grp in groups for _ in grp.episodes]
        try:
            while True:
                open_ = [(i, ep) for i, ep in enumerate(eps) if not ep.done]
                if on_turn is not None:
                    on_turn(len(open_))
                if not open_:
                    break
                if not self._turn(open_, prompts, should_stop):
                    return None
        finally:
            self._all(ep.env.close() for ep in eps)
            if on_turn is not None:
                on_turn(0)
        return groups

    def _turn(self, open_: list, prompts: list, should_stop) -> bool:
        """One turn of every open episode: generate, cut, step the environments."""
        e, engine = self.cfg.task.episode, self.engine
        room = [e.max_tokens - len(ep.ids) for _, ep in open_]
        index = [len(ep.offsets) for _, ep in open_]  # each episode's next turn
        per_turn = min(self.cfg.sampling.max_new_tokens, max(room))
        outs = engine.generate(
            [prompts[i] + ep.ids for i, ep in open_], per_turn, should_stop=should_stop
        )
        if should_stop():
            return False
        turns = [
            self.take_turn(ep, out, min(r, per_turn), t)
            for (_, ep), out, r, t in zip(open_, outs, room, index, strict=True)
        ]
        live = [(ep, t) for (_, ep), t in zip(open_, turns, strict=True) if t is not None]
        steps = self._all(self.step(ep, t) for ep, t in live)
        for (ep, t), step in zip(live, steps, strict=True):
            self.apply(ep, t, step, t.index >= e.max_turns - 1)
        return True

    async def step(self, ep: Episode, turn: Turn) -> Step:
        """``ep.env.step(turn)``; an environment that raises ends the episode as an
        infrastructure failure (out of its group's advantage statistics, logged and
        counted in ``env_errors``), never the actor."""
        self.steps_running += 1  # only ever changed on the loop thread
        try:
            return await ep.env.step(turn)
        except Exception as e:
            self._env_failed("step", e)
            return Step(done=True, outcome="infra", infra=True)
        finally:
            self.steps_running -= 1

    def _env_failed(self, what: str, e: Exception) -> None:
        log.error(
            "%s.%s raised %s: %s (an infrastructure failure, not the model's)",
            self.env_cls.__name__,
            what,
            type(e).__name__,
            e,
            exc_info=e,
        )
        self.env_errors[what] += 1
        if self.on_env_error is not None:
            self.on_env_error(what)

    def take_turn(self, ep: Episode, out: Completion, room: int, index: int) -> Turn | None:
        """Add a turn's sampled ids (cut) to ``ep``; the Turn the environment reads, or
        None when nothing was sampled (the episode then ends on its last sampled id)."""
        n, ended = self._cut(out, room)
        if n == 0:  # an engine cut short
            ep.drop_observation()
            ep.done = True
            self.written(ep)
            return None
        ep.add_turn(out, n)
        text = self.tokenizer.decode(out.tokens[:n], skip_special_tokens=True)
        return Turn(text=text, ended=ended, index=index)

    def turn_budget(self, ep: Episode) -> int:
        """The most ids ``ep``'s next turn may sample."""
        room = self.cfg.task.episode.max_tokens - len(ep.ids)
        return min(self.cfg.sampling.max_new_tokens, room)

    def _cut(self, out: Completion, room: int) -> tuple[int, str]:
        """(ids kept, how the turn ended): at the first stop string, at EOS, or at the
        episode's room."""
        n = min(len(out.tokens), room)
        at = cut_at_stop(self.tokenizer, out.tokens[:n], self.env_cls.stop)
        if at is not None:
            return at, "stop"
        if out.finished and n == len(out.tokens):
            return n, "eos"
        return n, "length"

    def apply(self, ep: Episode, turn: Turn, step: Step, last: bool) -> None:
        """The environment's answer to ``turn``: the episode ends, or the observation is
        appended between the template's boundary ids."""
        ep.reward += float(step.reward)
        ep.infra |= step.infra
        outcome = step.outcome
        if step.done or step.observation is None or last:
            ep.done, ep.finished = True, turn.ended == "eos"
            ep.outcomes.append(outcome)
            self.written(ep)
            return
        ids, cut = self.template.bridge(
            ep.ids[-1:], step.observation, self.cfg.task.episode.max_observation_tokens
        )
        if cut and outcome == "ok":
            outcome = "oversized"
            ep.tools.counts["ok"] -= 1
            ep.tools.counts["oversized"] += 1
        ep.outcomes.append(outcome)
        if len(ep.ids) + len(ids) >= self.cfg.task.episode.max_tokens:
            ep.done = True  # no room for the observation and another turn
        else:
            ep.add_observation(ids)
        self.written(ep)

    def _all(self, coros):
        async def gather():
            return await asyncio.gather(*coros)

        return self.call(gather())


async def _semaphore(n: int) -> asyncio.Semaphore:
    return asyncio.Semaphore(n)


def episode_counts(episodes: list[Episode]) -> dict:
    """A group's episode counters (status hash and metrics record)."""
    c: Counter = Counter()
    for ep in episodes:
        c["episodes"] += 1
        c["turns"] += len(ep.offsets)
        c["tool_calls"] += sum(1 for o in ep.outcomes if o)
        for o in ep.outcomes:
            if o:
                c[f"tool.{o}"] += 1
        c["infra_failures"] += int(ep.infra)
        v = np.asarray(ep.versions)
        c["episodes_spanning"] += int(v.size > 0 and v.min() != v.max())
        c["multi_turn"] += int(len(ep.offsets) > 1)
        c["episodes_resumed"] += int(ep.resumed)
        c["episodes_restarted"] += int(ep.restarted)
    return dict(c)


def publish_episodes(pool, runner: EpisodeRunner, rewards, prompts_n: int) -> int:
    """Run a batch of groups of episodes and publish each as a rollout group: a group
    another actor left in the journal when there is one (taken over, alone), else
    ``prompts_n`` new tasks' groups; return the groups published (0 when the pool
    stopped mid-turn: the groups stay in the journal, for this actor restarted or
    another one to take over)."""
    from actor.publish import new_group_id

    g = pool.cfg.task.group_size
    taken = runner.take_over()
    if taken is not None:
        groups = [taken]
        opened_as(pool, taken)
    else:
        groups = []
        for _ in range(prompts_n):
            grp = runner.open_group(runner.tasks.sample(), g, new_group_id(pool))
            if grp is not None:
                opened_as(pool, grp)
                groups.append(grp)
    done = runner.drive(
        groups,
        should_stop=pool.tick,
        on_turn=lambda n: pool.status.set(episodes_open=n),
    )
    if done is None or pool.stop.is_set():
        return 0  # a half-finished batch is not published (its groups stay in the journal)
    for grp in done:
        publish_open_group(pool, runner, grp, rewards)
    return len(done)


def opened_as(pool, grp: OpenGroup) -> None:
    """The actor's record of a group it opened or took over (pipeline/run/accounting.py:
    every group opened is published, or still open in the journal at the end)."""
    taken = any(ep.resumed or ep.restarted for ep in grp.episodes)
    pool.record(
        event="episode_group",
        group=grp.group_id,
        action="taken_over" if taken else "opened",
        resumed=sum(ep.resumed for ep in grp.episodes),
        restarted=sum(ep.restarted for ep in grp.episodes),
    )
    if taken:
        pool.status.incr("episode_groups_taken_over")


def dead_lettered_as(pool, group_id: str, reason: str) -> None:
    """The actor's record of a group it took over and dead-lettered (actor/journal.py
    ``Journal.dead_letter``: refused whole, its journal in ``<run>:dead``), counted in
    the status hash (``episode_groups_dead_lettered``, ``dead_lettered``); the account
    (pipeline/run/accounting.py) finds it dead-lettered, not lost."""
    pool.record(event="episode_group", group=group_id, action="dead_lettered", reason=reason)
    pool.status.incr("episode_groups_dead_lettered")
    pool.status.incr("dead_lettered")


def publish_open_group(pool, runner: EpisodeRunner, grp: OpenGroup, rewards) -> None:
    """XADD a group whose episodes all ended (once, on its journal's group id), count
    it, and remove it from the journal."""
    from actor.publish import send_group, to_group

    samples = [ep.to_sample(k) for k, ep in enumerate(grp.episodes)]
    rewards.add(*[ep.reward for ep in grp.episodes])
    counts = episode_counts(grp.episodes)
    group = to_group(pool, grp.problem, grp.prompt, samples, group_id=grp.group_id or None)
    send_group(pool, group, episodes=counts)
    for name, value in counts.items():
        pool.status.incr(name, value)
    if runner.journal is not None and grp.group_id:
        runner.journal.done(grp.group_id)
