"""Every stream and key name of a run, and the form of its entry ids.

Streams and keys are named ``<prefix>:<run>:<name>`` (:class:`Names`); in
``redis.mode=cluster`` the run part is a Redis Cluster hash tag, ``{<run>}`` for the
control keys and ``{<run>.p<k>}`` for partition k's work streams (:meth:`Names.part`), so
every script and transaction touches one slot. An entry holds
a few plain fields an operator can read with ``redis-cli XRANGE`` beside the binary
``DATA`` payload; entry ids are ``ms-seq`` (:func:`id_tuple` orders them).
"""

from __future__ import annotations

from pipeline.streams.durable import once_keys

DATA = b"data"  # the field holding an entry's encoded message
SHARDED = ("rollouts", "batches")  # the partitioned streams (pipeline/streams/shards.py)


class Names:
    """Every stream and key name of one run, in one place: ``<prefix>:<run>:<name>``.

    Pools, the launcher, inspect and the benchmarks use these properties, never a
    raw string, so a renamed stream or key changes here only (and in the key
    patterns of deploy/redis/users.acl).
    """

    STREAMS = ("rollouts", "batches", "weights", "joins", "dead")  # every run has these
    ROLLOUTS_GROUP = "preprocessor"  # the consumer group reading rollouts
    BATCHES_GROUP = "trainer"  # the consumer group reading batches

    def __init__(self, prefix: str, run: str, cluster: bool = False, partition: int = 0):
        if cluster and ("{" in run or "}" in run or "{" in prefix or "}" in prefix):
            raise ValueError(
                f"run.name={run!r} / redis.prefix={prefix!r} may not contain '{{' or '}}' in "
                "redis.mode=cluster: the key names carry a hash tag {run}; rename the run"
            )
        self.prefix, self.run, self.cluster, self.partition = prefix, run, cluster, partition
        # cluster: control keys in slot {run}, partition k's work streams in {run.pk}
        self.base = f"{prefix}:{{{run}}}" if cluster else f"{prefix}:{run}"
        self.work_base = f"{prefix}:{{{run}.p{partition}}}" if cluster else self.base

    @classmethod
    def of(cls, cfg) -> Names:
        """The run's names from its config (``redis.prefix``, ``run.name``, and hash
        tags when ``redis.mode=cluster``)."""
        mode = getattr(cfg.redis, "mode", "single")
        return cls(cfg.redis.prefix, cfg.run.name, cluster=mode == "cluster")

    def part(self, k: int) -> Names:
        """The names of partition ``k``: its work streams (rollouts, batches and their
        once keys) are ``<prefix>:{<run>.p<k>}:...`` in cluster mode, every other name is
        the run's; without cluster mode there is one part, with the run's names."""
        return Names(self.prefix, self.run, self.cluster, k) if self.cluster else self

    def stream(self, name: str) -> str:
        if name in SHARDED:  # the work streams: partition k's slot in cluster mode
            return f"{self.work_base}:{name}"
        return f"{self.base}:{name}"

    def key(self, name: str) -> str:
        return f"{self.base}:{name}"

    # ---- streams
    @property
    def rollouts(self) -> str:  # actor -> preprocessor: one RolloutGroup per entry
        return self.stream("rollouts")

    @property
    def batches(self) -> str:  # preprocessor -> trainer: one TrainBatch per entry
        return self.stream("batches")

    @property
    def weights(self) -> str:  # trainer -> actors: WeightAnnouncement per version
        return self.stream("weights")

    @property
    def joins(self) -> str:  # actors -> trainer: signed requests to join the transfer group
        return self.stream("joins")

    @property
    def rollouts_once(self) -> str:  # hash: XADD-once token -> entry id (durable.py)
        return once_keys(self.rollouts)[0]

    @property
    def batches_once(self) -> str:
        return once_keys(self.batches)[0]

    @property
    def stats(self) -> str:
        return self.stream("stats")

    @property
    def dead(self) -> str:  # entries a consumer could not use, with the reason
        return self.stream("dead")

    @property
    def dead_once(self) -> str:  # hash: XADD-once token -> dead entry (a refused journal)
        return once_keys(self.dead)[0]

    # ---- keys
    @property
    def run_marker(self) -> str:  # hash set once per run; its absence means data lost
        return self.key("run")

    @property
    def episode_claims(self) -> str:  # hash: episode group id -> "<owner> <expires>"
        return self.key("episodes:claims")

    def episode(self, group_id: str) -> str:  # hash: an open episode group's journal
        return self.key(f"episodes:{group_id}")

    @property
    def trainer_version(self) -> str:  # the trainer's optimizer steps (policy version)
        return self.key("trainer_version")

    @property
    def published_version(self) -> str:  # the newest version some actor received
        return self.key("published_version")

    @property
    def samples_produced(self) -> str:  # samples XADDed by every actor (INCRBY)
        return self.key("samples_produced")

    @property
    def samples_retired(self) -> str:  # samples trained, dropped or rejected (INCRBY)
        return self.key("samples_retired")

    @property
    def retired_recent(self) -> str:  # sorted set: groups the preprocessors retired lately
        return self.key("retired_recent")

    @property
    def rendezvous(self) -> str:  # hash: the trainer's transfer address, port, epoch
        return self.key("rendezvous")

    @property
    def sync_claims(self) -> str:  # hash: pipeline.mode=sync claims per actor
        return self.key("sync_claims")

    @property
    def faults_probe(self) -> str:  # pipeline.bench faults: a write timed across a failover
        return self.key("faults_probe")

    def status(self, pool: str) -> str:  # hash: a pool's heartbeat and counters
        return self.key(f"status:{pool}")


def id_tuple(entry_id: str | bytes) -> tuple[int, int]:
    """An entry id ``ms-seq`` as (ms, seq), which orders like the stream."""
    if isinstance(entry_id, bytes):
        entry_id = entry_id.decode()
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)
