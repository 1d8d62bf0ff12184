"""Episodes durable in Redis (``task.kind=env``): each finished turn is written as the
episode goes, as a delta (what the turn added, never the episode again), and the groups
of an actor that died are taken over from their last finished turn by another actor, or
by itself restarted.

::

    reads   <run>:episodes:claims (who owns each open group, until when);
            <run>:episodes:<group id> of a group it takes over
    writes  <run>:episodes:claims (its lease on each group it runs, renewed every
            lease/3 seconds by a thread of its own); <run>:episodes:<group id>: field
            ``open`` (EpisodeOpen: the problem, the shared prompt) when the group opens,
            field ``<k>:<n>`` (EpisodeDelta, pipeline/messages.py) at episode k's n-th
            write, one per finished turn (and one when an episode ends without a turn):
            the ids the turn added (its sampled ids, then the boundary and observation
            ids that follow them), their mask, the sampled ids' log-probs, versions and
            sampling masks, the turn's offset and outcome, the reward and tool budget
            spent as of that turn and, for a resumable environment, its ``state()``
            (written whole each time: it is the environment's own, its size the
            environment's business); all of it deleted once the group is published;
            <run>:dead (and its XADD-once keys <run>:dead:once*): a group refused whole
            at take-over, its raw fields and the reason
    blocks  on nothing but the Redis calls (Lua scripts: atomic, and under the actor's
            ACL, deploy/redis/users.acl)

So an episode of T equal turns writes T deltas of one turn's size each: O(T) bytes, not
the O(T^2) of writing its whole state after every turn (tests/test_episode_durable.py
measures it). An observation taken back after it was written (a turn that sampled
nothing ends the episode on its last sampled id) is not rewritten either: the next
delta's ``start`` says how many of the ids written before it the episode keeps.

The claim is the actors' claim pattern (actor/room.py's sync claims: ``owner expires``
in a hash, checked in Lua): a group is owned by ``<actor name>/<incarnation>``; its
lease is ``task.episode.takeover_s``. An actor asks :meth:`Journal.take_over` before
it opens a new group: a group whose lease ran out (its actor died, or hangs), or one
owned by an earlier incarnation of this same actor name (a restarted actor takes its
own groups back at once), becomes this actor's, and it goes on from the written
turns: each episode is assembled from its deltas ``0..n-1`` in order
(:func:`assemble`), and the ids, log-probs and versions already written are kept
exactly, so the published episode starts with the prefix that was written. A resumable
environment is rebuilt with ``restore(problem, state)``; any other restarts its
episode from ``reset`` (``episodes_restarted``), as does an episode that had no
finished turn, and its deltas are deleted (:meth:`Journal.forget`: it writes anew from
delta 0).

What cannot be taken over is refused with the reason, logged, like any wire message
(pipeline/messages.py ``BadEntry``). A group whose ``open`` field is missing, does not
decode or is of another schema (another build's journal), or that holds a field other
than ``open`` and ``<k>:<n>`` of its episodes, is dead-lettered
(:meth:`Journal.dead_letter`): one Lua script, fenced by the taker's claim, copies the
hash's raw fields into the run's dead-letter stream (an entry like every pool's dead
letters: ``source`` the hash's key, ``role`` actor, ``reason``, ``group``, and
``journal:<field>`` per field, or past 3000 fields all of them msgpack in ``data``),
XADD-once on the group id, and deletes the hash and the claim. The script is atomic: an
actor that dies around it leaves either the journal whole (the next taker dead-letters
it) or the dead letter, never neither; a second taker (the first stalled past its
lease) dead-letters nothing more. The actor records it (an ``episode_group`` record,
action ``dead_lettered``, with the reason; counted in ``episode_groups_dead_lettered``)
and takes the next group; the account (pipeline/run/accounting.py) finds it dead-lettered,
not lost, from that record or from the dead letter, whichever survived. An episode
whose deltas leave a gap (a delta missing in ``0..n-1``), do not decode, or do not fit
(lengths that disagree, a delta that takes back sampled ids or starts past the ids
before it, one after the delta that ended the episode) restarts from ``reset``
(counted in ``episodes_restarted``) while the group's other episodes resume: the group
is still published, nothing of it lost.

A write is fenced: it lands only while this incarnation still owns the group (a slow
actor whose group was taken over writes nothing more and is told so). Publishing is
XADD-once on the group id the journal holds, so a group published by two actors (the
old one woke up) is one entry in ``rollouts`` and is counted once.
"""

from __future__ import annotations

import logging
import re
import threading
import time
import uuid

import msgspec
import numpy as np

from pipeline.messages import (
    SCHEMA_VERSION,
    BadEntry,
    EpisodeDelta,
    EpisodeOpen,
    decode,
    encode,
    pack_f32,
    pack_i32,
    pack_mask,
    pack_u8,
    rle_decode,
    rle_encode,
    unpack_f32,
    unpack_i32,
    unpack_mask,
)
from pipeline.streams import Lua
from pipeline.streams.durable import ONCE_CAP, once_keys

log = logging.getLogger("actor")

# KEYS: claims, the group's hash. ARGV: group id, owner, expires, EpisodeOpen
_OPEN = Lua("""
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2] .. ' ' .. ARGV[3])
redis.call('HSET', KEYS[2], 'open', ARGV[4])
return 1
""")

# KEYS: claims, the group's hash. ARGV: group id, owner, expires, field, EpisodeDelta.
# 0: this owner no longer holds the group (nothing written)
_WRITE = Lua("""
local c = redis.call('HGET', KEYS[1], ARGV[1])
if not c or string.sub(c, 1, #ARGV[2] + 1) ~= ARGV[2] .. ' ' then return 0 end
redis.call('HSET', KEYS[2], ARGV[4], ARGV[5])
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2] .. ' ' .. ARGV[3])
return 1
""")

# KEYS: claims, the group's hash. ARGV: group id, owner, expires, fields... Deletes the
# fields (an episode's deltas); 0: this owner no longer holds the group (nothing deleted)
_FORGET = Lua("""
local c = redis.call('HGET', KEYS[1], ARGV[1])
if not c or string.sub(c, 1, #ARGV[2] + 1) ~= ARGV[2] .. ' ' then return 0 end
for i = 4, #ARGV do redis.call('HDEL', KEYS[2], ARGV[i]) end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2] .. ' ' .. ARGV[3])
return 1
""")

# KEYS: claims, the group's hash. ARGV: group id, owner. 0: not this owner's any more
_DONE = Lua("""
local c = redis.call('HGET', KEYS[1], ARGV[1])
if not c or string.sub(c, 1, #ARGV[2] + 1) ~= ARGV[2] .. ' ' then return 0 end
redis.call('DEL', KEYS[2])
redis.call('HDEL', KEYS[1], ARGV[1])
return 1
""")

# KEYS: claims, the group's hash, the dead-letter stream, its once hash, its once list.
# ARGV: group id, owner, token, once cap, dead maxlen, then the entry's plain fields as
# name/value pairs. A group refused at take-over: its hash's raw fields copied into the
# dead-letter stream (XADD-once on the token), then the hash and the claim deleted, in
# one step. {entry id, 1}: dead-lettered now; {entry id, 0}: it was already (the hash
# and claim deleted all the same); 0: this owner no longer holds the group (nothing done)
_DEAD_LETTER = Lua("""
local c = redis.call('HGET', KEYS[1], ARGV[1])
if not c or string.sub(c, 1, #ARGV[2] + 1) ~= ARGV[2] .. ' ' then return 0 end
local id = redis.call('HGET', KEYS[4], ARGV[3])
local new = 0
if id then
  redis.call('HSET', KEYS[4], ARGV[3], id)
else
  local entry = {}
  for i = 6, #ARGV do table.insert(entry, ARGV[i]) end
  local all = redis.call('HGETALL', KEYS[2])
  if #all <= 6000 then  -- 3000 fields: unpack's limit is 8000 values
    for i = 1, #all, 2 do
      table.insert(entry, 'journal:' .. all[i])
      table.insert(entry, all[i + 1])
    end
    table.insert(entry, 'data')
    table.insert(entry, '')
  else  -- more fields than one XADD's arguments may hold: all of them, msgpack, in data
    local function u32(n)
      return string.char(math.floor(n / 16777216) % 256, math.floor(n / 65536) % 256,
                         math.floor(n / 256) % 256, n % 256)
    end
    local packed = {string.char(0xdd) .. u32(#all)}  -- an array of bin32 (cmsgpack: str)
    for i = 1, #all do table.insert(packed, string.char(0xc6) .. u32(#all[i]) .. all[i]) end
    table.insert(entry, 'journal')
    table.insert(entry, 'msgpack [name, value, ...] of ' .. (#all / 2) .. ' fields in data')
    table.insert(entry, 'data')
    table.insert(entry, table.concat(packed))
  end
  id = redis.call('XADD', KEYS[3], 'MAXLEN', '~', ARGV[5], '*', unpack(entry))
  redis.call('HSET', KEYS[4], ARGV[3], id)
  redis.call('RPUSH', KEYS[5], ARGV[3])
  if redis.call('LLEN', KEYS[5]) > tonumber(ARGV[4]) then
    redis.call('HDEL', KEYS[4], redis.call('LPOP', KEYS[5]))
  end
  new = 1
end
redis.call('DEL', KEYS[2])
redis.call('HDEL', KEYS[1], ARGV[1])
return {id, new}
""")

# KEYS: claims. ARGV: owner, expires, group ids... The ids no longer this owner's.
_RENEW = Lua("""
local lost = {}
for i = 3, #ARGV do
  local c = redis.call('HGET', KEYS[1], ARGV[i])
  if c and string.sub(c, 1, #ARGV[1] + 1) == ARGV[1] .. ' ' then
    redis.call('HSET', KEYS[1], ARGV[i], ARGV[1] .. ' ' .. ARGV[2])
  else
    table.insert(lost, ARGV[i])
  end
end
return lost
""")

# KEYS: claims. ARGV: owner, this actor's name, now, expires. The group taken over (its
# lease ran out, or an earlier incarnation of this actor name owned it), or false.
_CLAIM = Lua("""
local all = redis.call('HGETALL', KEYS[1])
for i = 1, #all, 2 do
  local owner, expires = string.match(all[i + 1], '^(.*) ([%d%.]+)$')
  local name = owner and string.match(owner, '^(.*)/[^/]*$')
  if owner and owner ~= ARGV[1] and (tonumber(expires) < tonumber(ARGV[3]) or name == ARGV[2]) then
    redis.call('HSET', KEYS[1], all[i], ARGV[1] .. ' ' .. ARGV[4])
    return all[i]
  end
end
return false
""")

_FIELD = re.compile(r"(\d+):(\d+)", re.ASCII)  # <episode>:<write>


def field_name(index: int, seq: int) -> str:
    """The group hash's field of episode ``index``'s delta ``seq``."""
    return f"{index}:{seq}"


class EpisodeState(msgspec.Struct, kw_only=True):
    """Episode ``index`` of a group as its deltas ``0..deltas-1`` assemble it
    (:func:`assemble`; never written whole): every id after the prompt, its mask, the
    sampled ids' log-probs, versions and sampling masks, where each turn starts, the
    tool outcomes so far, and its last delta's counters and environment state."""

    index: int
    deltas: int  # the deltas it holds (the next write's ``seq``)
    turns: int
    ids: bytes  # int32
    mask: bytes  # uint8 per id
    logprobs: bytes  # float32 per sampled id
    versions: bytes  # int32 RLE pairs per sampled id
    mask_ids: bytes = b""
    mask_counts: bytes = b""
    offsets: bytes = b""  # int32
    outcomes: list[str] = msgspec.field(default_factory=list)
    reward: float = 0.0
    done: bool = False
    finished: bool = False
    infra: bool = False
    exact: bool = True
    observed: int = 0
    tool_calls: int = 0
    tool_s: float = 0.0
    env_state: bytes = b""


def episode_delta(ep, index: int, env_state: bytes) -> EpisodeDelta:
    """What episode ``ep`` (actor/episodes.py Episode) added since its last write
    (``ep.journaled``): the next delta of episode ``index``."""
    w = ep.journaled
    mask_ids, mask_counts = pack_mask(ep.kept[w.sampled :])
    return EpisodeDelta(
        schema=SCHEMA_VERSION,
        index=index,
        seq=w.deltas,
        turns=len(ep.offsets),
        start=w.ids,
        ids=pack_i32(ep.ids[w.ids :]),
        mask=pack_u8(ep.mask[w.ids :]),
        logprobs=pack_f32(ep.logprobs[w.sampled :]),
        versions=rle_encode(ep.versions[w.sampled :]),
        mask_ids=mask_ids,
        mask_counts=mask_counts,
        offsets=pack_i32(ep.offsets[w.offsets :]),
        outcomes=list(ep.outcomes[w.outcomes :]),
        reward=float(ep.reward),
        done=ep.done,
        finished=ep.finished,
        infra=ep.infra,
        exact=ep.exact,
        observed=ep.observed,
        tool_calls=ep.tools.calls,
        tool_s=ep.tools.seconds,
        env_state=env_state,
    )


class _Assembly:
    """An episode as its deltas so far build it (:func:`assemble`)."""

    def __init__(self):
        self.ids, self.mask, self.logprobs, self.versions = (bytearray() for _ in range(4))
        self.mask_ids, self.mask_counts = bytearray(), bytearray()
        self.offsets: list[int] = []
        self.outcomes: list[str] = []
        self.sampled = 0
        self.last: EpisodeDelta | None = None

    def add(self, d: EpisodeDelta) -> None:
        """Apply delta ``d``; BadEntry (the reason) when it does not fit."""
        if self.last is not None and self.last.done:
            raise BadEntry("it follows the delta that ended the episode")
        held = len(self.mask)
        if not 0 <= d.start <= held:
            raise BadEntry(f"it starts after id {d.start}; the deltas before it hold {held}")
        if 1 in self.mask[d.start :]:
            raise BadEntry(f"it takes back sampled ids (it keeps {d.start} of {held} ids)")
        new = bytes(d.mask)
        n_ids, n_sampled = len(unpack_i32(d.ids)), new.count(1)
        if n_ids != len(new) or new.count(0) + n_sampled != len(new):
            raise BadEntry(f"it has {n_ids} ids and {len(new)} mask values (0 or 1 each)")
        n_logprobs, n_versions = len(unpack_f32(d.logprobs)), rle_decode(d.versions).size
        if n_logprobs != n_sampled or n_versions != n_sampled:
            raise BadEntry(
                f"it has {n_logprobs} log-probs and {n_versions} versions for {n_sampled} "
                "sampled ids"
            )
        if d.mask_ids or d.mask_counts:
            unpack_mask(d.mask_ids, d.mask_counts, n_sampled)
        added = unpack_i32(d.offsets).tolist()
        del self.mask[d.start :], self.ids[4 * d.start :]
        self.mask += new
        self.ids += d.ids
        for o in added:
            after = not self.offsets or o > self.offsets[-1]
            if not (d.start <= o < len(self.mask) and self.mask[o] == 1 and after):
                raise BadEntry(f"its turn offset {o} is not where one of its turns starts")
            self.offsets.append(o)
        if len(self.offsets) != d.turns:
            raise BadEntry(f"it says {d.turns} turns; the deltas hold {len(self.offsets)}")
        self.logprobs += d.logprobs
        self.versions += d.versions
        self.mask_ids += d.mask_ids
        self.mask_counts += d.mask_counts
        self.outcomes += d.outcomes
        self.sampled += n_sampled
        self.last = d


def assemble(index: int, writes: dict[int, bytes]) -> EpisodeState:
    """Episode ``index`` from its deltas (``seq`` -> the payload as written), applied
    in order; BadEntry with the reason when they leave a gap, do not decode or do not
    fit."""
    seqs = sorted(writes)
    if not seqs:
        raise BadEntry(f"episode {index} has no delta")
    if seqs != list(range(len(seqs))):
        missing = next(n for n in range(len(seqs)) if n not in writes)
        raise BadEntry(
            f"episode {index} has deltas {seqs}: delta {missing} is missing (a gap in its turns)"
        )
    a = _Assembly()
    for n in seqs:
        try:
            d = decode(writes[n], EpisodeDelta)
            if (d.index, d.seq) != (index, n):
                raise BadEntry(f"it holds episode {d.index}'s delta {d.seq}")
            a.add(d)
        except BadEntry as e:
            raise BadEntry(f"episode {index}'s delta {n}: {e}") from None
    if a.mask_counts:
        try:
            unpack_mask(bytes(a.mask_ids), bytes(a.mask_counts), a.sampled)
        except BadEntry as e:
            raise BadEntry(f"episode {index}'s sampling masks: {e}") from None
    last = a.last
    return EpisodeState(
        index=index,
        deltas=len(seqs),
        turns=len(a.offsets),
        ids=bytes(a.ids),
        mask=bytes(a.mask),
        logprobs=bytes(a.logprobs),
        versions=rle_encode(rle_decode(bytes(a.versions))),
        mask_ids=bytes(a.mask_ids),
        mask_counts=bytes(a.mask_counts),
        offsets=pack_i32(a.offsets),
        outcomes=a.outcomes,
        reward=last.reward,
        done=last.done,
        finished=last.finished,
        infra=last.infra,
        exact=last.exact,
        observed=last.observed,
        tool_calls=last.tool_calls,
        tool_s=last.tool_s,
        env_state=last.env_state,
    )


def restore_episode(ep, st: EpisodeState) -> None:
    """Give the fresh episode ``ep`` everything ``st`` holds (its environment aside)."""
    ep.ids = unpack_i32(st.ids).tolist()
    ep.mask = np.frombuffer(st.mask, dtype=np.uint8).astype(int).tolist()
    ep.logprobs = unpack_f32(st.logprobs).tolist()
    ep.versions = rle_decode(st.versions).tolist()
    kept = unpack_mask(st.mask_ids, st.mask_counts, len(ep.logprobs))
    ep.kept = [k.tolist() for k in kept] if kept is not None else []
    ep.offsets = unpack_i32(st.offsets).tolist()
    ep.outcomes = list(st.outcomes)
    ep.reward, ep.done, ep.finished = st.reward, st.done, st.finished
    ep.infra, ep.exact, ep.observed = st.infra, st.exact, st.observed
    ep.tools.calls, ep.tools.seconds = st.tool_calls, st.tool_s
    n = sum(ep.mask)
    if len(ep.ids) != len(ep.mask) or len(ep.logprobs) != n or len(ep.versions) != n:
        raise BadEntry(
            f"journal of episode {st.index}: {len(ep.ids)} ids, {len(ep.mask)} mask values, "
            f"{len(ep.logprobs)} log-probs and {len(ep.versions)} versions for {n} sampled ids"
        )
    ep.mark_journaled(st.deltas)  # its next write is delta ``st.deltas``, after these


def pack_env_state(env) -> bytes:
    """``env.state()`` as msgpack, or b"" for an environment that is not resumable."""
    if not getattr(env, "resumable", False):
        return b""
    return msgspec.msgpack.encode(env.state())


def unpack_env_state(data: bytes):
    return msgspec.msgpack.decode(data)


class Taken(msgspec.Struct):
    """A group taken over: how it was opened, each episode assembled from its deltas,
    the episodes whose deltas were refused (index -> the reason: they restart), and the
    fields each episode's deltas are in (those of an episode that restarts are deleted:
    :meth:`Journal.forget`)."""

    opened: EpisodeOpen
    states: dict[int, EpisodeState]
    refused: dict[int, str] = msgspec.field(default_factory=dict)
    fields: dict[int, list[str]] = msgspec.field(default_factory=dict)


def read_group(fields: dict) -> Taken:
    """A group's hash as HGETALL gives it: its opening and its episodes, each assembled
    from its deltas or refused with the reason. BadEntry when the group itself cannot
    be read: no ``open`` field, one that does not decode or is of another schema, or a
    field other than ``<k>:<n>`` of one of its episodes."""
    fields = {k.decode() if isinstance(k, bytes) else k: v for k, v in fields.items()}
    if "open" not in fields:
        raise BadEntry("no 'open' field (the group's opening was never written)")
    opened = decode(fields.pop("open"), EpisodeOpen)
    writes: dict[int, dict[int, bytes]] = {}
    names: dict[int, list[str]] = {}
    for name, data in sorted(fields.items()):
        m = _FIELD.fullmatch(name)
        if m is None or int(m[1]) >= opened.group_size:
            raise BadEntry(
                f"field {name!r} is not <episode>:<delta> of one of its {opened.group_size} "
                "episodes"
            )
        k = int(m[1])
        writes.setdefault(k, {})[int(m[2])] = data
        names.setdefault(k, []).append(name)
    states, refused = {}, {}
    for k in sorted(writes):
        try:
            states[k] = assemble(k, writes[k])
        except BadEntry as e:
            refused[k] = str(e)
    return Taken(opened, states, refused, names)


class Journal:
    """One actor's side of the episode journal (module doc)."""

    def __init__(
        self,
        client,
        names,
        actor: str,
        lease_s: float,
        dead_maxlen: int = 10000,
        on_dead_letter=None,
    ):
        self.client, self.names, self.actor, self.lease_s = client, names, actor, lease_s
        self.dead_maxlen = dead_maxlen  # redis.dead_letter_maxlen
        # told (group id, reason) of each group this actor dead-lettered (:meth:`dead_letter`)
        self.on_dead_letter = on_dead_letter
        self.owner = f"{actor}/{uuid.uuid4().hex[:8]}"  # this incarnation
        self.claims = names.episode_claims
        self.held: set[str] = set()  # group ids this incarnation runs
        self.lost: set[str] = set()  # group ids another actor took over
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._renewer = threading.Thread(target=self._renew_loop, name="journal", daemon=True)
        self._renewer.start()

    def key(self, group_id: str) -> str:
        return self.names.episode(group_id)

    def _expires(self) -> float:
        return time.time() + self.lease_s

    def open(self, group_id: str, problem, prompt: list[int], group_size: int) -> None:
        opened = EpisodeOpen(
            schema=SCHEMA_VERSION,
            group_id=group_id,
            actor=self.actor,
            problem=problem,
            prompt_ids=pack_i32(prompt),
            group_size=group_size,
        )
        with self._lock:
            self.held.add(group_id)
        args = [group_id, self.owner, self._expires(), encode(opened)]
        _OPEN(self.client, [self.claims, self.key(group_id)], args)

    def write(self, group_id: str, delta: EpisodeDelta) -> bool:
        """Write episode ``delta.index``'s delta ``delta.seq`` (field ``<k>:<n>``); False
        (and nothing written) when another actor took the group over."""
        field = field_name(delta.index, delta.seq)
        args = [group_id, self.owner, self._expires(), field, encode(delta)]
        if _WRITE(self.client, [self.claims, self.key(group_id)], args):
            return True
        self._taken_away([group_id])
        return False

    def forget(self, group_id: str, fields: list[str]) -> bool:
        """Delete ``fields`` (the deltas of an episode that restarts: it writes anew
        from delta 0); False (nothing deleted) when another actor took the group over."""
        if not fields:
            return True
        args = [group_id, self.owner, self._expires(), *fields]
        if _FORGET(self.client, [self.claims, self.key(group_id)], args):
            return True
        self._taken_away([group_id])
        return False

    def done(self, group_id: str) -> None:
        """The group is published: its journal goes."""
        with self._lock:
            self.held.discard(group_id)
        _DONE(self.client, [self.claims, self.key(group_id)], [group_id, self.owner])

    def take_over(self) -> Taken | None:
        """A group another actor left (lease run out, or an earlier incarnation of this
        actor), now this one's, with what was written of it; None when there is none."""
        while True:
            args = [self.owner, self.actor, time.time(), self._expires()]
            gid = _CLAIM(self.client, [self.claims], args)
            if gid is None:
                return None
            gid = gid.decode() if isinstance(gid, bytes) else gid
            try:
                taken = read_group(self.client.hgetall(self.key(gid)))
            except (BadEntry, ValueError) as e:
                # nothing to go on from: dead-lettered whole, with the reason; next group
                self.dead_letter(gid, str(e))
                continue
            with self._lock:
                self.held.add(gid)
            for k, why in sorted(taken.refused.items()):
                log.error(
                    "episode group %s: episode %d cannot be resumed: %s; it restarts from reset",
                    gid,
                    k,
                    why,
                )
            log.warning(
                "taking over episode group %s (opened by %s; %d episodes written, %d refused)",
                gid,
                taken.opened.actor,
                len(taken.states),
                len(taken.refused),
            )
            return taken

    def dead_letter(self, group_id: str, reason: str) -> bool:
        """A group this incarnation took over and cannot go on from (``reason``): its
        hash's raw fields copied into ``<run>:dead`` (role ``actor``, source the hash's
        key, ``journal:<field>`` per field, XADD-once on the group id), then the hash
        and the claim deleted, in one script; ``on_dead_letter(group id, reason)`` is
        told (the actor's record and counters). True when this call dead-lettered it;
        False when the group is no longer this incarnation's (another actor took it over
        meanwhile: nothing done) or was dead-lettered already (not again)."""
        log.error(
            "episode group %s cannot be taken over: %s; dead-lettered (%s)",
            group_id,
            reason,
            self.names.dead,
        )
        key = self.key(group_id)
        entry = {
            "source": key,
            "id": "",
            "consumer": self.actor,
            "role": "actor",
            "reason": f"episode group cannot be taken over: {reason}",
            "group": group_id,
        }
        once, order = once_keys(self.names.dead)
        args: list = [group_id, self.owner, f"episodes:{group_id}", ONCE_CAP, self.dead_maxlen]
        for name, value in entry.items():
            args += [name, value]
        reply = _DEAD_LETTER(
            self.client,
            [self.claims, key, self.names.dead, once, order],
            args,
            f"dead-lettering episode group {group_id}",
        )
        with self._lock:
            self.held.discard(group_id)
        if not reply:
            log.warning("episode group %s was taken over by another actor meanwhile", group_id)
            return False
        if not int(reply[1]):
            log.warning("episode group %s was dead-lettered already", group_id)
            return False
        if self.on_dead_letter is not None:
            self.on_dead_letter(group_id, reason)
        return True

    def close(self) -> None:
        self._stop.set()
        self._renewer.join(timeout=5)

    def _taken_away(self, ids: list[str]) -> None:
        with self._lock:
            for gid in ids:
                if gid in self.held:
                    log.warning("episode group %s was taken over by another actor", gid)
                self.held.discard(gid)
                self.lost.add(gid)

    def _renew_loop(self) -> None:
        while not self._stop.wait(self.lease_s / 3):
            with self._lock:
                held = sorted(self.held)
            if not held:
                continue
            try:
                lost = _RENEW(self.client, [self.claims], [self.owner, self._expires(), *held])
            except Exception as e:  # the next round tries again; the lease is 3 rounds
                log.warning("renewing the episode groups' lease failed: %s", e)
                continue
            if lost:
                self._taken_away([g.decode() if isinstance(g, bytes) else g for g in lost])
