"""The actor driving episodes: token in, token out with SmolLM2's BPE tokenizer (a
scripted engine emits a non-canonical split that reaches the trainer unchanged),
versions stamped exactly across and inside turns and log-probs the trainer
recomputes over the whole episode (the hf engine on the tiny random model), and
episodes published as rollout groups with their counters (real redis-server)."""

from __future__ import annotations

import threading
import time

import numpy as np
import torch

from actor.engines.hf import HFEngine
from actor.episode_stream import drive_episodes, stream_episodes
from actor.episodes import EpisodeRunner, publish_episodes
from pipeline.envs import load_env
from pipeline.envs.calc import CalcEnv
from pipeline.envs.pyexec import run_python
from pipeline.envs.template import TurnTemplate, encode
from pipeline.envs.tools import ToolBox
from pipeline.messages import (
    SCHEMA_VERSION,
    RolloutGroup,
    TrainBatch,
    WeightAnnouncement,
    decode,
    pack_i32,
    unpack_f32,
)
from pipeline.messages import (
    encode as encode_msg,
)
from pipeline.models import load_model
from pipeline.runtime import Pool
from pipeline.streams import Names
from pipeline.tasks import Problem
from pipeline.telemetry import MetricsFile, PoolStatus, Window, read_jsonl
from pipeline.transfer import TensorSource
from pipeline.transfer.buckets import bucket_layout, bucket_sums, flatten
from preprocessor.main import to_batches
from tests.episode_builders import (
    EchoEnv,
    ScriptedEngine,
    StreamingScriptedEngine,
    env_config,
    smollm2_tokenizer,
)
from trainer.collate import collate
from trainer.step import token_logprobs


def _ids(tok, pieces: list[str]) -> list[int]:
    ids = tok.convert_tokens_to_ids(pieces)
    assert tok.unk_token_id not in ids, pieces
    return ids


def test_a_non_canonical_split_survives_every_turn_unchanged_to_the_trainer():
    tok = smollm2_tokenizer()
    # "<calc>12*34</calc>" with "calc" split in two where the tokenizer has one token
    call = _ids(tok, ["<", "cal", "c", ">", "1", "2", "*", "3", "4", "</", "ca", "lc", ">"])
    assert encode(tok, tok.decode(call)) != call  # re-encoding would change the ids
    answer = encode(tok, "408") + [tok.eos_token_id]
    engine = ScriptedEngine([call, answer], stop_ids=[tok.eos_token_id])
    cfg = env_config("calc")
    cfg.sampling.max_new_tokens = 32
    runner = EpisodeRunner(cfg, engine, tok, CalcEnv, seed=0)
    problem = Problem(id="p", question="What is 12*34?", answer="408")
    ((prompt, eps),) = runner.run([problem], 2)
    runner.close()
    bridge, _ = runner.template.bridge(call, "<result>408</result>", 64)
    # turn 1's request is exactly the held ids: prompt, sampled ids, boundary, observation
    assert engine.prompts[1][0] == prompt + call + bridge
    sample = eps[0].to_sample(0)
    assert sample.tokens().tolist() == call + bridge + answer
    assert sample.sampled().tolist() == [True] * 13 + [False] * len(bridge) + [True] * 4
    assert sample.tool_outcomes == ["ok", ""] and sample.reward == 1.0
    group = RolloutGroup(
        schema=SCHEMA_VERSION,
        group_id="g",
        actor="a",
        problem_id="p",
        prompt_ids=pack_i32(prompt),
        samples=[ep.to_sample(k) for k, ep in enumerate(eps)],
        temperature=1.0,
    )
    group = decode(encode_msg(group), RolloutGroup)
    group.check()
    (batch,) = to_batches([group], budget=10_000)
    batch = decode(encode_msg(batch), TrainBatch)
    batch.check(vocab_size=len(tok))
    mb = collate(batch, 0, torch.device("cpu"))
    assert mb.ids[0, : mb.attn[0].sum()].tolist() == prompt + call + bridge + answer
    assert mb.comp[0].sum() == 17


def _hf(tiny, **kw):
    model, tok = load_model(tiny)
    engine = HFEngine(model, tok, temperature=0.7, top_p=1.0, top_k=0, seed=3, **kw)
    engine.stop_ids = set()  # every turn runs to its token limit
    return engine, tok


def _swap(engine, version: int, delta: float) -> None:
    named = list(engine.model.named_parameters())
    layout = bucket_layout(named, 1 << 16)
    new = flatten({n: p.detach() + delta for n, p in named}, layout)
    ann = WeightAnnouncement(
        schema=SCHEMA_VERSION,
        version=version,
        dtype="float32",
        buckets=layout,
        **bucket_sums(new),
        targets=["actor-0"],
    )
    engine.stage(ann, TensorSource(new), time.monotonic() + 10)
    engine.swap(version)


def test_swaps_inside_and_between_turns_split_the_stamps_where_they_happened(tiny, monkeypatch):
    engine, tok = _hf(tiny)
    forward, passes = engine._forward, []

    def counted(**inputs):  # version 1 lands after the 3rd forward pass of turn 0
        out = forward(**inputs)
        passes.append(out[1])
        if len(passes) == 3:  # as the receiver does it: on its own thread
            receiver = threading.Thread(target=_swap, args=(engine, 1, 1e-3))
            receiver.start()
            receiver.join()
        return out

    monkeypatch.setattr(engine, "_forward", counted)
    monkeypatch.setattr(
        EchoEnv, "on_step", staticmethod(lambda t: t.index == 1 and _swap(engine, 2, 1e-3))
    )
    cfg = env_config(max_turns=3)
    runner = EpisodeRunner(cfg, engine, tok, EchoEnv, seed=0)
    ((_, eps),) = runner.run([runner.tasks.sample()], 2)
    runner.close()
    for ep in eps:
        s = ep.to_sample(0)
        s.check("episode")
        v = s.token_versions().tolist()
        # tokens 0-2 came from passes 1-3 (version 0); the swap inside turn 0 made the
        # rest of it version 1, turn 1 too; the swap between turns 1 and 2 made turn 2 v2
        assert v == [0] * 3 + [1] * 5 + [1] * 8 + [2] * 8, v
        assert s.turn_starts().tolist()[0] == 0 and s.turns() == 3


def test_logprobs_recomputed_over_the_whole_episode_match_the_engines(tiny):
    engine, tok = _hf(tiny)
    cfg = env_config(max_turns=3)
    runner = EpisodeRunner(cfg, engine, tok, EchoEnv, seed=0)
    problems = [runner.tasks.sample()]
    ((prompt, eps),) = runner.run(problems, 2)
    runner.close()
    batch = TrainBatch(
        schema=SCHEMA_VERSION,
        batch_id="b",
        group_ids=["g", "g"],
        prompt_ids=[pack_i32(prompt)] * 2,
        samples=[ep.to_sample(k) for k, ep in enumerate(eps)],
        temperature=0.7,
    )
    batch.check(vocab_size=len(tok))
    mb = collate(batch, tok.pad_token_id, torch.device("cpu"))
    with torch.no_grad():  # the trainer's own forward over prompt + every turn
        lp = token_logprobs(engine.model, mb, None)
    for row, s in enumerate(batch.samples):
        assert s.turns() == 3 and s.n_sampled() == 24
        np.testing.assert_allclose(
            lp[row][mb.comp[row]].numpy(), unpack_f32(s.logprobs), atol=2e-4, rtol=1e-4
        )


def test_a_swap_is_not_delayed_by_a_hung_tool(tiny):
    engine, tok = _hf(tiny)
    cfg = env_config("pyexec", call_timeout_s=3.0)
    runner = EpisodeRunner(cfg, engine, tok, load_env("pyexec"), seed=0)
    box = ToolBox(runner.limits, runner.gate)

    hung = threading.Thread(
        target=lambda: runner._all([box.run(lambda t: run_python("while True: pass", t))])
    )
    hung.start()
    time.sleep(0.5)
    t0 = time.monotonic()
    _swap(engine, 1, 1e-3)  # the receiver's side: stage, then swap under the lock
    took = time.monotonic() - t0
    hung.join()
    runner.close()
    assert engine.version == 1 and took < 1.0, took
    assert box.counts["timeout"] == 1


def test_episodes_are_published_as_groups_with_their_counters(tiny, rclient, tmp_path):
    engine, tok = _hf(tiny)
    cfg = env_config(max_turns=3)
    names = Names("test", "episodes")
    pool = Pool(
        cfg=cfg,
        name="actor-0",
        role="actor",
        client=rclient,
        names=names,
        stop=threading.Event(),
        status=PoolStatus(rclient, names, "actor-0", "actor"),
        metrics=MetricsFile(str(tmp_path / "metrics.jsonl")),
    )
    runner = EpisodeRunner(cfg, engine, tok, EchoEnv, seed=0)
    assert publish_episodes(pool, runner, Window(10), prompts_n=2) == 2
    runner.close()
    entries = rclient.xrange(names.rollouts)
    assert len(entries) == 2
    for _, fields in entries:
        group = decode(fields[b"data"], RolloutGroup)
        group.check()
        assert [s.turns() for s in group.samples] == [3, 3]
    status = rclient.hgetall(pool.status.key)
    assert int(status[b"episodes"]) == 4 and int(status[b"turns"]) == 12
    assert int(status[b"tool_calls"]) == 8 and int(status[b"tool.ok"]) == 8
    assert int(status[b"multi_turn"]) == 4
    pool.metrics.close()
    (rec, _) = [r for r in read_jsonl(str(tmp_path / "metrics.jsonl")) if r["event"] == "group"]
    assert rec["episodes"]["turns"] == 6


def test_the_template_check_refuses_a_template_that_is_not_append_only(tiny):
    _, tok = load_model(tiny)
    tok.chat_template = (  # a count of the messages up front: rewritten by every turn
        "{{ messages|length }}\n{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
        "{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    try:
        TurnTemplate.of(tok)
    except ValueError as e:
        assert "not append-only" in str(e)
    else:
        raise AssertionError("a rewriting template was accepted")


def test_the_streaming_loop_generates_other_episodes_while_a_tool_runs(rclient, tmp_path):
    """pipeline.mode=async on a streaming engine (actor/episode_stream.py): the first
    episode's tool takes 1.5 s; meanwhile the other episodes' later turns are submitted
    and finished, and every group is published whole."""
    tok = smollm2_tokenizer()
    engine = StreamingScriptedEngine([encode(tok, "hi")], stop_ids=[tok.eos_token_id])
    cfg = env_config(max_turns=3)
    cfg.task.env_args = {"turns": 3, "slow_first": 1.5}
    cfg.task.group_size, cfg.actor.max_queue_groups = 2, 100
    cfg.actor.vllm.in_flight = 2  # open_target: 2 groups of 2 episodes at once
    names = Names("test", "stream")
    pool = Pool(
        cfg=cfg,
        name="actor-0",
        role="actor",
        client=rclient,
        names=names,
        stop=threading.Event(),
        status=PoolStatus(rclient, names, "actor-0", "actor"),
        metrics=MetricsFile(str(tmp_path / "metrics.jsonl")),
    )
    rclient.set(names.trainer_version, 0)
    EchoEnv.made = 0
    runner = EpisodeRunner(cfg, engine, tok, EchoEnv, seed=0)
    done = {}
    loop = threading.Thread(
        target=lambda: done.setdefault(
            "groups", stream_episodes(pool, engine, runner, tok, Window(10), None, _Receiver())
        )
    )
    loop.start()
    t0 = time.monotonic()
    while (0, 0, 2) not in engine.submitted and time.monotonic() - t0 < 30:
        time.sleep(0.05)
    time.sleep(0.5)  # the slow episode's group ends and is published
    pool.stop.set()
    loop.join(timeout=30)
    runner.close()
    slow_turn_1 = engine.submitted.index((0, 0, 1))
    # while episode (0, 0)'s first tool call ran, the others went through all three turns
    for other in ((0, 1, 2), (1, 0, 2), (1, 1, 2)):
        assert engine.submitted.index(other) < slow_turn_1, engine.submitted
    entries = rclient.xrange(names.rollouts)
    assert done["groups"] == len(entries) >= 4
    for _, fields in entries:
        group = decode(fields[b"data"], RolloutGroup)
        group.check()
        assert [s.turns() for s in group.samples] == [3, 3]
    assert int(rclient.hget(pool.status.key, "episodes")) == 2 * len(entries)


class _Receiver:
    applied = failed = 0


def test_the_start_up_check_names_where_the_bridge_leaves_the_template():
    tok = smollm2_tokenizer()
    template = TurnTemplate.of(tok, "user", [tok.eos_token_id])
    template.check()  # SmolLM2's ChatML template: the bridge reproduces it
    # boundary ids that are not the template's (e.g. "\n" dropped after <|im_end|>)
    template.open_assistant = template.open_assistant[:1] + template.open_assistant[2:]
    try:
        template.check()
    except ValueError as e:
        assert "does not reproduce the model's chat template" in str(e)
        assert "at position" in str(e)
    else:
        raise AssertionError("a bridge that differs from the template passed the check")


def test_an_oversized_observation_is_cut_to_its_token_budget_and_counted():
    tok = smollm2_tokenizer()
    call = encode(tok, "<calc>2**60</calc>")  # <result>1152921504606846976</result>
    engine = ScriptedEngine([call, encode(tok, "1") + [tok.eos_token_id]])
    cfg = env_config("calc", max_observation_tokens=5)
    cfg.sampling.max_new_tokens = 32
    runner = EpisodeRunner(cfg, engine, tok, CalcEnv, seed=0)
    ((prompt, eps),) = runner.run([Problem(id="p", question="2**60?", answer="1")], 2)
    runner.close()
    s = eps[0].to_sample(0)
    assert s.tool_outcomes == ["oversized", ""]
    observed = s.tokens()[~s.sampled()].tolist()
    bridge = runner.template
    assert (
        observed == bridge.close_assistant + encode(tok, "<result>115")[:5] + bridge.open_assistant
    )


def test_a_failed_turn_request_ends_its_episode_as_an_infra_failure():
    """The streaming loop's own part (drive_episodes): episode (0, 1)'s second turn fails
    in the engine: it ends on its first turn, marked infra; group 1's first turn fails:
    that group is dropped, never finished; the others go on."""
    tok = smollm2_tokenizer()
    engine = StreamingScriptedEngine([encode(tok, "hi")], stop_ids=[tok.eos_token_id])
    engine.fail = {(0, 1, 1), (1, 0, 0)}
    cfg = env_config(max_turns=3)
    cfg.task.env_args = {"turns": 3}
    runner = EpisodeRunner(cfg, engine, tok, EchoEnv, seed=0)
    started, finished = [0], []

    def admit():
        started[0] += 1
        return started[0] <= 3

    drive_episodes(
        engine, runner, 2, 2, admit, finished.append, lambda: len(finished) >= 2, lambda n: None
    )
    runner.close()
    (g0, g2) = finished
    assert [ep.infra for ep in g0.episodes] == [False, True]
    assert [len(ep.offsets) for ep in g0.episodes] == [3, 1]
    s = g0.episodes[1].to_sample(1)
    s.check("episode")  # ended on its first turn's sampled ids, the observation taken back
    assert s.infra_failure and s.n_sampled() == len(s.tokens())
    assert all(not ep.infra for ep in g2.episodes)
