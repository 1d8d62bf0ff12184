"""The wire schema as a consumer sees it: round trips, packed arrays, RLE versions,
and every way a payload can be refused with BadEntry (never pickle, never a crash)."""

from __future__ import annotations

import pickle

import msgspec
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.messages import (
    SCHEMA_VERSION,
    BadEntry,
    BucketSpec,
    ParamSpec,
    RolloutGroup,
    Sample,
    StatsEvent,
    TrainBatch,
    WeightAnnouncement,
    decode,
    encode,
    pack_f32,
    pack_i32,
    rle_decode,
    rle_encode,
    unpack_f32,
    unpack_i32,
)

ALL_CLASSES = [RolloutGroup, TrainBatch, WeightAnnouncement, StatsEvent]
INT32_MAX = 2**31 - 1


def make_sample(index: int = 0, n: int = 5, version: int = 3) -> Sample:
    return Sample(
        index=index,
        completion_ids=pack_i32(range(100 + index, 100 + index + n)),
        logprobs=pack_f32([-0.5 * (i + 1) for i in range(n)]),
        versions=rle_encode([version] * (n - 2) + [version + 1] * 2),
        reward=1.0 if index % 2 == 0 else 0.0,
        finished=index % 2 == 0,
    )


def make_group() -> RolloutGroup:
    return RolloutGroup(
        schema=SCHEMA_VERSION,
        group_id="actor-0:17",
        actor="actor-0",
        problem_id="add-42",
        prompt_ids=pack_i32([1, 2, 3, 4]),
        samples=[make_sample(i) for i in range(4)],
        temperature=0.7,
        top_p=0.9,
        top_k=50,
        created=1_700_000_000.25,
    )


def make_batch() -> TrainBatch:
    samples = [make_sample(i) for i in range(3)]
    samples[1].advantage = -0.75
    samples[1].ref_logprobs = pack_f32([-0.1, -0.2, -0.3, -0.4, -0.5])
    return TrainBatch(
        schema=SCHEMA_VERSION,
        batch_id="pre-0:5",
        group_ids=["actor-0:17", "actor-1:3"],
        prompt_ids=[pack_i32([1, 2]), pack_i32([3]), pack_i32([4, 5, 6])],
        samples=samples,
        temperature=0.7,
    )


def make_announcement() -> WeightAnnouncement:
    return WeightAnnouncement(
        schema=SCHEMA_VERSION,
        version=12,
        dtype="bfloat16",
        buckets=[
            BucketSpec(numel=30, params=[ParamSpec("w", [5, 4], 0), ParamSpec("b", [10], 20)]),
            BucketSpec(numel=7, params=[ParamSpec("head.weight", [7], 0)]),
        ],
        checksums=[123456789, 42],
        targets=["actor-0", "actor-1"],
        created=12.5,
    )


def make_stats() -> StatsEvent:
    return StatsEvent(
        schema=SCHEMA_VERSION,
        role="trainer",
        name="trainer-0",
        time=1_700_000_001.5,
        values={"loss": 0.25, "reward_mean": 0.5, "tokens": 4096.0},
    )


def as_fields(msg) -> dict:
    """A struct as the plain msgpack map it travels as (bytes stay bytes)."""
    return msgspec.msgpack.decode(encode(msg))


MAKERS = {
    RolloutGroup: make_group,
    TrainBatch: make_batch,
    WeightAnnouncement: make_announcement,
    StatsEvent: make_stats,
}


# ---------------------------------------------------------------- round trips


@pytest.mark.parametrize("cls", ALL_CLASSES, ids=lambda c: c.__name__)
def test_every_struct_round_trips(cls):
    msg = MAKERS[cls]()
    data = encode(msg)
    assert isinstance(data, bytes)
    back = decode(data, cls)
    assert type(back) is cls
    assert back == msg


def test_rollout_group_samples_keep_their_arrays_and_index():
    group = decode(encode(make_group()), RolloutGroup)
    assert [s.index for s in group.samples] == [0, 1, 2, 3]
    s = group.samples[2]
    assert s.tokens().tolist() == [102, 103, 104, 105, 106]
    np.testing.assert_array_equal(
        unpack_f32(s.logprobs), np.array([-0.5, -1.0, -1.5, -2.0, -2.5], dtype=np.float32)
    )
    assert s.token_versions().tolist() == [3, 3, 3, 4, 4]
    assert unpack_i32(group.prompt_ids).tolist() == [1, 2, 3, 4]
    assert (s.advantage, s.ref_logprobs) == (0.0, b"")  # defaults survive the trip


def test_train_batch_keeps_preprocessor_fields():
    batch = decode(encode(make_batch()), TrainBatch)
    assert batch.samples[1].advantage == -0.75
    assert unpack_f32(batch.samples[1].ref_logprobs).tolist() == pytest.approx(
        [-0.1, -0.2, -0.3, -0.4, -0.5]
    )
    assert [unpack_i32(p).tolist() for p in batch.prompt_ids] == [[1, 2], [3], [4, 5, 6]]


@pytest.mark.parametrize("wrap", [bytearray, memoryview], ids=["bytearray", "memoryview"])
def test_decode_accepts_bytes_like_payloads(wrap):
    msg = make_stats()
    assert decode(wrap(encode(msg)), StatsEvent) == msg


# ---------------------------------------------------------------- packed arrays


@given(st.lists(st.integers(min_value=-(2**31), max_value=INT32_MAX), max_size=200))
def test_i32_arrays_round_trip(values):
    data = pack_i32(values)
    assert len(data) == 4 * len(values)
    out = unpack_i32(data)
    assert out.dtype == np.int32
    assert out.tolist() == values


@given(st.lists(st.floats(width=32, allow_nan=False), max_size=200))
def test_f32_arrays_round_trip(values):
    out = unpack_f32(pack_f32(values))
    assert out.dtype == np.float32
    assert out.tolist() == values


def test_f32_keeps_nan_and_infinities():
    out = unpack_f32(pack_f32([float("nan"), float("inf"), float("-inf"), -0.0]))
    assert np.isnan(out[0]) and out[1] == np.inf and out[2] == -np.inf
    assert np.signbit(out[3])


def test_packed_arrays_are_little_endian_int32_and_float32():
    assert pack_i32([1, -1]) == b"\x01\x00\x00\x00\xff\xff\xff\xff"
    assert pack_f32([1.0]) == b"\x00\x00\x80\x3f"


@pytest.mark.parametrize("unpack", [unpack_i32, unpack_f32])
def test_unpack_refuses_truncated_arrays(unpack):
    with pytest.raises(BadEntry, match="multiple of 4"):
        unpack(b"\x00" * 7)


# ---------------------------------------------------------------- run-length versions


@pytest.mark.parametrize(
    "versions",
    [[], [0], [7], [5] * 1000, [0, 0, 1], [3, 3, 3, 4, 4], [1, 2, 1, 2], [9, 8, 7]],
)
def test_rle_examples_round_trip(versions):
    assert rle_decode(rle_encode(versions)).tolist() == versions


def test_rle_packs_version_count_pairs():
    assert rle_encode([]) == b""
    assert unpack_i32(rle_encode([3, 3, 3, 4, 4])).tolist() == [3, 3, 4, 2]
    assert unpack_i32(rle_encode([6] * 50)).tolist() == [6, 50]  # one run: one pair


@given(st.lists(st.integers(min_value=0, max_value=INT32_MAX), max_size=300))
def test_rle_round_trips_any_versions(versions):
    data = rle_encode(versions)
    assert rle_decode(data).tolist() == versions
    runs = sum(1 for i, v in enumerate(versions) if i == 0 or v != versions[i - 1])
    assert len(data) == 8 * runs


@given(st.lists(st.tuples(st.integers(0, 1000), st.integers(1, 50)), max_size=30))
def test_rle_round_trips_runs(runs):
    versions = [v for v, n in runs for _ in range(n)]
    assert rle_decode(rle_encode(versions)).tolist() == versions


@pytest.mark.parametrize(
    "data",
    [pack_i32([3]), pack_i32([3, 0]), pack_i32([3, -2]), pack_i32([1, 2, 3, 0]), b"\x01\x02\x03"],
    ids=["odd-count", "zero-run", "negative-run", "zero-run-later", "truncated"],
)
def test_rle_decode_refuses_malformed_runs(data):
    with pytest.raises(BadEntry):
        rle_decode(data)


# ---------------------------------------------------------------- refusals


@pytest.mark.parametrize("cls", ALL_CLASSES, ids=lambda c: c.__name__)
@pytest.mark.parametrize(
    "garbage", [b"", b"\xc1", b"not msgpack at all", b"\x00\xff" * 20, b"\x93\x01\x02"]
)
def test_garbage_bytes_are_bad_entries(cls, garbage):
    with pytest.raises(BadEntry):
        decode(garbage, cls)


@pytest.mark.parametrize(
    "make, cls",
    [
        (make_group, TrainBatch),
        (make_batch, RolloutGroup),
        (make_announcement, StatsEvent),
        (make_stats, WeightAnnouncement),
        (make_stats, RolloutGroup),
    ],
    ids=[
        "group-as-batch",
        "batch-as-group",
        "weights-as-stats",
        "stats-as-weights",
        "stats-as-group",
    ],
)
def test_payload_of_another_struct_is_a_bad_entry(make, cls):
    with pytest.raises(BadEntry, match=cls.__name__):
        decode(encode(make()), cls)


@pytest.mark.parametrize("cls", ALL_CLASSES, ids=lambda c: c.__name__)
def test_unknown_field_is_a_bad_entry(cls):
    fields = as_fields(MAKERS[cls]())
    fields["surprise"] = 1
    with pytest.raises(BadEntry, match="surprise"):
        decode(msgspec.msgpack.encode(fields), cls)


def test_unknown_field_inside_a_sample_is_a_bad_entry():
    fields = as_fields(make_group())
    fields["samples"][1]["extra"] = "x"
    with pytest.raises(BadEntry, match="extra"):
        decode(msgspec.msgpack.encode(fields), RolloutGroup)


def test_sample_without_index_is_a_bad_entry():
    fields = as_fields(make_group())
    del fields["samples"][0]["index"]
    with pytest.raises(BadEntry, match="index"):
        decode(msgspec.msgpack.encode(fields), RolloutGroup)


@pytest.mark.parametrize("cls", ALL_CLASSES, ids=lambda c: c.__name__)
@pytest.mark.parametrize("schema", [0, SCHEMA_VERSION - 1, SCHEMA_VERSION + 1, -1])
def test_other_schema_version_is_a_bad_entry(cls, schema):
    msg = MAKERS[cls]()
    msg.schema = schema
    with pytest.raises(BadEntry, match="schema version"):
        decode(encode(msg), cls)


@pytest.mark.parametrize(
    "payload", ["a string", None, 123, ["list"], {"data": b"x"}], ids=lambda p: type(p).__name__
)
def test_non_bytes_payload_is_a_bad_entry(payload):
    with pytest.raises(BadEntry, match="expected bytes"):
        decode(payload, RolloutGroup)


class _Boom:
    """Unpickling this would run code; decode must never get that far."""

    def __reduce__(self):
        return (pytest.fail, ("decode unpickled a payload",))


@pytest.mark.parametrize("cls", ALL_CLASSES, ids=lambda c: c.__name__)
@pytest.mark.parametrize("protocol", [0, 2, pickle.HIGHEST_PROTOCOL])
def test_pickle_payload_is_refused_never_unpickled(cls, protocol):
    fields = as_fields(MAKERS[cls]())
    with pytest.raises(BadEntry):
        decode(pickle.dumps(fields, protocol=protocol), cls)
    with pytest.raises(BadEntry):
        decode(pickle.dumps({"schema": SCHEMA_VERSION, "x": _Boom()}, protocol=protocol), cls)


@pytest.mark.parametrize("where", ["value", "field-name", "dict-key"])
def test_invalid_utf8_string_is_a_bad_entry(where):
    fields = as_fields(make_stats())
    data = msgspec.msgpack.encode(fields)
    if where == "value":
        data = data.replace(b"\xa7trainer", b"\xa7train\xff\xfe")
    elif where == "field-name":
        data = data.replace(b"\xa4role", b"\xa4rol\xff")
    else:
        data = data.replace(b"\xa4loss", b"\xa4los\x80")
    assert data != msgspec.msgpack.encode(fields)
    with pytest.raises(BadEntry):
        decode(data, StatsEvent)


@pytest.mark.parametrize("versions", [[2**31], [1] + [2**32 + 5] * 3])
def test_rle_never_silently_wraps_large_versions(versions):
    try:
        data = rle_encode(versions)
    except (ValueError, OverflowError):
        return  # refusing is fine; silently changing the versions is not
    assert rle_decode(data).tolist() == versions


# ---------------------------------------------------------------- per-token invariants
# RolloutGroup.check (the preprocessor's) and TrainBatch.check (the trainer's): an entry
# that decodes but whose arrays disagree is refused with the sample and the field named


def consistent_batch() -> TrainBatch:
    batch = make_batch()
    batch.group_ids.append("actor-1:3")  # make_batch's lists differ in length on purpose
    for s in batch.samples:  # and it sets ref_logprobs on one sample only
        s.ref_logprobs = pack_f32([-0.5] * 5)
    return batch


def test_consistent_group_and_batch_pass_their_checks():
    make_group().check()
    consistent_batch().check(vocab_size=200)


@pytest.mark.parametrize(
    "field, value, reason",
    [
        ("logprobs", pack_f32([-1.0]), "actor-0:17/2 has 5 tokens but 1 logprobs"),
        ("versions", rle_encode([3, 3]), "actor-0:17/2 has 5 tokens but 2 versions"),
        ("completion_ids", b"", "actor-0:17/2 has no completion tokens"),
        ("completion_ids", b"\x01\x02", "actor-0:17/2: int32 array has 2 bytes"),
        ("mask_counts", pack_i32([1]), "actor-0:17/2: sampling mask"),
        ("token_advantages", pack_f32([0.5] * 4), "5 tokens but 4 token_advantages"),
    ],
)
def test_a_group_whose_per_token_arrays_disagree_fails_its_check(field, value, reason):
    group = make_group()
    setattr(group.samples[2], field, value)
    with pytest.raises(BadEntry, match=reason):
        group.check()


def test_a_group_without_samples_or_with_a_truncated_prompt_fails_its_check():
    group = make_group()
    group.prompt_ids = b"\x01"
    with pytest.raises(BadEntry, match="actor-0:17 prompt_ids: int32 array"):
        group.check()
    group.samples = []
    with pytest.raises(BadEntry, match="actor-0:17 has no samples"):
        group.check()


@pytest.mark.parametrize(
    "spoil, reason",
    [
        (lambda b: b.samples.clear(), "batch has no samples"),
        (lambda b: b.group_ids.pop(), "3 samples but 2 group ids and 3 prompts"),
        (
            lambda b: setattr(b.samples[2], "ref_logprobs", pack_f32([-1.0] * 3)),
            "actor-1:3/2 has 5 tokens but 3 ref_logprobs",
        ),
        (
            lambda b: setattr(b.samples[1], "ref_logprobs", b""),
            "actor-1:3/1: ref_logprobs on some samples of the batch only",
        ),
        (lambda b: b.prompt_ids.__setitem__(0, pack_i32([200])), "outside the vocabulary"),
        (lambda b: b.prompt_ids.__setitem__(0, b"\x00"), "actor-0:17/0 prompt_ids: int32"),
    ],
)
def test_a_batch_that_disagrees_with_itself_fails_its_check(spoil, reason):
    batch = consistent_batch()
    spoil(batch)
    with pytest.raises(BadEntry, match=reason):
        batch.check(vocab_size=200)


# ---------------------------------------------------------------- routes (Keep Routing)

LAYOUT = [2, 2, 8]  # 2 MoE layers, top-2 of 8 experts


def route_rows(rows: int, start: int = 0) -> bytes:
    """``rows`` rows of valid routes: [t % 7, t % 7 + 1] at both layers."""
    t = (np.arange(start, start + rows) % 7)[:, None, None]
    return (
        (np.concatenate([t, t + 1], axis=-1) * np.ones((1, 2, 1), int)).astype(np.uint8).tobytes()
    )


def routed_group(shared: bool = True) -> RolloutGroup:
    """make_group with routes: prompt 4 ids, completions 5 ids (8 rows in all)."""
    group = make_group()
    group.route_layout = list(LAYOUT)
    if shared:
        group.prompt_routes = route_rows(4)
    for s in group.samples:
        s.routes = route_rows(4, 4) if shared else route_rows(8)
    return group


def routed_batch() -> TrainBatch:
    batch = consistent_batch()
    batch.route_layout = list(LAYOUT)
    for p, s in zip(batch.prompt_ids, batch.samples, strict=True):
        s.routes = route_rows(len(p) // 4 + 5 - 1)
    return batch


def set_row(data: bytes, row: int, ids: list[int]) -> bytes:
    a = np.frombuffer(data, np.uint8).reshape(-1, 2, 2).copy()
    a[row, 1] = ids
    return a.tobytes()


def test_groups_and_batches_with_routes_pass_their_checks():
    routed_group(shared=True).check()
    routed_group(shared=False).check()
    routed_batch().check(vocab_size=200)
    one = routed_group()  # a one-id completion after prompt_routes owes no rows
    one.samples[0].completion_ids = pack_i32([7])
    one.samples[0].logprobs, one.samples[0].versions = pack_f32([-1.0]), rle_encode([3])
    one.samples[0].routes = b""
    one.check()


def _spoil_sample(field_value):
    return lambda g: setattr(g.samples[1], "routes", field_value)


@pytest.mark.parametrize(
    "spoil, reason",
    [
        (
            _spoil_sample(route_rows(3, 4)),
            "actor-0:17/1 has 3 rows of routes but needs 4 .the group carries prompt_routes: "
            "completion 5 - 1",
        ),
        (
            lambda g: setattr(g, "prompt_routes", route_rows(5)),
            "rollout group actor-0:17 has 5 rows of prompt_routes but needs 4 .one per prompt",
        ),
        (
            _spoil_sample(set_row(route_rows(4, 4), 2, [3, 8])),
            "actor-0:17/1 routes row 2 layer 1 routes to expert 8 but the model has 8 experts",
        ),
        (
            _spoil_sample(set_row(route_rows(4, 4), 1, [5, 5])),
            r"actor-0:17/1 routes row 1 layer 1 holds \[5, 5\]: each row holds 2 distinct",
        ),
        (
            _spoil_sample(set_row(route_rows(4, 4), 0, [6, 2])),
            r"row 0 layer 1 holds \[6, 2\]: each row holds 2 distinct expert ids in ascending",
        ),
        (_spoil_sample(b"\x01\x02\x03"), "actor-0:17/1 routes: routes of 3 bytes"),
        (_spoil_sample(b""), "actor-0:17/1 has no routes while other samples carry them"),
        (
            lambda g: setattr(g, "route_layout", []),
            "rollout group actor-0:17 has routes but no route_layout",
        ),
        (lambda g: setattr(g, "route_layout", [2, 9, 8]), "k <= experts"),
    ],
)
def test_a_group_whose_routes_are_wrong_fails_its_check(spoil, reason):
    group = routed_group()
    spoil(group)
    with pytest.raises(BadEntry, match=reason):
        group.check()


def test_a_group_without_routes_or_with_routes_but_not_per_sample_fails_its_check():
    group = make_group()
    group.route_layout = list(LAYOUT)
    with pytest.raises(BadEntry, match=r"route_layout \[2, 2, 8\] but no sample carries routes"):
        group.check()
    group.prompt_routes = route_rows(4)  # prompt rows alone: the samples' rows are missing
    with pytest.raises(BadEntry, match="actor-0:17/0 has no routes while its group carry"):
        group.check()
    unshared = routed_group(shared=False)
    unshared.samples[0].routes = route_rows(4)
    with pytest.raises(BadEntry, match="has 4 rows of routes but needs 8 .prompt 4 \\+ completion"):
        unshared.check()


@pytest.mark.parametrize(
    "spoil, reason",
    [
        (
            lambda b: setattr(b.samples[2], "routes", route_rows(8)),
            r"actor-1:3/2 has 8 rows of routes but needs 7 .prompt 3 \+ completion 5 - 1",
        ),
        (lambda b: setattr(b, "route_layout", []), "batch pre-0:5 has routes but no route_layout"),
        (
            lambda b: setattr(b.samples[0], "routes", set_row(route_rows(6), 4, [0, 9])),
            "actor-0:17/0 routes row 4 layer 1 routes to expert 9",
        ),
        (
            lambda b: setattr(b.samples[0], "routes", b""),
            "actor-0:17/0 has no routes while other samples carry them",
        ),
    ],
)
def test_a_batch_whose_routes_are_wrong_fails_its_check(spoil, reason):
    batch = routed_batch()
    spoil(batch)
    with pytest.raises(BadEntry, match=reason):
        batch.check(vocab_size=200)


# ---------------------------------------------------------------- fuzzing


def _valid_or_bad_entry(data, cls):
    try:
        msg = decode(data, cls)
    except BadEntry:
        return
    assert type(msg) is cls
    assert msg.schema == SCHEMA_VERSION


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=512), st.sampled_from(ALL_CLASSES))
def test_random_bytes_decode_or_raise_bad_entry(data, cls):
    _valid_or_bad_entry(data, cls)


_leaves = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats()
    | st.text(max_size=10)
    | st.binary(max_size=10)
)
_values = st.recursive(
    _leaves,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=8,
)
_field_names = st.sampled_from(
    [
        "schema",
        "group_id",
        "actor",
        "problem_id",
        "prompt_ids",
        "samples",
        "temperature",
        "batch_id",
        "group_ids",
        "version",
        "dtype",
        "buckets",
        "checksums",
        "targets",
        "role",
        "name",
        "time",
        "values",
        "index",
    ]
) | st.text(max_size=8)


@settings(max_examples=150, deadline=None)
@given(st.dictionaries(_field_names, _values, max_size=8), st.sampled_from(ALL_CLASSES))
def test_random_msgpack_maps_decode_or_raise_bad_entry(fields, cls):
    try:
        data = msgspec.msgpack.encode(fields)
    except (OverflowError, msgspec.EncodeError):
        return  # integers too large for msgpack cannot even be put on the wire
    _valid_or_bad_entry(data, cls)


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_mutated_valid_payloads_decode_or_raise_bad_entry(data):
    cls = data.draw(st.sampled_from(ALL_CLASSES))
    payload = bytearray(encode(MAKERS[cls]()))
    for _ in range(data.draw(st.integers(1, 4))):
        pos = data.draw(st.integers(0, len(payload) - 1))
        payload[pos] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(0, len(payload)))
    _valid_or_bad_entry(bytes(payload[:cut]), cls)


def test_a_batch_whose_routes_fit_another_model_fails_the_trainers_check():
    batch = routed_batch()
    batch.check(vocab_size=200, route_layout=[2, 2, 8])
    with pytest.raises(BadEntry, match=r"route_layout \[2, 2, 8\] but the trainer's model routes"):
        batch.check(vocab_size=200, route_layout=[2, 2, 16])
    with pytest.raises(BadEntry, match="trainer's model has no mixture-of-experts router"):
        batch.check(vocab_size=200, route_layout=[])
    consistent_batch().check(vocab_size=200, route_layout=[])  # no routes: nothing to fit
