"""The vLLM worker extension: a per-forward-pass lock, a staged receive while the
engine generates, and the swap between two forward passes.

Loaded by vLLM (0.24 on CUDA, 0.32 on the CPU) in its engine-core process through
``worker_extension_cls="actor.engines.vllm.worker.extension.NonstopWorkerExtension"``:
vLLM's ``WorkerWrapperBase.init_worker`` asserts that the Worker class has none of
this class's attributes, then appends this class to ``Worker.__bases__`` (the Worker's
own methods come first; ``self`` is the Worker). Our names start with ``nonstop_`` or
``_nonstop`` so they never clash (and ``destroy_worker_extension``, the hook vLLM 0.33
calls at shutdown; no Worker of 0.24 or 0.32 has it); ``execute_model`` /
``sample_tokens`` are wrapped per instance at install, never overridden in the class::

    actor process (client)                    engine core (this module)
    collective_rpc("nonstop_install")   -->   wrap execute_model / sample_tokens with the
                                              lock; staging = copy of the live parameters
    collective_rpc("nonstop_update",    -->   a background thread receives the buckets on
                   announcement, source)      a side stream, one bucket in flight at a time,
                                              checks each bucket's sum, scatters it into
                                              staging (worker/layout.py), then takes
                                              the lock (with a deadline) and enqueues
                                              staging -> parameters on the engine's stream
    collective_rpc("nonstop_update",    -->   stage only (the engine interface's stage());
                   ..., swap=False)           then "nonstop_swap" (lock mode: the same
                                              locked swap, queued) or, with the engine
                                              paused, "nonstop_swap_paused" (pause mode)
    collective_rpc("nonstop_poll", ids) -->   live and staged version, swaps, errors,
                                              per request the versions of the steps that
                                              sampled it (with keep_routing its experts'
                                              rows, worker/routes.py), and the added gap
                                              around each swap a step has followed since
                                              the last poll
    collective_rpc("nonstop_connect",   -->   returns at once; the receiver thread opens
                   transport, rdv, nonce)     the channel (the handshake waits for the
                                              trainer); the poll's ``channel`` says how

The lock is taken on entry of ``execute_model`` and released on exit of the
matching ``sample_tokens`` (model runner V2 computes the logits there), so no
swap falls between a forward pass and the logits computed from it. The copy is
only enqueued under the lock; pointers never change, so CUDA graphs read the new
weights. A failed, partial or mis-summed receive never touches the parameters; a
lock not had within ``lock_timeout_s`` fails the update with an error and the
engine keeps generating on the old version. The recipe and its H100 numbers:
actor/engines/vllm/RECIPE_H100.md and RECIPE_H100_results.md.

With ``model.lora`` (``nonstop_install(..., lora={"dir", "request"})``) the base
weights never change and no staging copy of them is made: announcements must say
``kind="lora"``; the buckets (peft-named adapter tensors) are received and checked the
same way, built into a vLLM LoRAModel outside the lock (``AdapterSwap.stage``,
actor/engines/vllm/lora_client.py), and the adapter's GPU slot is rewritten under the same
lock, deadline and version bookkeeping (``AdapterSwap.swap``). An announcement of the
other kind fails the update, saying which ``model.lora`` setting differs.

With ``tensor_parallel_size`` > 1 every worker gets every call; rank 0 receives, each
bucket is broadcast to the other ranks by ``nonstop_broadcast`` on the engine thread,
and the swap is issued from ``nonstop_swap`` itself, both in the order vLLM delivers
calls to all workers (tp.py). The lock, staging and swap live in locked.py
(``LockedWeights``), the per-step versions in steps.py (all in this folder).

Everything except the vLLM Worker it is mixed into is plain torch, so the lock,
staging, scatter and swap are tested on the CPU with a fake worker.
"""

from __future__ import annotations

import importlib
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from actor.engines.vllm.worker.locked import LockedWeights
from actor.engines.vllm.worker.steps import StepVersions  # noqa: F401 (re-exported for tests)
from actor.engines.vllm.worker.tp import TPRelay, broadcast_bucket, tp_of, weights_group
from pipeline.messages import WeightAnnouncement, decode
from pipeline.transfer.base import BucketSource

log = logging.getLogger(__name__)


def import_path(path: str) -> Any:
    """The object ``module:name`` names."""
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


def check_unquantized_worker(worker: Any) -> None:
    """Refuse a quantized model in one line: its parameters are vLLM's processed form
    (FP8 scales, AWQ/GPTQ packed ints), which a trainer's bf16 tensors cannot be
    copied into (the client refuses the checkpoint before start: client.py
    check_unquantized; this catches what it cannot read, e.g. a hub name)."""
    model_config = getattr(worker, "model_config", None)
    quant = getattr(model_config, "quantization", None)
    if quant:
        raise ValueError(
            f"the model is quantized ({quant}): the vllm engine swaps unquantized weights "
            "only; use an unquantized (bf16/fp16/fp32) checkpoint for actor.engine=vllm"
        )


def install_routes(worker: Any) -> tuple[Any, Any, dict]:
    """keep_routing: (our route recorder, the runner's request order of each step, what
    the client needs: ``layout`` [moe layers, k, experts], ``moe_layers`` (their layer
    ids), ``via``). Where vLLM itself returns routed experts
    (``enable_return_routed_experts``, set by the client on CUDA: model runner V2) the
    worker installs nothing (``via="vllm"``: the rows come with each RequestOutput);
    otherwise our capture on every MoE layer's router on the V1 runner (worker/routes.py,
    ``via="worker"``: the rows come with the poll)."""
    from actor.engines.vllm.worker.routes import StepRoutes, moe_runners

    cfg = worker.vllm_config
    model = worker.get_model()
    runners = moe_runners(model)
    experts = int(cfg.model_config.get_num_experts())
    k = int(cfg.model_config.get_num_experts_per_tok())
    info = {
        "layout": [len(runners), k, experts],
        "moe_layers": [int(r.layer_id) for r in runners],
        "via": "worker",
    }
    aux = getattr(cfg, "aux_output_config", None)
    if getattr(aux, "enable_return_routed_experts", False):
        return None, None, {**info, "via": "vllm"}
    runner = getattr(worker, "model_runner", None)
    batch = getattr(runner, "input_batch", None)
    if batch is None or not hasattr(batch, "req_ids"):
        raise ValueError(
            f"sampling.keep_routing: this vLLM's model runner ({type(runner).__name__}) has "
            "no V1 input batch to split the routes by request, and vLLM's own "
            "enable_return_routed_experts is off; use a vLLM that has it (CUDA, model "
            "runner V2) or set sampling.keep_routing=false"
        )
    routes = StepRoutes(model, int(cfg.scheduler_config.max_num_batched_tokens), experts)

    def order() -> list:
        return list(runner.input_batch.req_ids[: runner.input_batch.num_reqs])

    return routes, order, info


def load_source(spec: dict) -> BucketSource:
    """``spec["factory"]`` is ``module:function``; it gets the rest of ``spec``."""
    factory: Callable[..., BucketSource] = import_path(spec["factory"])
    return factory(**{k: v for k, v in spec.items() if k != "factory"})


class NonstopWorkerExtension:
    """Mixed into vLLM's Worker; driven by the actor through ``collective_rpc``."""

    def nonstop_install(
        self,
        lock_timeout_s: float = 10.0,
        transfer_timeout_s: float = 60.0,
        lora: dict | None = None,
        keep_routing: bool = False,
    ) -> dict:
        """Wrap the steps with the lock and start the receiver thread. ``lora``
        (``model.lora``): ``{"dir": the version-0 adapter folder, "request": the
        LoRARequest class as module:name}``; versions are then adapters.
        ``keep_routing`` (``sampling.keep_routing``): record every token's experts at
        every MoE layer on the V1 runner (worker/routes.py); ValueError for a model
        without MoE layers, or a runner that does not lay its batch out as V1 does."""
        if getattr(self, "_nonstop", None) is not None:
            return self._nonstop_info
        adapter = None
        if lora is not None:
            from actor.engines.vllm.worker.adapter_swap import AdapterSwap

            adapter = AdapterSwap(self, lora["dir"], import_path(lora["request"]))
        check_unquantized_worker(self)
        named = list(self.get_model().named_parameters())
        tp = tp_of(self)
        util = getattr(getattr(self, "cache_config", None), "gpu_memory_utilization", None)
        w = LockedWeights(named, lock_timeout_s, adapter, tp, self.get_model(), util)
        routing = None
        if keep_routing:
            w.routes, w.batch_order, routing = install_routes(self)
        w.wrap(self)
        self._nonstop, self._nonstop_timeout = w, transfer_timeout_s
        self._nonstop_group = (  # TP > 1: the weights-only group (every rank at once)
            weights_group(tp[1], w.device, transfer_timeout_s) if tp[1] > 1 else None
        )
        self._nonstop_jobs: queue.Queue = queue.Queue()
        threading.Thread(target=self._nonstop_loop, name="nonstop-receiver", daemon=True).start()
        self._nonstop_info = {
            "params": len(named),
            "kind": w.kind,
            "bytes": int(w.staging.numel()) if w.staging is not None else 0,
            "device": str(w.device),
            "compute_stream": str(w.compute),
            "install_stream": getattr(w.install_stream, "cuda_stream", None),
            "tp_rank": tp[0],
            "tp_size": tp[1],
            "routing": routing,  # keep_routing: layout, MoE layer ids, who captures
        }
        return self._nonstop_info

    def destroy_worker_extension(self) -> None:
        """Tear down what install made: the receiver thread, the transfer channel, the
        TP weights group, staging. vLLM 0.33 calls this hook (by this name, on the
        class, with the Worker) at shutdown; the client calls it on every version
        before shutting the engine down. Safe to call twice."""
        w = getattr(self, "_nonstop", None)
        if w is None:
            return
        self._nonstop_jobs.put(("stop", None, None))
        self.nonstop_disconnect()
        group, self._nonstop_group = getattr(self, "_nonstop_group", None), None
        if group is not None:
            import torch.distributed as dist

            dist.destroy_process_group(group)
        w.staging, w.views, w.by_name, w._prepared = None, [], {}, None
        self._nonstop_torn_down = True

    def nonstop_connect(self, transport: str, rendezvous: dict, nonce: str) -> None:
        """Open this worker's channel of ``weights.transport`` for a signed join (the
        actor process did the Redis side: read the rendezvous, XADD the join). Returns
        at once: the handshake (which waits for the trainer to accept, up to
        ``transfer_timeout_s``) runs on the receiver thread, never on the engine's loop,
        where it would stop every step. Poll ``channel`` for this nonce's outcome."""
        if self._nonstop.tp_rank != 0:
            return  # TP rank 0 receives and broadcasts to the others (tp.py)
        self._nonstop_channel = {"nonce": nonce, "state": "connecting", "error": ""}
        self._nonstop_jobs.put(("connect", (transport, rendezvous, nonce), None))

    def _nonstop_open(self, transport: str, rendezvous: dict, nonce: str) -> None:
        """The receiver thread's half of nonstop_connect."""
        from pipeline.transfer import make_receiver

        old, self._nonstop_receiver = getattr(self, "_nonstop_receiver", None), None
        if old is not None:
            old.close()
        try:
            receiver = make_receiver(transport, self._nonstop_timeout)
            receiver.connect(rendezvous, nonce, time.monotonic() + self._nonstop_timeout)
        except Exception as e:
            self._nonstop_channel = {"nonce": nonce, "state": "failed", "error": str(e)}
            log.error("transfer channel %s (join %s) not opened: %s", transport, nonce, e)
            return
        self._nonstop_receiver = receiver
        self._nonstop_channel = {"nonce": nonce, "state": "connected", "error": ""}

    def nonstop_disconnect(self) -> None:
        """Close this worker's transfer channel (the actor rejoins with a new one)."""
        receiver, self._nonstop_receiver = getattr(self, "_nonstop_receiver", None), None
        if receiver is not None:
            receiver.close()

    def nonstop_update(
        self, announcement: bytes, source: dict | None = None, swap: bool = True
    ) -> None:
        """Queue one version: receive into staging while generating, then (``swap``)
        swap. ``source`` names a BucketSource factory (tests, in-memory buckets);
        default: the connected channel. Returns at once: poll for the outcome."""
        ann = decode(announcement, WeightAnnouncement)
        w = self._nonstop
        if w.tp_size > 1:  # made here, so the next poll already shows this staging's relay
            self._nonstop_relay = TPRelay(ann.version, self._nonstop_group, w.tp_rank, w.device)
        self._nonstop_jobs.put(("update" if swap else "stage", ann, source))

    def nonstop_swap(self, version: int) -> None:
        """Queue the locked swap of the staged ``version`` (lock mode). Never waits for
        the lock here: this runs on the engine thread, which may hold it between a step's
        execute_model and sample_tokens. Returns at once: poll for the outcome.
        TP > 1: swapped between the same two steps on every rank, from right here
        (LockedWeights.swap_between_steps, actor/engines/vllm/worker/tp.py)."""
        w = self._nonstop
        if w.tp_size == 1:
            self._nonstop_jobs.put(("swap", version, None))
            return
        try:
            w.swap_between_steps(version)
        except Exception as e:
            w.failed += 1
            w.last_error = f"version {version}: {e}"

    def nonstop_swap_paused(self, version: int) -> dict:
        """Pause mode: the engine is paused (no step runs), so swap right here on the
        engine thread and wait for the copy; raises if ``version`` is not staged."""
        w = self._nonstop
        if self._nonstop_jobs.unfinished_tasks:
            raise RuntimeError(f"version {version}: a receive is still running; poll first")
        try:
            return w.swap(version)
        except Exception as e:
            w.failed += 1
            w.last_error = f"version {version}: {e}"
            raise

    def nonstop_engine_stream(self) -> dict:
        """The CUDA streams (handles) at install, at the last step's execute_model entry,
        and of the last swap's copy (None on the CPU): the gpu tests check that the copy
        went on the stream the steps run on."""
        w = self._nonstop

        def handle(stream):
            return getattr(stream, "cuda_stream", None)

        return {
            "install": handle(w.install_stream),
            "last_step": handle(w.compute),
            "last_swap": w.swaps[-1]["stream"] if w.swaps else w.last_swap_stream,
        }

    def nonstop_poll(self, request_ids: list[str] | None = None, take_swaps: bool = True) -> dict:
        """The worker's state; ``take_swaps``: hand over (and forget) the swap records."""
        w = self._nonstop
        swaps = list(w.swaps)
        if take_swaps:
            w.swaps.clear()
        return {
            "live_version": w.live_version,
            "staged_version": w.staged_version,
            "swaps": swaps,
            "failed": w.failed,
            "last_error": w.last_error,
            "busy": self._nonstop_jobs.unfinished_tasks,
            "orphan_holds": w.orphans,
            "tp_rank": w.tp_rank,
            "channel": getattr(self, "_nonstop_channel", None),
            "step_records": w.steps.sizes(),
            "preemption": {"preempted": w.steps.preempted, "resumed": w.steps.resumed},
            "versions": w.steps.take(request_ids or []),
            "routes": w.routes.take(request_ids or []) if w.routes is not None else {},
            "gaps": w.take_gaps(),  # always handed over: the client adds each to its stats
            "tp_ready": self._nonstop_ready(),
        }

    def _nonstop_ready(self) -> dict | None:
        """TP > 1: the bucket this rank's receiver thread waits at (tp.py TPRelay)."""
        relay = getattr(self, "_nonstop_relay", None)
        return None if relay is None else {"version": relay.version, "index": relay.ready}

    def nonstop_broadcast(self, version: int, index: int, numel: int, dtype: str) -> None:
        """TP > 1: bucket ``index`` of ``version`` from rank 0 to every rank, here on the
        engine thread (in vLLM's order of calls and steps, the same on every rank:
        tp.py). Every rank takes part whatever its state, so the ranks' collectives always
        match; a failure is recorded (poll), never raised into the engine."""
        w = self._nonstop
        relay = getattr(self, "_nonstop_relay", None)
        try:
            if relay is not None and relay.version == version:
                relay.broadcast(index, numel, getattr(torch, dtype))
            else:  # this rank never started the version: take part, then say so
                scratch = torch.empty(numel, dtype=getattr(torch, dtype), device=w.device)
                broadcast_bucket(self._nonstop_group, w.device, index, scratch, False)
                raise RuntimeError(f"TP rank {w.tp_rank} is not staging version {version}")
        except Exception as e:
            w.failed += 1
            w.last_error = f"version {version}: {e}"
            log.error("TP broadcast of bucket %d of version %d failed: %s", index, version, e)
            if relay is not None and relay.version == version:
                relay.abort(f"the broadcast of bucket {index} failed: {e}")

    def nonstop_abort_stage(self, version: int, reason: str) -> None:
        """TP > 1: give ``version`` up on this rank (the client saw it fail on another):
        its receiver thread stops waiting for broadcasts and fails the version."""
        relay = getattr(self, "_nonstop_relay", None)
        if relay is not None and relay.version == version:
            relay.abort(reason)

    def _nonstop_source(self, ann: WeightAnnouncement, spec: dict | None) -> BucketSource:
        """Where the buckets come from: ``spec`` or the channel; TP > 1: rank 0 reads
        that and broadcasts, the other ranks receive the broadcast."""
        w = self._nonstop
        inner = None
        if w.tp_rank == 0 and spec is not None:
            inner = load_source(spec)
        elif w.tp_rank == 0:
            receiver = getattr(self, "_nonstop_receiver", None)
            if receiver is None:
                raise RuntimeError("no transfer channel: call nonstop_connect after joining")
            from pipeline.transfer import ReceiverSource

            inner = ReceiverSource(receiver, ann)
        if w.tp_size == 1:
            return inner
        relay = self._nonstop_relay  # nonstop_update's, for this announcement
        relay.inner = inner
        return relay

    def _nonstop_loop(self) -> None:
        w = self._nonstop
        if w.cuda:
            torch.cuda.set_device(w.device)
        while True:
            kind, job, spec = self._nonstop_jobs.get()
            if kind == "stop":  # destroy_worker_extension
                self._nonstop_jobs.task_done()
                return
            if kind == "connect":
                try:
                    self._nonstop_open(*job)
                finally:
                    self._nonstop_jobs.task_done()
                continue
            version = job if kind == "swap" else job.version
            try:
                if kind == "update" and w.tp_size > 1:
                    raise RuntimeError("with tensor parallelism swaps come by nonstop_swap")
                if kind in ("update", "stage"):
                    deadline = time.monotonic() + self._nonstop_timeout
                    w.stage(job, self._nonstop_source(job, spec), deadline)
                if kind in ("update", "swap"):
                    w.swap(version)
            except Exception as e:  # the old weights stay whole; the client sees the error
                w.failed += 1
                w.last_error = f"version {version}: {e}"
                log.error("weight update failed, keeping version %d: %s", w.live_version, e)
            finally:
                self._nonstop_jobs.task_done()
