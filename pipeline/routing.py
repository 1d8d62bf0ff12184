"""Keep Routing for mixture-of-experts models: which experts each token went to.

``sampling.keep_routing`` records, at sampling time, the top-k expert ids of every token
the engine feeds forward at every MoE layer, and the trainer forces those ids in its
forward (recomputing the gate weights from the live router logits at them, so the router
still gets its gradient). This module is the shared part: finding a model's routers,
the array layout on the wire, capturing routes from a transformers forward, and
replaying them (:func:`replay`, :class:`Replayer`) in the trainer's forward.

Layout (one sample): ``[rows, moe layers, k]``, ids ascending within each row, uint8
when the model has at most 256 experts, else uint16; ``rows`` = prompt + completion ids
less the last completion id (never fed forward). Rows are in sequence order, so row ``t``
is the routing of token ``t`` of ``prompt + completion``.

Supported routers (transformers 5): the ``*TopKRouter`` modules of Qwen3-MoE, OLMoE and
Mixtral (``gate`` of each sparse MoE block), which return ``(logits, scores, indices)``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

ROUTER_CLASSES = ("Qwen3MoeTopKRouter", "OlmoeTopKRouter", "MixtralTopKRouter")


@dataclass(frozen=True)
class RouteLayout:
    """What every sample's routes of one model hold: MoE layers, experts per token, experts."""

    layers: int
    k: int
    experts: int

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(np.uint8 if self.experts <= 256 else "<u2")

    def as_list(self) -> list[int]:
        return [self.layers, self.k, self.experts]

    @classmethod
    def from_list(cls, values: list[int]) -> RouteLayout:
        if len(values) != 3 or min(values) <= 0 or values[1] > values[2]:
            raise ValueError(
                f"route_layout {values}: give [moe layers, k, experts], all positive, k <= experts"
            )
        return cls(*map(int, values))

    def pack(self, rows: np.ndarray) -> bytes:
        """[rows, layers, k] ids -> wire bytes (sorted per row, the layout's dtype)."""
        rows = np.asarray(rows)
        if rows.ndim != 3 or rows.shape[1:] != (self.layers, self.k):
            raise ValueError(f"routes of shape {rows.shape}: need [rows, {self.layers}, {self.k}]")
        return np.sort(rows, axis=-1).astype(self.dtype).tobytes()

    def unpack(self, data: bytes) -> np.ndarray:
        """Wire bytes -> [rows, layers, k] (a read-only view); ValueError if ragged."""
        per_row = self.layers * self.k * self.dtype.itemsize
        if len(data) % per_row:
            raise ValueError(
                f"routes of {len(data)} bytes are not whole rows of {self.layers} layers x "
                f"{self.k} ids ({per_row} bytes)"
            )
        return np.frombuffer(data, dtype=self.dtype).reshape(-1, self.layers, self.k)


def moe_routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's top-k routers in layer order (empty for a dense model)."""
    return [m for m in model.modules() if type(m).__name__ in ROUTER_CLASSES]


def is_moe(model_or_config) -> bool:
    """Whether a model (or its HF config) routes tokens to experts."""
    if isinstance(model_or_config, torch.nn.Module):
        return bool(moe_routers(model_or_config))
    cfg = model_or_config
    return bool(getattr(cfg, "num_experts", 0) or getattr(cfg, "num_local_experts", 0))


def layout_of(model: torch.nn.Module) -> RouteLayout:
    """The route layout of a MoE model; ValueError naming the fix for a dense one."""
    routers = moe_routers(model)
    if not routers:
        raise ValueError(
            f"{type(model).__name__} has no mixture-of-experts router "
            f"({', '.join(ROUTER_CLASSES)}): "
            "sampling.keep_routing applies to MoE models only; set sampling.keep_routing=false"
        )
    return RouteLayout(len(routers), int(routers[0].top_k), int(routers[0].num_experts))


@contextlib.contextmanager
def capture(model: torch.nn.Module, on_device: bool = False) -> Iterator[list[list[torch.Tensor]]]:
    """Record the top-k ids every router picks during the forwards inside the block.

    Yields a list with one list per forward call; each holds one ``[tokens, k]`` tensor
    per MoE layer (tokens flattened batch-major, as the router sees them): int64 on the
    host, or with ``on_device`` int32 where the router ran (no host sync per layer per
    forward: the hf engine moves them once per generate). Use :func:`stack_forward` to
    turn one forward's record into ``[batch, seq, layers, k]``.
    """
    routers = moe_routers(model)
    calls: list[list[torch.Tensor]] = []
    first = routers[0] if routers else None

    def hook(module, _inputs, output):
        if module is first:
            calls.append([])
        ids = output[2].detach()
        calls[-1].append(ids.to(torch.int32) if on_device else ids.to("cpu", torch.int64))

    handles = [r.register_forward_hook(hook) for r in routers]
    try:
        yield calls
    finally:
        for h in handles:
            h.remove()


def stack_forward(layers: list[torch.Tensor], batch: int) -> np.ndarray:
    """One forward's per-layer ``[batch * seq, k]`` ids -> ``[batch, seq, layers, k]``,
    ids ascending per row."""
    ids = torch.stack(layers, dim=1)  # [batch * seq, layers, k]
    ids = ids.reshape(batch, -1, *ids.shape[1:])
    return np.sort(ids.numpy(), axis=-1)


def joined_routes(group) -> list[bytes]:
    """Each sample's routes over all its rows (prompt + completion - 1) of a RolloutGroup
    (pipeline/messages.py): the group's shared ``prompt_routes`` joined to every sample's
    completion rows (the bytes concatenate: same layout, rows in sequence order)."""
    return [group.prompt_routes + s.routes for s in group.samples]


def moe_blocks(model: torch.nn.Module) -> list[type]:
    """The classes of the sparse MoE blocks that hold the model's routers (as ``gate``):
    the modules DeepSpeed ZeRO-3 must treat as leaves (their expert loop touches only the
    experts some token was routed to, so ranks would fetch different parameters)."""
    routers = set(map(id, moe_routers(model)))
    found: list[type] = []
    for m in model.modules():
        gate = getattr(m, "gate", None)
        if gate is not None and id(gate) in routers and type(m) not in found:
            found.append(type(m))
    return found


@dataclass
class RouteStats:
    """How far the live router is from the replayed routes, over the valid rows of the last
    forward: (token, layer) pairs whose live top-k set differs from the recorded one, and
    tokens with any such layer."""

    pairs_differ: int = 0
    pairs: int = 0
    tokens_differ: int = 0
    tokens: int = 0

    @property
    def mismatch(self) -> float:
        return self.pairs_differ / self.pairs if self.pairs else 0.0

    @property
    def mismatch_tokens(self) -> float:
        return self.tokens_differ / self.tokens if self.tokens else 0.0


def _gate_weights(router: torch.nn.Module, logits: torch.Tensor, ids: torch.Tensor):
    """The router's own gate weights at ``ids``: its softmax of the live logits gathered
    there, renormalised and cast exactly as its class's forward does (transformers 5)."""
    if type(router).__name__ == "MixtralTopKRouter":
        probs = torch.nn.functional.softmax(logits.float(), dim=-1)
        top = probs.gather(-1, ids)
        return top / top.sum(dim=-1, keepdim=True)  # always renormalised, kept in fp32
    probs = torch.nn.functional.softmax(logits, dtype=torch.float, dim=-1)
    top = probs.gather(-1, ids)
    if router.norm_topk_prob:
        top = top / top.sum(dim=-1, keepdim=True)
    return top.to(logits.dtype)


class Replayer:
    """Forces recorded routes on a model's routers while attached.

    :meth:`attach` hooks every router once; :meth:`use` sets the routes of the next
    forwards (``routes`` [B, T, layers, k] long, ``valid`` [B, T] bool); :meth:`free`
    lets the routers pick live again; :meth:`close` removes the hooks. The mapping from
    router to routes is fixed by layer, so a recompute (gradient checkpointing in the
    backward, which must happen before the next :meth:`use`) sees the same routes, and
    the per-layer mismatch is overwritten, not added, by it. Only the router's output is
    touched (its logits stay differentiable), so it works inside DeepSpeed ZeRO-3 too.
    """

    def __init__(self) -> None:
        self.handles: list = []
        self.layers = 0
        self.routes: torch.Tensor | None = None
        self.valid: torch.Tensor | None = None
        self._differ: dict[int, torch.Tensor] = {}
        self._tokens = 0

    def attach(self, model: torch.nn.Module) -> Replayer:
        if self.handles:
            return self
        routers = moe_routers(model)
        if not routers:
            layout_of(model)  # the ValueError naming the fix
        self.layers = len(routers)
        for layer, router in enumerate(routers):
            self.handles.append(router.register_forward_hook(self._hook(layer)))
        return self

    def use(self, routes: torch.Tensor, valid: torch.Tensor) -> None:
        if routes.dim() != 4 or routes.shape[2] != self.layers or valid.shape != routes.shape[:2]:
            raise ValueError(
                f"routes of shape {tuple(routes.shape)} with valid {tuple(valid.shape)}: need "
                f"[batch, seq, {self.layers} moe layers, k] and a [batch, seq] mask"
            )
        self.routes, self.valid, self._differ = routes.long(), valid.bool(), {}
        self._tokens = int(self.valid.sum())

    def free(self) -> None:
        self.routes = self.valid = None

    def close(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles, self.routes, self.valid = [], None, None

    def stats(self) -> RouteStats:
        """Mismatch over the valid rows of the last forward under :meth:`use` (still
        readable after :meth:`free` and :meth:`close`)."""
        if not self._differ:
            return RouteStats()
        tokens = self._tokens
        differ = torch.stack([self._differ[k] for k in sorted(self._differ)])  # [L, N]
        return RouteStats(
            pairs_differ=int(differ.sum()),
            pairs=tokens * len(self._differ),
            tokens_differ=int(differ.any(dim=0).sum()),
            tokens=tokens,
        )

    def _hook(self, layer: int):
        def hook(module, _inputs, output):
            if self.routes is None:
                return None
            logits, _scores, live = output
            k = live.shape[-1]
            recorded = self.routes[:, :, layer, :].reshape(-1, k).to(live.device)
            valid = self.valid.reshape(-1).to(live.device)
            if recorded.shape[0] != live.shape[0] or self.routes.shape[-1] != k:
                raise ValueError(
                    f"replayed routes cover {recorded.shape[0]} tokens x "
                    f"{self.routes.shape[-1]} experts but MoE layer {layer} routed "
                    f"{live.shape[0]} tokens x {k}: give routes of the forward's "
                    "[batch, seq] shape and the model's top-k"
                )
            same = (live.sort(dim=-1).values == recorded.sort(dim=-1).values).all(dim=-1)
            differ = valid & ~same
            self._differ[layer] = differ.detach()
            # rows that agree keep the live order, so the output is bit-identical there
            ids = torch.where(differ[:, None], recorded, live)
            return logits, _gate_weights(module, logits, ids), ids

        return hook


@contextlib.contextmanager
def replay(model: torch.nn.Module, routes: torch.Tensor, valid: torch.Tensor) -> Iterator[Replayer]:
    """Make every router of ``model`` route to ``routes`` ([B, T, layers, k] long ids)
    where ``valid`` ([B, T] bool) and pick live elsewhere, inside the block.

    The gate weights are the router's own softmax of its live logits gathered at the
    replayed ids (renormalised as its class does), so the router still gets its gradient.
    Yields the :class:`Replayer`; ``.stats()`` gives the mismatch of the last forward.
    Run the backward inside the block when gradient checkpointing recomputes the forward.
    """
    replayer = Replayer().attach(model)
    replayer.use(routes, valid)
    try:
        yield replayer
    finally:
        replayer.close()


# --- DeepSpeed AutoEP's router (trainer.expert_parallel) ---------------------------------
#
# Under trainer.expert_parallel, DeepSpeed AutoEP replaces every MoE block with an
# ``AutoEPMoELayer`` whose router is a ``TokenChoiceTopKRouter`` (``layer.router``, also
# reachable as ``layer.gate``): ``forward(x [tokens, hidden], expert_bias)`` returns
# ``(top_scores [tokens, k] float32, selected_experts [tokens, k], tokens_per_expert
# [experts] int32)``; the layer sends each token to the ranks of ``selected_experts`` and
# weights their outputs by ``top_scores``. So Keep Routing under AutoEP is a router
# forward with ``selected_experts`` given: the scores from the live gate at those ids.

AUTOEP_ROUTER_CLASS = "TokenChoiceTopKRouter"


def autoep_routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """AutoEP's routers in layer order (empty without trainer.expert_parallel)."""
    return [m for m in model.modules() if type(m).__name__ == AUTOEP_ROUTER_CLASS]


def autoep_forced_route(router: torch.nn.Module, x: torch.Tensor, ids: torch.Tensor) -> tuple:
    """``router(x)`` with the experts ``ids`` [tokens, k] forced: the router's own output
    triple, the weights recomputed from its live gate at those ids (so the gate still
    gets its gradient). Follows DeepSpeed 0.19.8's ``TokenChoiceTopKRouter.forward``;
    group-limited routing (DeepSeek) only restricts the choice, which ``ids`` replaces."""
    if ids.shape != (x.shape[0], router.top_k):
        raise ValueError(
            f"forced routes of shape {tuple(ids.shape)}: the router sees {x.shape[0]} tokens "
            f"and picks {router.top_k} experts each"
        )
    ids = ids.to(x.device, torch.int64)
    if int(ids.min()) < 0 or int(ids.max()) >= router.num_experts:
        raise ValueError(f"forced expert ids outside 0..{router.num_experts - 1}")
    logits = router.gate(x).to(torch.float32)
    if router.score_func == "softmax":
        scores = torch.softmax(logits, dim=1)
    elif router.score_func == "sigmoid":
        scores = torch.sigmoid(logits)
    else:
        raise ValueError(
            f"AutoEP router score_func {router.score_func!r}: forced routes are built for "
            "'softmax' and 'sigmoid' routers only; use sampling.keep_routing=false with it"
        )
    top = scores.gather(1, ids)
    if router.route_norm:
        top = top / (top.sum(dim=-1, keepdim=True) + 1e-20)
    top = top * router.route_scale
    counts = torch.zeros(router.num_experts, dtype=torch.int32, device=x.device)
    counts.scatter_add_(
        0, ids.reshape(-1), torch.ones(ids.numel(), dtype=torch.int32, device=x.device)
    )
    return top, ids, counts


@contextlib.contextmanager
def force_autoep_routes(model: torch.nn.Module, routes: list[torch.Tensor]) -> Iterator[None]:
    """Inside the block, each AutoEP router (layer order) routes its forward's tokens to
    ``routes[layer]`` ([tokens, k], tokens flattened batch-major as the router sees them;
    this rank's tokens only). One forward per entry: a second forward needs new routes."""
    routers = autoep_routers(model)
    if len(routes) != len(routers):
        raise ValueError(f"{len(routes)} layers of routes for {len(routers)} AutoEP routers")

    def forced(router, ids):
        def forward(x, expert_bias=None):
            return autoep_forced_route(router, x, ids)

        return forward

    for router, ids in zip(routers, routes, strict=True):
        router.forward = forced(router, ids)
    try:
        yield
    finally:
        for router in routers:
            del router.forward
