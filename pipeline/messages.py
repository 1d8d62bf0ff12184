"""The one wire schema: who sends what, as msgspec Structs, versioned, with typed decoders.

Every message a pool sends another through Redis is defined here, grouped by
direction. Each entry of a stream carries one encoded Struct in its ``data`` field
beside a few plain, readable fields (pipeline/streams/durable.py ``publish``)::

    direction                stream          Structs                        read by
    actor -> preprocessor    <run>:rollouts  RolloutGroup of Samples        preprocessors
    preprocessor -> trainer  <run>:batches   TrainBatch of Samples          trainer rank 0
    trainer -> actor         <run>:weights   WeightAnnouncement             every actor
                                             (of BucketSpec, ParamSpec)
    control and status       <run>:dead      the refused entry's payload    summary, inspect
                             <run>:stats     StatsEvent                     (no writer yet)

Not Structs, so not here: an actor's request to join the weight-transfer group
(``<run>:joins``, plain signed fields: actor/weight_receiver.py), the weight
buckets themselves (raw tensors over the transfer process group, laid out as the
announcement's BucketSpecs say), and the pools' status hashes (pipeline/telemetry.py).

Token ids, log-probs and per-token policy versions travel as packed
little-endian arrays (``bytes``), never as lists, and never through pickle.
Per-token versions are run-length encoded as (version, count) int32 pairs.

A Sample is an *episode*: ``completion_ids`` hold every id after the prompt (each
turn's sampled ids, and between turns the template's boundary ids and the
observation's ids), ``loss_mask`` is 1 exactly on the sampled ids, and the
per-sampled-token arrays (log-probs, versions, reference log-probs, token
advantages, sampling masks) hold one value per mask=1 id only; observation ids
carry none. A single-turn completion is the one-turn case, written without
``loss_mask`` / ``turn_offsets`` (every id sampled) and so as small as before::

    prompt | turn 0 sampled | boundary + observation | turn 1 sampled | ...
    mask:      1 1 1 1 1         0 0 0 0 0 0 0            1 1 1 1
    turn_offsets = [0, 12]   (where each run of mask=1 starts)
A payload that does not decode, carries an unknown field or another schema
version raises :class:`BadEntry` with the reason; one that decodes but whose
per-token arrays disagree fails its type's ``check()`` (:meth:`RolloutGroup.check`,
:meth:`TrainBatch.check`) with a BadEntry naming the sample, the field and what it
must hold. Either way the consumer moves the entry to the dead-letter stream and
goes on.
"""

from __future__ import annotations

import msgspec
import numpy as np

from pipeline.tasks import Problem

# 2: a Sample is an episode (loss_mask, turn_offsets, tool outcomes)
# 3: Keep Routing (Sample.routes / routes_exact, RolloutGroup and TrainBatch route_layout,
#    RolloutGroup.prompt_routes)
# 4: the episode journal holds per-write deltas (EpisodeDelta, field <k>:<n>), not each
#    episode's whole state (EpisodeState, field <k>)
# 4, kept on purpose: WeightAnnouncement.checksum_kind was added with a default, so an
#    announcement without it (an older trainer's) is still read, as "sum32"; an older
#    build refuses one with it (unknown field), naming the field. Bumping would have
#    refused every older entry of every stream for a change old entries survive.
SCHEMA_VERSION = 4
MAX_PAYLOAD_BYTES = 256 * 1024 * 1024


class BadEntry(ValueError):
    """A stream entry that cannot be used; the message says why."""


# ---------------------------------------------------------------- packed arrays


def pack_i32(values) -> bytes:
    return np.asarray(values, dtype="<i4").tobytes()


def unpack_i32(data: bytes) -> np.ndarray:
    if len(data) % 4:
        raise BadEntry(f"int32 array has {len(data)} bytes, not a multiple of 4")
    return np.frombuffer(data, dtype="<i4")


def pack_f32(values) -> bytes:
    return np.asarray(values, dtype="<f4").tobytes()


def unpack_f32(data: bytes) -> np.ndarray:
    if len(data) % 4:
        raise BadEntry(f"float32 array has {len(data)} bytes, not a multiple of 4")
    return np.frombuffer(data, dtype="<f4")


def rle_encode(versions) -> bytes:
    """[3, 3, 3, 4, 4] -> packed [3, 3, 4, 2] (version, run length) pairs."""
    v = np.asarray(versions, dtype=np.int64)
    if v.size == 0:
        return b""
    if v.min() < 0 or v.max() >= 2**31:
        raise ValueError(f"policy versions must lie in [0, 2**31), got {v.min()}..{v.max()}")
    starts = np.flatnonzero(np.r_[True, v[1:] != v[:-1]])
    counts = np.diff(np.r_[starts, v.size])
    return pack_i32(np.stack([v[starts], counts], axis=1).ravel())


def rle_decode(data: bytes) -> np.ndarray:
    pairs = unpack_i32(data)
    if pairs.size % 2:
        raise BadEntry("run-length versions must be (version, count) pairs")
    vals, counts = pairs[0::2], pairs[1::2]
    if (counts <= 0).any():
        raise BadEntry("run-length versions have a non-positive run length")
    return np.repeat(vals, counts).astype(np.int64)


def pack_mask(kept: list) -> tuple[bytes, bytes]:
    """Per-token kept-id arrays -> (concatenated ids, per-token counts), both int32."""
    if not kept:
        return b"", b""
    counts = [len(k) for k in kept]
    return pack_i32(np.concatenate([np.asarray(k) for k in kept])), pack_i32(counts)


def unpack_mask(ids: bytes, counts: bytes, n_tokens: int) -> list[np.ndarray] | None:
    if not ids and not counts:
        return None
    flat, per_token = unpack_i32(ids), unpack_i32(counts)
    if len(per_token) != n_tokens or (per_token <= 0).any() or per_token.sum() != len(flat):
        raise BadEntry(
            f"sampling mask has {len(per_token)} counts summing to {int(per_token.sum())} "
            f"for {n_tokens} tokens and {len(flat)} ids"
        )
    return np.split(flat, np.cumsum(per_token)[:-1])


# ---------------------------------------------------------------- routes (Keep Routing)


def _route_layout(
    where: str, layout: list[int], samples: list, where_of, rows_of, extra: bool = False
):
    """The RouteLayout of a group or batch whose samples may carry routes (None: no
    routes anywhere); BadEntry when the layout and the routes disagree or only some
    samples carry routes. ``rows_of(sample)``: the rows its routes must hold (a sample
    owing none, a one-id completion after prompt_routes, carries them empty);
    ``extra``: routes elsewhere (a group's prompt_routes)."""
    carrying = [bool(s.routes) or rows_of(s)[0] == 0 for s in samples]
    if not any(bool(s.routes) for s in samples) and not extra:
        carrying = [False] * len(samples)
    if not any(carrying) and not extra:
        if layout:
            raise BadEntry(
                f"{where} has route_layout {layout} but no sample carries routes: its writer "
                "sets route_layout only with routes (sampling.keep_routing)"
            )
        return None
    if not all(carrying):
        s = samples[carrying.index(False)] if any(carrying) else samples[0]
        raise BadEntry(
            f"{where_of(s)} has no routes while {'other samples' if any(carrying) else 'its group'}"
            " carry them: with sampling.keep_routing every sample carries routes (or none does)"
        )
    if not layout:
        raise BadEntry(
            f"{where} has routes but no route_layout: its writer must give "
            "[moe layers, k, experts] (pipeline/routing.py RouteLayout.as_list)"
        )
    from pipeline.routing import RouteLayout  # torch: only where routes travel

    try:
        return RouteLayout.from_list(list(layout))
    except ValueError as e:
        raise BadEntry(f"{where}: {e}") from None


def _check_routes(where: str, name: str, data: bytes, layout, rows: int, why: str) -> None:
    """One array of routes: whole rows of the layout, exactly ``rows`` of them, every
    id below the layout's experts, ids strictly ascending (distinct) within each row."""
    try:
        ids = layout.unpack(data)
    except ValueError as e:
        raise BadEntry(f"{where} {name}: {e}") from None
    if len(ids) != rows:
        raise BadEntry(
            f"{where} has {len(ids)} rows of {name} but needs {rows} ({why}): one row per "
            "token fed forward, the last completion id never is"
        )
    if not ids.size:
        return
    if int(ids.max()) >= layout.experts:
        row, layer, _ = np.argwhere(ids >= layout.experts)[0]
        raise BadEntry(
            f"{where} {name} row {row} layer {layer} routes to expert "
            f"{int(ids[row, layer].max())} but the model has {layout.experts} experts "
            f"(ids 0..{layout.experts - 1}): actors and trainer must load the same model"
        )
    if layout.k > 1:
        rising = np.diff(ids.astype(np.int32), axis=-1) > 0
        if not rising.all():
            row, layer, _ = np.argwhere(~rising)[0]
            raise BadEntry(
                f"{where} {name} row {row} layer {layer} holds {ids[row, layer].tolist()}: "
                f"each row holds {layout.k} distinct expert ids in ascending order "
                "(RouteLayout.pack sorts them; a repeated id is not a top-k)"
            )


# ---------------------------------------------------------------- actor -> preprocessor
# Stream <run>:rollouts, one RolloutGroup per entry (XADD-once on its group id; with
# redis.shards > 1 on each shard in turn). Written by each actor; read by the
# preprocessors (consumer group "preprocessor"), which call RolloutGroup.check() and
# dead-letter a group that fails it. Its Samples travel on to the trainer inside
# TrainBatches, with the preprocessor's fields set.


# What a turn's tool call came to (Sample.tool_outcomes): "" no call; "ok"; the
# failures the model sees as its observation: "malformed" (the call does not parse),
# "unknown_tool", "oversized" (output truncated to the token budget), "error" (the
# tool raised or its program failed), "timeout" (per-call wall clock), "budget" (the
# episode's tool calls or tool time are spent); "infra": the tool's infrastructure
# failed (its process died, the sandbox would not start): the episode is marked
# ``infra_failure`` and left out of its group's advantage statistics.
TOOL_OUTCOMES = (
    "",
    "ok",
    "malformed",
    "unknown_tool",
    "oversized",
    "error",
    "timeout",
    "budget",
    "infra",
)


def pack_u8(values) -> bytes:
    return np.asarray(values, dtype=np.uint8).tobytes()


class Sample(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, omit_defaults=True):
    """One episode of a task, as the actor produced it (a completion: its one-turn case).

    Fields left at their default are not encoded, so a single-turn sample without
    the optional arrays below is as small as it was before episodes.
    """

    index: int  # position inside its group: (group_id, index) names a sample
    completion_ids: bytes  # int32: every id after the prompt (sampled and observation)
    logprobs: bytes  # float32: log-prob of each sampled token under the sampling distribution
    versions: bytes  # int32 RLE pairs: policy version that produced each sampled token
    reward: float
    finished: bool  # ended with EOS rather than the token limit
    advantage: float = 0.0  # set by the preprocessor
    ref_logprobs: bytes = b""  # float32, set by the preprocessor
    # float32 per token, set by the preprocessor's dense scorers (steps, teacher);
    # when present the trainer uses it instead of the scalar ``advantage``
    token_advantages: bytes = b""
    # sampling.keep_sampling_mask: the vocabulary ids each token was sampled among
    # (top-k/top-p support), concatenated int32, and how many belong to each token
    mask_ids: bytes = b""
    mask_counts: bytes = b""
    # False: ``versions`` are lower bounds (the engine could not record each token's
    # version; staleness overstated, never understated), not exact per-token versions
    versions_exact: bool = True
    # episodes (several turns): uint8 per completion id, 1 exactly on sampled ids (empty:
    # every id sampled); int32 start of each turn's sampled run in completion_ids
    # (empty: one turn at 0); per turn one of TOOL_OUTCOMES (empty: no tool calls)
    loss_mask: bytes = b""
    turn_offsets: bytes = b""
    tool_outcomes: list[str] = msgspec.field(default_factory=list)
    # a tool's infrastructure failed in this episode: trained with advantage 0 and left
    # out of its group's advantage statistics (never scored as a wrong answer)
    infra_failure: bool = False
    # sampling.keep_routing (MoE models): the experts each token was routed to at every
    # MoE layer, prompt included, as pipeline/routing.py lays them out: uint8 (uint16 when
    # the model has more than 256 experts), [rows, moe layers, k], ids ascending per row.
    # Rows: every id the engine fed forward, i.e. prompt + completion ids less the last
    # completion id; only the completion's rows (from the first completion id) when the
    # group carries its prompt's rows once in RolloutGroup.prompt_routes. The layout
    # (layers, k, experts) is the group's ``route_layout``.
    routes: bytes = b""
    # False: some rows were recomputed after a swap or a preemption (another version's
    # routing), as ``versions_exact`` for versions
    routes_exact: bool = True

    def tokens(self) -> np.ndarray:
        """Every id after the prompt (sampled, boundary and observation ids)."""
        return unpack_i32(self.completion_ids)

    def sampled(self) -> np.ndarray:
        """Bool per completion id: True where the model sampled it (the loss mask)."""
        n = len(self.completion_ids) // 4
        if not self.loss_mask:
            return np.ones(n, dtype=bool)
        return np.frombuffer(self.loss_mask, dtype=np.uint8).astype(bool)

    def n_sampled(self) -> int:
        """How many ids the model sampled (the length of every per-sampled-token array)."""
        if not self.loss_mask:
            return len(self.completion_ids) // 4
        return int(np.count_nonzero(np.frombuffer(self.loss_mask, dtype=np.uint8)))

    def turn_starts(self) -> np.ndarray:
        """Where each turn's sampled run starts in completion_ids."""
        return unpack_i32(self.turn_offsets) if self.turn_offsets else np.zeros(1, np.int32)

    def turns(self) -> int:
        return len(self.turn_starts())

    def token_versions(self) -> np.ndarray:
        return rle_decode(self.versions)

    def sampling_mask(self) -> list[np.ndarray] | None:
        """Per sampled token, the kept vocabulary ids; None when no mask was recorded."""
        return unpack_mask(self.mask_ids, self.mask_counts, self.n_sampled())

    def check(self, where: str) -> np.ndarray:
        """The per-token invariants: at least one completion token; the episode's
        layout (:meth:`check_episode`); and one log-prob, one policy version, one
        kept-id set (when a sampling mask is recorded) and one ``ref_logprobs`` /
        ``token_advantages`` value (when set) per *sampled* token, every one of them
        finite, as ``reward`` and ``advantage`` are. Raise BadEntry starting with
        ``where`` (e.g. "sample <group>/<index>") that names the field; return the
        completion tokens."""
        try:
            tokens = self.tokens()
            floats = {"logprobs": unpack_f32(self.logprobs)}
            if self.ref_logprobs:
                floats["ref_logprobs"] = unpack_f32(self.ref_logprobs)
            if self.token_advantages:
                floats["token_advantages"] = unpack_f32(self.token_advantages)
            lengths = {name: len(a) for name, a in floats.items()}
            lengths["versions"] = len(self.token_versions())
        except ValueError as e:
            raise BadEntry(f"{where}: {e}") from None
        # a non-finite value would reach the loss (trainer/loss.py) and the weights
        for name, a in floats.items():
            if not np.isfinite(a).all():
                raise BadEntry(
                    f"{where} has a non-finite {name} value ({a[~np.isfinite(a)][0]}) at token "
                    f"{int(np.flatnonzero(~np.isfinite(a))[0])}: its writer must give finite "
                    "values (a log-prob of -inf means a token outside the sampled support)"
                )
        for name in ("reward", "advantage"):
            if not np.isfinite(getattr(self, name)):
                raise BadEntry(f"{where} has a non-finite {name} ({getattr(self, name)})")
        if len(tokens) == 0:
            raise BadEntry(f"{where} has no completion tokens (completion_ids is empty)")
        sampled = self.check_episode(where, len(tokens))
        kind, what = "tokens", "completion token"
        if self.loss_mask:
            kind, what = "sampled tokens", "sampled token (loss_mask 1), none on observation tokens"
        for name, length in lengths.items():
            if length != sampled:
                raise BadEntry(
                    f"{where} has {sampled} {kind} but {length} {name}: its writer must "
                    f"give {name} one value per {what}"
                )
        try:
            unpack_mask(self.mask_ids, self.mask_counts, sampled)
        except ValueError as e:
            raise BadEntry(f"{where}: {e}") from None
        return tokens

    def check_episode(self, where: str, n: int) -> int:
        """The episode's layout over its ``n`` completion ids: ``loss_mask`` one 0/1 per
        id, ending on a sampled id; ``turn_offsets`` exactly the starts of the mask's
        runs of 1 (the first at 0: the model's turn opens the completion); one tool outcome
        per turn, each a known kind. Return the number of sampled ids."""
        if not self.loss_mask and not self.turn_offsets:
            if self.tool_outcomes and len(self.tool_outcomes) != 1:
                raise BadEntry(
                    f"{where} is one turn (no turn_offsets) but has "
                    f"{len(self.tool_outcomes)} tool_outcomes: give one per turn"
                )
            self._check_outcomes(where)
            return n
        if not self.loss_mask or not self.turn_offsets:
            missing = "loss_mask" if not self.loss_mask else "turn_offsets"
            raise BadEntry(
                f"{where} has {'turn_offsets' if not self.loss_mask else 'loss_mask'} but no "
                f"{missing}: an episode writes both (or neither, for one turn)"
            )
        mask = np.frombuffer(self.loss_mask, dtype=np.uint8)
        if len(mask) != n:
            raise BadEntry(
                f"{where} has {n} completion ids but a loss_mask of {len(mask)}: "
                "one 0/1 per completion id"
            )
        if mask.max() > 1:
            raise BadEntry(f"{where} has a loss_mask value other than 0 or 1")
        if mask[0] != 1:
            raise BadEntry(
                f"{where} starts with an unsampled token (loss_mask 0): the prompt ends where "
                "the model's first turn begins, so the first completion id is sampled"
            )
        if mask[-1] != 1:
            raise BadEntry(
                f"{where} ends on an observation token (loss_mask 0): an episode ends with "
                "the model's turn, so the last completion id is sampled"
            )
        try:
            offsets = unpack_i32(self.turn_offsets)
        except BadEntry as e:
            raise BadEntry(f"{where} turn_offsets: {e}") from None
        if (offsets < 0).any() or (offsets >= n).any():
            raise BadEntry(
                f"{where} has a turn offset outside its {n} completion ids "
                f"({offsets.tolist()}): each turn starts inside the completion"
            )
        starts = np.flatnonzero(mask.astype(bool) & ~np.r_[False, mask[:-1].astype(bool)])
        if not np.array_equal(starts, offsets):
            raise BadEntry(
                f"{where} has turn_offsets {offsets.tolist()} but its loss_mask's sampled "
                f"runs start at {starts.tolist()}: the mask disagrees with the turns"
            )
        if self.tool_outcomes and len(self.tool_outcomes) != len(offsets):
            raise BadEntry(
                f"{where} has {len(offsets)} turns but {len(self.tool_outcomes)} "
                "tool_outcomes: give one per turn"
            )
        self._check_outcomes(where)
        return int(mask.sum())

    def _check_outcomes(self, where: str) -> None:
        for k, outcome in enumerate(self.tool_outcomes):
            if outcome not in TOOL_OUTCOMES:
                raise BadEntry(
                    f"{where} turn {k} has tool outcome {outcome!r}: one of {TOOL_OUTCOMES}"
                )


class RolloutGroup(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """G completions of one prompt: the unit of the ``rollouts`` stream."""

    schema: int
    group_id: str
    actor: str
    problem_id: str
    prompt_ids: bytes  # int32
    samples: list[Sample]
    temperature: float
    top_p: float = 1.0
    top_k: int = 0
    created: float = 0.0
    # sampling.keep_routing: [moe layers, k, experts] of every sample's ``routes`` (empty:
    # no routes recorded), and the prompt's rows ([len(prompt), layers, k]) once for every
    # sample when they are identical (then each sample's ``routes`` start at its completion)
    route_layout: list[int] = msgspec.field(default_factory=list)
    prompt_routes: bytes = b""

    def check(self) -> None:
        """Raise BadEntry naming the first sample (and field) that breaks the per-token
        invariants (:meth:`Sample.check`) or the routes (:meth:`check_routes`), or a group
        with no samples."""
        if not self.samples:
            raise BadEntry(f"rollout group {self.group_id} has no samples: an actor sends G > 0")
        try:
            unpack_i32(self.prompt_ids)
        except BadEntry as e:
            raise BadEntry(f"rollout group {self.group_id} prompt_ids: {e}") from None
        for s in self.samples:
            s.check(f"sample {self.group_id}/{s.index}")
        self.check_routes()

    def check_routes(self) -> None:
        """sampling.keep_routing: ``route_layout`` present exactly when routes are; routes on
        every sample or none; ``prompt_routes`` one row per prompt id, and then each
        sample's routes one per completion id less the last (without it: prompt +
        completion - 1 rows); ids below the experts, distinct and ascending per row."""
        where = f"rollout group {self.group_id}"
        layout = _route_layout(
            where,
            self.route_layout,
            self.samples,
            lambda s: f"sample {self.group_id}/{s.index}",
            self._route_rows,
            extra=bool(self.prompt_routes),
        )
        if layout is None:
            return
        prompt = len(self.prompt_ids) // 4
        if self.prompt_routes:
            _check_routes(
                where,
                "prompt_routes",
                self.prompt_routes,
                layout,
                prompt,
                f"one per prompt id: {prompt}",
            )
        for s in self.samples:
            rows, why = self._route_rows(s)
            _check_routes(
                f"sample {self.group_id}/{s.index}", "routes", s.routes, layout, rows, why
            )

    def _route_rows(self, s: Sample) -> tuple[int, str]:
        """The rows ``s.routes`` must hold, and why."""
        p, n = len(self.prompt_ids) // 4, len(s.completion_ids) // 4
        if self.prompt_routes:
            return n - 1, f"the group carries prompt_routes: completion {n} - 1"
        return p + n - 1, f"prompt {p} + completion {n} - 1"


# ---------------------------------------------------------------- preprocessor -> trainer
# Stream <run>:batches, one TrainBatch per entry (XADD-once on its batch id), written
# to the shard its rollouts came from. Written by the preprocessors; read by the
# trainer's rank 0 (consumer group "trainer", trainer/batches.py), which calls
# TrainBatch.check() and dead-letters a batch that fails it.


class TrainBatch(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """A token-budget micro-batch: the unit of the ``batches`` stream."""

    schema: int
    batch_id: str
    group_ids: list[str]
    prompt_ids: list[bytes]  # one per sample (int32)
    samples: list[Sample]
    temperature: float
    top_p: float = 1.0
    top_k: int = 0
    # sampling.keep_routing: [moe layers, k, experts]; every sample's ``routes`` then hold
    # all its rows (prompt + completion - 1), the preprocessor having joined a group's
    # shared prompt rows to each sample
    route_layout: list[int] = msgspec.field(default_factory=list)

    def check(self, vocab_size: int, route_layout: list[int] | None = None) -> None:
        """Raise BadEntry naming the first inconsistency: lists of different lengths,
        a sample that breaks the per-token invariants (:meth:`Sample.check`),
        ``ref_logprobs`` on some samples only, a token id outside ``vocab_size``, or
        routes that break :meth:`check_routes`; with ``route_layout`` (the trainer's
        model: [moe layers, k, experts], [] for a dense model) routes of another layout."""
        n = len(self.samples)
        if n == 0:
            raise BadEntry("batch has no samples")
        if len(self.group_ids) != n or len(self.prompt_ids) != n:
            raise BadEntry(
                f"batch has {n} samples but {len(self.group_ids)} group ids and "
                f"{len(self.prompt_ids)} prompts: group_ids and prompt_ids need one per sample"
            )
        has_ref = bool(self.samples[0].ref_logprobs)
        rows = zip(self.group_ids, self.prompt_ids, self.samples, strict=True)
        for group_id, prompt_ids, s in rows:
            where = f"sample {group_id}/{s.index}"
            tokens = s.check(where)
            try:
                prompt = unpack_i32(prompt_ids)
            except BadEntry as e:
                raise BadEntry(f"{where} prompt_ids: {e}") from None
            if bool(s.ref_logprobs) != has_ref:
                raise BadEntry(
                    f"{where}: ref_logprobs on some samples of the batch only "
                    "(the reference scorer sets them on every sample or none)"
                )
            both = np.concatenate([prompt, tokens])
            if both.size and (both.min() < 0 or both.max() >= vocab_size):
                raise BadEntry(
                    f"{where} has token ids outside the vocabulary (0..{vocab_size - 1}) "
                    "in prompt_ids or completion_ids: the actors and the trainer must load "
                    "the same model.path"
                )
        self.check_routes()
        if route_layout is not None and self.route_layout:
            if not route_layout:
                raise BadEntry(
                    f"batch {self.batch_id} carries routes of layout {self.route_layout} but "
                    "the trainer's model has no mixture-of-experts router: the actors and the "
                    "trainer must load the same model.path"
                )
            if list(self.route_layout) != list(route_layout):
                raise BadEntry(
                    f"batch {self.batch_id} has route_layout {self.route_layout} but the "
                    f"trainer's model routes {route_layout} ([moe layers, k, experts]): the "
                    "actors and the trainer must load the same model.path"
                )

    def check_routes(self) -> None:
        """sampling.keep_routing: ``route_layout`` present exactly when routes are; routes on
        every sample or none, each prompt + completion - 1 rows (the preprocessor joined
        the group's prompt rows), ids below the experts, distinct and ascending per row."""
        pairs = zip(self.group_ids, self.prompt_ids, self.samples, strict=True)
        where_of = {id(s): f"sample {g}/{s.index}" for g, _, s in pairs}
        prompt_of = {id(s): len(p) // 4 for p, s in zip(self.prompt_ids, self.samples, strict=True)}

        def rows_of(s: Sample) -> tuple[int, str]:
            p, n = prompt_of[id(s)], len(s.completion_ids) // 4
            return p + n - 1, f"prompt {p} + completion {n} - 1"

        layout = _route_layout(
            f"batch {self.batch_id}",
            self.route_layout,
            self.samples,
            lambda s: where_of[id(s)],
            rows_of,
        )
        if layout is None:
            return
        for s in self.samples:
            _check_routes(where_of[id(s)], "routes", s.routes, layout, *rows_of(s))


# ---------------------------------------------------------------- actor -> actor
# The episode journal (task.kind=env; actor/journal.py): not a stream entry but one
# Redis hash per open group of episodes, <run>:episodes:<group id>, field ``open`` an
# EpisodeOpen, field ``<k>:<n>`` the EpisodeDelta that episode k's n-th write added
# (one per finished turn: what the turn added, never the whole episode again, so an
# episode of T turns writes O(T) bytes). Written by the actor that owns the group (its
# lease in <run>:episodes:claims), read by the actor that takes the group over when
# that one died (actor/journal.py assembles each episode from its deltas 0..n-1, in
# order), deleted once the group is published. Not a wire message between pools of
# different roles: it carries SCHEMA_VERSION like the others; a group whose ``open``
# is of another schema is refused (dropped, logged), an episode whose deltas do not
# decode, leave a gap or do not fit restarts from ``reset`` (logged, counted).


class EpisodeOpen(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """A group of episodes as it was opened: what every episode of it starts from."""

    schema: int
    group_id: str  # the rollout group's id once published (XADD-once on it)
    actor: str  # the actor that opened it
    problem: Problem
    prompt_ids: bytes  # int32: the opening prompt the G episodes share
    group_size: int


class EpisodeDelta(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """What write ``seq`` of episode ``index`` added (actor/episodes.py Episode; one
    write per finished turn, and one more when an episode ends without a turn): the
    ids after the first ``start`` of those the earlier deltas hold (``start`` is below
    their count only when an observation, mask 0, was taken back), their mask, the
    log-probs, versions and sampling masks of the sampled ones among them, the turn
    offsets and tool outcomes added; then the episode's counters as of this write
    (reward, flags, tool budget spent), and the environment's ``state()`` when it
    declares itself ``resumable`` (empty otherwise): the environment's own, written
    whole each time (its size is the environment's business, not the episode's)."""

    schema: int
    index: int  # the episode in its group
    seq: int  # this write's place in the episode's writes (0, 1, ...): field <index>:<seq>
    turns: int  # turns taken once applied (the offsets the deltas 0..seq hold)
    start: int = 0  # ids of the earlier deltas kept; ``ids`` follow them
    ids: bytes = b""  # int32
    mask: bytes = b""  # uint8 per id of ``ids``
    logprobs: bytes = b""  # float32 per sampled id of ``ids``
    versions: bytes = b""  # int32 RLE pairs per sampled id of ``ids``
    mask_ids: bytes = b""
    mask_counts: bytes = b""
    offsets: bytes = b""  # int32: the turn offsets added (where a turn's sampled ids start)
    outcomes: list[str] = msgspec.field(default_factory=list)  # the tool outcomes added
    reward: float = 0.0
    done: bool = False
    finished: bool = False
    infra: bool = False
    exact: bool = True
    observed: int = 0  # ids of the last observation appended
    tool_calls: int = 0  # the episode's tool budget spent so far
    tool_s: float = 0.0
    env_state: bytes = b""  # msgpack of Environment.state(); b"": not resumable


# ---------------------------------------------------------------- trainer -> actor
# Stream <run>:weights, one WeightAnnouncement per published version, written by the
# trainer's weight publisher (trainer/weight_publisher.py) and read (XREAD, no
# consumer group: every actor reads every entry) by each actor's weight receiver
# (actor/weight_receiver.py). The buckets it describes follow over the transfer
# process group, not through Redis.


class ParamSpec(msgspec.Struct, forbid_unknown_fields=True):
    name: str
    shape: list[int]
    offset: int  # element offset inside its bucket


class BucketSpec(msgspec.Struct, forbid_unknown_fields=True):
    numel: int
    params: list[ParamSpec]


class WeightAnnouncement(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Version v is about to be sent to ``targets`` in these buckets."""

    schema: int
    version: int
    dtype: str
    buckets: list[BucketSpec]
    checksums: list[int]  # sum of each bucket's bit patterns, checked by the receiver
    targets: list[str]
    created: float = 0.0
    kind: str = "full"  # "full": every weight; "lora": a LoRA adapter only (model.lora)
    # how ``checksums`` were summed (pipeline/transfer/buckets.py checksum): "sum64" from
    # this build's trainer; absent (an older trainer's) means "sum32"
    checksum_kind: str = "sum32"


# ---------------------------------------------------------------- control and status
# <run>:dead holds, per refused entry, its source stream, id, consumer, the reason
# and the entry's payload as it came (plain fields: pipeline/streams/consumer.py
# Consumer.dead_letter); the group accounting (pipeline/run/accounting.py) reads it for
# the summary and pipeline.inspect.
# <run>:stats is reserved for StatsEvent; no pool writes it yet (metrics go to
# metrics.jsonl and the status hashes).


class StatsEvent(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    schema: int
    role: str
    name: str
    time: float
    values: dict[str, float]


# ---------------------------------------------------------------- encoding


_ENCODER = msgspec.msgpack.Encoder()
_DECODERS = {
    cls: msgspec.msgpack.Decoder(cls)
    for cls in (RolloutGroup, TrainBatch, WeightAnnouncement, StatsEvent, EpisodeOpen, EpisodeDelta)
}


def encode(msg: msgspec.Struct) -> bytes:
    return _ENCODER.encode(msg)


def decode(data: bytes, cls: type):
    """Decode a payload into ``cls``; raise BadEntry with the reason."""
    if not isinstance(data, bytes | bytearray | memoryview):
        raise BadEntry(f"payload is {type(data).__name__}, expected bytes")
    if len(data) > MAX_PAYLOAD_BYTES:
        raise BadEntry(f"payload of {len(data)} bytes exceeds {MAX_PAYLOAD_BYTES}")
    try:
        msg = _DECODERS[cls].decode(data)
    except msgspec.ValidationError as e:
        raise BadEntry(f"not a valid {cls.__name__}: {e}") from None
    except (msgspec.DecodeError, UnicodeDecodeError) as e:
        raise BadEntry(f"undecodable {cls.__name__} payload: {e}") from None
    if msg.schema != SCHEMA_VERSION:
        age = "an older" if msg.schema < SCHEMA_VERSION else "a newer"
        raise BadEntry(
            f"schema version {msg.schema}, this build reads {SCHEMA_VERSION}: written by "
            f"{age} build; run every pool of a run on one build (drain or start a new run "
            "to upgrade)"
        )
    return msg
