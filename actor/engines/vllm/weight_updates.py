"""New weights for the ``vllm`` engine: the actor-side half of the worker extension.

::

    receiver thread (actor)                 engine-core process (worker/extension.py)
    stage(ann, source)  --------------->    nonstop_update(ann, source, swap=False):
                                            staging filled on a side stream while
                                            generating; polled until staged on every rank
      TP > 1, per bucket (worker/tp.py) -->    nonstop_broadcast(version, i, ...): rank 0's
                                            bucket to every rank, on the engine thread
    swap(version), lock mode  --------->    nonstop_swap: between two forward passes
                                            (the per-forward lock); polled until live
    swap(version), pause mode --------->    pause_generation(keep), nonstop_swap_paused,
                                            resume_generation

Every call is a ``collective_rpc``; with tensor parallelism every worker answers and
the answers are merged (a version is staged or live only when it is on every rank).
:class:`EngineChannel` is the handle the actor's WeightReceiver joins with: the
buckets land in the engine-core process, never in the actor's.
"""

from __future__ import annotations

import os
import tempfile
import time
from typing import Any

import torch

from pipeline import lora as lora_lib
from pipeline.messages import WeightAnnouncement, encode
from pipeline.transfer import BucketSource, ReceiverSource

POLL_S = 0.01  # between polls of the worker while an update runs


def relay_buckets(ann: Any, poll: Any, call: Any, failed_before: int, deadline: float) -> None:
    """The client's half of a TP > 1 staging (worker/tp.py; tests/tp_rank.py drives it
    too): once ``nonstop_update(..., swap=False)`` was sent, for each bucket wait until every rank's
    receiver thread waits at it (the merged poll's ``tp_ready``; rank 0 has read it from
    the channel by then), then ``nonstop_broadcast`` it. ``poll()``: the merged
    ``nonstop_poll`` answer; ``call(method, *args)``: a call on every rank. A failure on
    any rank, or the deadline, gives the version up on every rank
    (``nonstop_abort_stage``) and raises."""

    def give_up(why: str) -> None:
        call("nonstop_abort_stage", ann.version, why)

    for i, bucket in enumerate(ann.buckets):
        while True:
            status = poll()
            if status["failed"] > failed_before:
                give_up(f"given up: another TP rank failed: {status['last_error']}")
                raise RuntimeError(
                    f"staging version {ann.version} failed in the vLLM worker: "
                    f"{status['last_error']}"
                )
            ready = status.get("tp_ready")
            if ready is not None and ready["version"] == ann.version and ready["index"] >= i:
                break
            if time.monotonic() > deadline:
                give_up(f"given up: bucket {i} was not ready on every TP rank in time")
                raise TimeoutError(
                    f"staging version {ann.version}: bucket {i} was not ready on every TP "
                    "rank in time"
                )
            time.sleep(POLL_S)
        call("nonstop_broadcast", ann.version, i, bucket.numel, ann.dtype)


class EngineChannel:
    """The actor-side handle of the worker's transfer channel: the WeightReceiver joins
    through Redis as usual and calls connect(), which opens ``weights.transport`` in
    the engine-core process; buckets then land there, never in this process."""

    device = torch.device("cpu")

    def __init__(self, engine: Any, transport: str):
        self.engine, self.name = engine, transport

    def connect(self, rendezvous: dict[str, str], nonce: str, deadline: float) -> None:
        self.engine.rpc(
            "nonstop_connect", self.name, rendezvous, nonce, timeout=deadline - time.monotonic()
        )  # returns at once: the worker's receiver thread does the handshake; wait for it
        while True:
            channel = self.engine.rpc("nonstop_poll", [], False).get("channel") or {}
            if channel.get("nonce") == nonce and channel["state"] == "connected":
                return
            if channel.get("nonce") == nonce and channel["state"] == "failed":
                raise ConnectionError(f"the vLLM worker's {self.name} channel: {channel['error']}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the vLLM worker's {self.name} channel did not open in time")
            time.sleep(0.05)  # each poll is a step boundary for the engine: not too often

    def begin(self, version: int, buckets: int, deadline: float) -> None:
        self.receive([], deadline)

    def receive(self, buckets: list[torch.Tensor], deadline: float) -> None:
        raise RuntimeError("the vLLM engine receives in its own process; use engine.stage()")

    def finish(self, error: str | None) -> None:
        pass  # the worker's own channel acknowledges the version

    def close(self) -> None:
        if not self.engine.closed:
            self.engine.rpc("nonstop_disconnect")


def merge(answers: list[Any]) -> Any:
    """One answer from every worker's: the first with one worker; with tensor
    parallelism ``nonstop_poll`` answers are merged (worker/tp.py merge_polls)."""
    if len(answers) == 1 or not isinstance(answers[0], dict) or "live_version" not in answers[0]:
        return answers[0]
    from actor.engines.vllm.worker.tp import merge_polls

    return merge_polls(answers)


class VLLMWeights:
    """Mixed into VLLMEngine: stage, swap (lock or pause), the worker polls.

    Expects ``rpc``, ``_call``, ``llm``, ``settings``, ``stats``, ``kind``,
    ``update_mode``, ``rpc_timeout_s`` and ``version`` from the engine."""

    _swaps_done = 0  # part of the prefix-cache salt (a version number may repeat)
    _transition = False  # a swap is asked for and not confirmed: unique salts

    def remote_receiver(self, transport: str) -> EngineChannel:
        """The Receiver handle the actor's WeightReceiver joins with (``receiver=``)."""
        return EngineChannel(self, transport)

    def _wait_worker(self, done, what: str, failed_before: int, deadline: float) -> dict:
        """Poll the workers until ``done(status)``; raise on a new failure or the
        deadline. The returned status holds every swap record taken on the way."""
        swaps: list[dict] = []
        while True:
            status = self.rpc("nonstop_poll", [])
            swaps += status["swaps"]
            status["swaps"] = swaps
            if status["failed"] > failed_before:
                raise RuntimeError(f"{what} failed in the vLLM worker: {status['last_error']}")
            if done(status):
                return status
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what}: the vLLM worker did not finish in time")
            time.sleep(POLL_S)

    def stage(self, ann: WeightAnnouncement, source: BucketSource, deadline: float) -> None:
        """The worker receives into its staging copy while generation goes on: over its
        own channel when ``source`` reads from :meth:`remote_receiver`'s handle, else
        the buckets are read here and sent along (tests, benchmarks, small models)."""
        lora_lib.check_kind(ann.kind, ann.version, self.kind, "this vLLM engine")
        if isinstance(source, ReceiverSource) and isinstance(source.receiver, EngineChannel):
            self._stage_rpc(ann, None, deadline)
            return
        # read here and handed over by file: tensors inside collective_rpc arguments
        # reach vLLM 0.32's workers as nested lists, and the engine core is on this host
        from safetensors.torch import save_file

        buckets = {}
        for i, b in enumerate(ann.buckets):
            buckets[f"b{i}"] = torch.empty(b.numel, dtype=getattr(torch, ann.dtype))
            source.fetch(i, buckets[f"b{i}"], deadline)
        with tempfile.TemporaryDirectory(prefix="nonstop-stage-") as tmp:
            path = os.path.join(tmp, "buckets.safetensors")
            save_file(buckets, path)
            self._stage_rpc(
                ann, {"factory": "pipeline.transfer:file_source", "path": path}, deadline
            )

    def _stage_rpc(self, ann: WeightAnnouncement, spec: dict | None, deadline: float) -> None:
        """Ask the worker to stage ``ann`` from ``spec`` (None: its channel) and wait."""
        failed = self.rpc("nonstop_poll", [], False)["failed"]
        self.rpc("nonstop_update", encode(ann), spec, False)
        if int(self.settings.tensor_parallel_size) > 1:  # each bucket's broadcast asked for
            relay_buckets(
                ann,
                lambda: self.rpc("nonstop_poll", [], False),
                lambda method, *args: self.rpc(method, *args),
                failed,
                deadline,
            )
        self._wait_worker(
            lambda s: s["busy"] == 0 and s["staged_version"] == ann.version,
            f"staging version {ann.version}",
            failed,
            deadline,
        )

    def swap(self, version: int) -> None:
        """Install the staged ``version``: under the per-forward lock (lock) or with the
        engine paused (pause). On failure the old version keeps generating."""
        failed = self.rpc("nonstop_poll", [], False)["failed"]
        self._transition = True
        try:
            if self.update_mode == "pause":
                self._swap_paused(version)
            else:
                self.rpc("nonstop_swap", version)
                deadline = time.monotonic() + float(self.settings.lock_timeout_s) + 30
                status = self._wait_worker(
                    lambda s: s["busy"] == 0 and s["live_version"] == version,
                    f"swap to version {version}",
                    failed,
                    deadline,
                )
                for rec in status["swaps"]:  # the lock hold, as the worker measured it
                    t0 = time.perf_counter() - rec["hold_ms"] / 1000
                    self.stats.add_swap(t0, rec["version"], "staged")
            self.version = version
            self._swaps_done += 1
            self.stats.new_version()
        finally:
            self._transition = False

    def _swap_paused(self, version: int) -> None:
        t0 = time.perf_counter()  # the whole pause is the stall
        try:
            self._call(
                self.llm.pause_generation(mode="keep", clear_cache=False), self.rpc_timeout_s
            )
            self.rpc("nonstop_swap_paused", version)
        finally:
            self._call(self.llm.resume_generation(), self.rpc_timeout_s)
            self.rpc("nonstop_poll", [])  # drop the worker's swap record: counted here
        self.stats.add_swap(t0, version, "pause")

    def update_in_place(
        self, ann: WeightAnnouncement, source: BucketSource, deadline: float
    ) -> None:
        raise ValueError(
            "sampling.weight_staging=false is for actor.engine=hf; the vllm engine always "
            "receives into a staging copy (set sampling.weight_staging=true)"
        )
