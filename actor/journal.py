"""Episodes durable in Redis (``task.kind=env``): each finished turn is written as the
episode goes, and the groups of an actor that died are taken over from their last
finished turn by another actor, or by itself restarted.

::

    reads   <run>:episodes:claims (who owns each open group, until when);
            <run>:episodes:<group id> of a group it takes over
    writes  <run>:episodes:claims (its lease on each group it runs, renewed every
            lease/3 seconds by a thread of its own); <run>:episodes:<group id>: field
            ``open`` (EpisodeOpen: the problem, the shared prompt) when the group opens,
            field ``<k>`` (EpisodeState: episode k's ids, mask, log-probs, versions,
            offsets, outcomes, reward, tool budget spent and, for a resumable
            environment, its ``state()``) after each of episode k's finished turns;
            both deleted once the group is published
    blocks  on nothing but the Redis calls (Lua scripts: atomic, and under the actor's
            ACL, deploy/redis/users.acl)

The claim is the actors' claim pattern (actor/room.py's sync claims: ``owner expires``
in a hash, checked in Lua): a group is owned by ``<actor name>/<incarnation>``; its
lease is ``task.episode.takeover_s``. An actor asks :meth:`Journal.take_over` before
it opens a new group: a group whose lease ran out (its actor died, or hangs), or one
owned by an earlier incarnation of this same actor name (a restarted actor takes its
own groups back at once), becomes this actor's, and it goes on from the written
turns: the ids, log-probs and versions already written are kept exactly, so the
published episode starts with the prefix that was written. A resumable environment is
rebuilt with ``restore(problem, state)``; any other restarts its episode from
``reset`` (``episodes_restarted``), as does an episode that had no finished turn.

A write is fenced: it lands only while this incarnation still owns the group (a slow
actor whose group was taken over writes nothing more and is told so). Publishing is
XADD-once on the group id the journal holds, so a group published by two actors (the
old one woke up) is one entry in ``rollouts`` and is counted once.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid

import msgspec
import numpy as np

from pipeline.messages import (
    SCHEMA_VERSION,
    BadEntry,
    EpisodeOpen,
    EpisodeState,
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

log = logging.getLogger("actor")

# KEYS: claims, the group's hash. ARGV: group id, owner, expires, EpisodeOpen
_OPEN = Lua("""
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2] .. ' ' .. ARGV[3])
redis.call('HSET', KEYS[2], 'open', ARGV[4])
return 1
""")

# KEYS: claims, the group's hash. ARGV: group id, owner, expires, field, EpisodeState.
# 0: this owner no longer holds the group (nothing written)
_WRITE = Lua("""
local c = redis.call('HGET', KEYS[1], ARGV[1])
if not c or string.sub(c, 1, #ARGV[2] + 1) ~= ARGV[2] .. ' ' then return 0 end
redis.call('HSET', KEYS[2], ARGV[4], ARGV[5])
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


def episode_state(ep, index: int, env_state: bytes) -> EpisodeState:
    """What the journal holds of episode ``ep`` (actor/episodes.py Episode)."""
    mask_ids, mask_counts = pack_mask(ep.kept)
    return EpisodeState(
        schema=SCHEMA_VERSION,
        index=index,
        turns=len(ep.offsets),
        ids=pack_i32(ep.ids),
        mask=pack_u8(ep.mask),
        logprobs=pack_f32(ep.logprobs),
        versions=rle_encode(ep.versions),
        mask_ids=mask_ids,
        mask_counts=mask_counts,
        offsets=pack_i32(ep.offsets),
        outcomes=list(ep.outcomes),
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


def pack_env_state(env) -> bytes:
    """``env.state()`` as msgpack, or b"" for an environment that is not resumable."""
    if not getattr(env, "resumable", False):
        return b""
    return msgspec.msgpack.encode(env.state())


def unpack_env_state(data: bytes):
    return msgspec.msgpack.decode(data)


class Taken(msgspec.Struct):
    """A group taken over: how it was opened, and episode k's last written state."""

    opened: EpisodeOpen
    states: dict[int, EpisodeState]


class Journal:
    """One actor's side of the episode journal (module doc)."""

    def __init__(self, client, names, actor: str, lease_s: float):
        self.client, self.names, self.actor, self.lease_s = client, names, actor, lease_s
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

    def write(self, group_id: str, index: int, state: EpisodeState) -> bool:
        """Write episode ``index``'s state; False (and nothing written) when another
        actor took the group over."""
        args = [group_id, self.owner, self._expires(), str(index), encode(state)]
        if _WRITE(self.client, [self.claims, self.key(group_id)], args):
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
            fields = self.client.hgetall(self.key(gid))
            try:
                if b"open" not in fields:
                    raise BadEntry("no 'open' field (the group's opening was never written)")
                opened = decode(fields.pop(b"open"), EpisodeOpen)
                states = {int(k): decode(v, EpisodeState) for k, v in fields.items()}
            except (BadEntry, ValueError) as e:
                # nothing to go on from: the claim and whatever is left go, logged
                log.error("episode group %s cannot be taken over: %s; dropped", gid, e)
                _DONE(self.client, [self.claims, self.key(gid)], [gid, self.owner])
                continue
            with self._lock:
                self.held.add(gid)
            log.warning(
                "taking over episode group %s (opened by %s; %d episodes written)",
                gid,
                opened.actor,
                len(states),
            )
            return Taken(opened, states)

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
