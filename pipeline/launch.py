"""The launcher: ``python -m pipeline.launch +exp=math [key=value ...]``.

Composes the Hydra config, materializes the model once, starts an embedded
redis-server unless ``redis.url`` names one (``redis=ha``: a primary, a replica and
three sentinels, pipeline/topology/ha.py; ``redis=cluster``: a Redis Cluster of 3 primaries
with a replica each, pipeline/topology/cluster.py), spawns the pools as separate OS
processes (``python -m actor|preprocessor|trainer``) with per-process logs,
shows a live progress line, and stops everything cleanly: when the trainer
finishes, on Ctrl-C, or when a pool fails (naming it and showing its log). A finished
run gives the actors ``launch.final_sync_timeout_s`` to apply the last version, stops
them and the preprocessors, then gives the evaluator ``eval.final_timeout_s`` for the
final checkpoint before stopping the rest.
Writes ``config.yaml``, ``logs/``, ``metrics.jsonl``, ``checkpoints/`` and
``summary.json`` into the run directory.

Exit code: 0 when the trainer finished and every actor got its weights; 1 when a
pool failed, or when the trainer finished but the weights did not reach an actor
(pipeline/run/summary.py's rules; its outcome line names the actor); 130 on Ctrl-C or
SIGTERM; 2 for bad config or an unreachable Redis. Every pool runs in a process
group of its own, stopped whole at the end (pipeline/run/supervisor.py), so nothing a
pool started (vLLM's engine core and workers) outlives the run. The pools' environment
carries ``NONSTOP_RUN_DIR`` (this run's directory), so every process of the run,
whoever started it, can be found by it.
"""

from __future__ import annotations

import os
import secrets
import signal
import sys
import time

import hydra
import redis
from omegaconf import OmegaConf

from pipeline.config import (
    check_embedded_tls,
    check_experiment_sections,
    expand_shorthands,
    redis_tls,
    refuse_shard_urls,
    register,
    resolve_eager,
    resolve_engine,
    validate,
)
from pipeline.config.redis import MIGRATE_SHARDS
from pipeline.config.run import tcmalloc
from pipeline.evaluator import wait_for_final_eval
from pipeline.redisd.server import EmbeddedRedis, check_no_eviction
from pipeline.redisd.tls import ENV as TLS_ENV
from pipeline.redisd.tls import TLSFiles, make_run_certs
from pipeline.run.cpu_meter import cores, shares_text
from pipeline.run.progress import Progress
from pipeline.run.prometheus import Prometheus, check_metrics
from pipeline.run.summary import (
    newest_published,
    wait_for_final_sync,
    write_summary,
)
from pipeline.run.supervisor import RedisNotRestarted, Supervisor
from pipeline.streams import DRAIN_FIELD, Names, RedisUnavailable, connect, mark_run
from pipeline.streams.shards import Shards
from pipeline.telemetry import read_statuses
from pipeline.topology.cluster import start_local_cluster
from pipeline.topology.ha import start_local_ha

register()
CONF_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "conf")


def trainer_names(cfg) -> list[str]:
    """The trainer's ranks in order: ``trainer``, ``trainer-1``, ... (the names trainer/main.py
    ``rank_argv`` gives them; status hashes, logs and consumer names carry them)."""
    return ["trainer"] + [f"trainer-{r}" for r in range(1, cfg.trainer.world_size)]


# the pools a finished run stops once every actor has the last version, before the final
# evaluation (pool_commands' names)
DONE_AT_SYNC = ("actor-", "preprocessor-")
SYNCED = "every actor has the last version"  # their stop records say it


def preload_malloc(choice: str, env: dict[str, str]) -> str | None:
    """``launch.malloc``: the pools run on tcmalloc (LD_PRELOAD in their environment, so
    vLLM's engine processes too) where it is installed (auto) or required (tcmalloc, checked
    with the config); system: glibc's. Returns the library preloaded. On the default job
    here: 173.9 s against 191.6 s on glibc, medians of 3 interleaved rounds (README,
    *Cores on one machine*)."""
    lib = None if choice == "system" else tcmalloc()
    if lib is None:
        return None
    have = env.get("LD_PRELOAD", "").split()
    if not any("tcmalloc" in x for x in have):
        env["LD_PRELOAD"] = " ".join([lib, *have])
    print(f"launch.malloc={choice}: the pools run on tcmalloc ({lib}, LD_PRELOAD)", flush=True)
    return lib


def final_scrape(cfg, prom: Prometheus, client, names: Names) -> None:
    """Let Prometheus scrape every pool once more (their final values)."""
    prom.update(read_statuses(client, names))
    time.sleep(2 * float(cfg.metrics.prometheus_scrape_s) + 0.5)


def pool_commands(cfg, config_path: str) -> dict[str, list[str]]:
    """name -> argv for every process of the run, the trainer's ranks first."""
    py = [sys.executable, "-m"]
    cmds = {
        name: py + ["trainer", "--config", config_path, "--name", name]
        for name in trainer_names(cfg)
    }
    for i in range(cfg.preprocessor.num_workers):
        name = f"preprocessor-{i}"
        cmds[name] = py + ["preprocessor", "--config", config_path, "--name", name]
    for i in range(cfg.actor.num_actors):
        name = f"actor-{i}"
        cmds[name] = py + ["actor", "--config", config_path, "--name", name]
    if cfg.eval.every_steps or cfg.eval.every_s:  # periodic held-out evaluation
        cmds["evaluator"] = py + ["pipeline.evaluator", "--config", config_path]
    return cmds


def supervise(
    cfg, sup: Supervisor, client, names: Names, prom: Prometheus | None = None
) -> tuple[str, int]:
    """Run until the trainer finishes, the run fails or Ctrl-C; return (outcome, code).
    ``prom``: its targets follow the pools' endpoints (a restarted pool's new port)."""
    progress = Progress(cfg.trainer.max_steps)
    try:
        while True:
            sup.check_redis()  # first: only the launcher can bring it back
            try:
                statuses = read_statuses(client, names)
                progress.published = newest_published(client, names)
                if prom is not None:
                    prom.update(statuses)
            except (redis.ConnectionError, redis.TimeoutError) as e:
                print(f"\nredis unreachable from the launcher ({e}); retrying", flush=True)
                statuses = {}
            done = sup.check(statuses)
            progress.cpu = shares_text(sup.cpu.recent, cores())
            progress.update(statuses)
            if done:
                progress.close()
                return done
            sup.wait_for_exit(cfg.launch.progress_interval_s)  # a pool's exit: a round now
    except KeyboardInterrupt:
        progress.close()
        print("\ninterrupted: stopping every pool")
        return "interrupted", 130


def refuse_sharded_run_dir(run_dir: str) -> None:
    """A run directory an older version ran with independent-instance shards (its
    ``redis-shardK/`` servers, or a saved config.yaml with ``redis.shards`` > 1 outside
    cluster mode): its checkpoints' read positions name those instances' streams, which
    no cluster partition holds, so it is refused instead of resumed."""
    found = sorted(d for d in os.listdir(run_dir) if d.startswith("redis-shard"))
    saved = os.path.join(run_dir, "config.yaml")
    if not found and os.path.exists(saved):
        old = OmegaConf.load(saved)
        n = OmegaConf.select(old, "redis.shards") or 1
        if n > 1 and (OmegaConf.select(old, "redis.mode") or "single") != "cluster":
            found = [f"config.yaml redis.shards={n}"]
    if found:
        raise ValueError(
            f"{run_dir} is a run with independent-instance shards ({', '.join(found)}): "
            f"{MIGRATE_SHARDS}; its checkpoints' read positions name the old instances' "
            "streams: finish it with the version that started it, or launch into a new "
            "run directory"
        )


def cli_recipe(run_dir: str, port: int, tls: TLSFiles | None) -> str:
    """The redis-cli command line for the embedded server (deploy/README.md: "Looking inside a
    live run with redis-cli"), with ``--tls --cacert ...`` when it speaks TLS."""
    cmd = f'redis-cli -p {port} -a "$(cat {run_dir}/redis/auth)" --no-auth-warning'
    return f"{cmd} {tls.cli_args()}" if tls else cmd


def _interrupt(signum, _frame) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)


def _keep_stopping() -> None:
    def again(signum, _frame) -> None:
        print(f"\nsignal {signum} again: still stopping every pool", flush=True)

    signal.signal(signal.SIGINT, again)
    signal.signal(signal.SIGTERM, again)


def run(cfg) -> int:
    for chosen in (resolve_engine(cfg), resolve_eager(cfg)):  # auto: what, and why
        if chosen:
            print(chosen)
    # a Redis of the operator's: NONSTOP_REDIS_URL wins over redis.url, as in every pool
    # (pipeline/config/env.py); it is checked as redis.url is but never saved in config.yaml
    external = os.environ.get("NONSTOP_REDIS_URL") or cfg.redis.url
    validate(OmegaConf.merge(cfg, {"redis": {"url": external}}) if external else cfg)
    refuse_shard_urls()  # NONSTOP_REDIS_SHARD_URLS: replaced by redis.mode=cluster
    if not external:
        check_embedded_tls(cfg)
    check_metrics(cfg)  # metrics.http / metrics.prometheus: refused before anything starts
    if cfg.metrics.prometheus:
        cfg.metrics.http.enabled = True  # every pool answers /metrics for it
    # Ctrl-C and a service manager's SIGTERM both stop the run cleanly, even when
    # this process inherited an ignored SIGINT (started in the background)
    signal.signal(signal.SIGINT, _interrupt)
    signal.signal(signal.SIGTERM, _interrupt)
    from pipeline.models import materialize_model

    run_dir = os.path.abspath(cfg.run_dir or time.strftime("outputs/%Y-%m-%d_%H-%M-%S"))
    os.makedirs(run_dir, exist_ok=True)
    refuse_sharded_run_dir(run_dir)  # before config.yaml is written over
    cfg.run_dir = run_dir
    print(f"run directory: {run_dir}")
    client_tls = redis_tls(cfg, external) if external else None
    # fail early: an unreachable Redis, or a TLS mismatch, before the model is materialized
    client = connect(external, reconnect_s=2.0, tls=client_tls) if external else None
    print(f"model: {cfg.model.name} (materializing once for every pool)")
    cfg.model.path = materialize_model(cfg.model.name)
    config_path = os.path.join(run_dir, "config.yaml")
    OmegaConf.save(cfg, config_path)
    # everything this run starts is stopped on every way out: an error, Ctrl-C or SIGTERM
    # at any point (while Redis or the pools start too), a second signal while stopping
    server, env, tls, sup, prom = None, dict(os.environ), None, None, None
    try:
        if external:
            url = external
        elif cfg.redis.mode in ("sentinel", "cluster"):  # redis=ha: primary, replica, sentinels;
            for var in TLS_ENV.values():  # redis=cluster: 3 primaries with a replica each
                env.pop(var, None)
            begin = start_local_ha if cfg.redis.mode == "sentinel" else start_local_cluster
            server = begin(cfg, run_dir)  # redis.tls=true: TLS only, with the run's certificates
            url, client_tls = server.url, server.client_tls
            if client_tls is not None:
                env.update(client_tls.env())  # the pools' rediss+... client files
            for role, role_url in getattr(server, "role_urls", {}).items():  # redis.acl_file
                env[f"NONSTOP_REDIS_URL_{role.upper()}"] = role_url  # each pool its own user
        else:
            for var in TLS_ENV.values():  # files of some other Redis: not this run's
                env.pop(var, None)
            if cfg.redis.tls.enabled:  # TLS only: a CA, server and client certificates per run
                tls = make_run_certs(os.path.join(run_dir, "redis", "tls"))
                client_tls = tls[1]
                env.update(client_tls.env())  # the pools' rediss:// client files
            server = EmbeddedRedis(
                os.path.join(run_dir, "redis"), cfg.redis.embedded_appendfsync, tls=tls
            )
            server.start()
            url = server.url
            tls_note = f", TLS only (certificates in {run_dir}/redis/tls)" if tls else ""
            print(
                f"embedded redis-server on 127.0.0.1:{server.port}{tls_note} (password in "
                f"{run_dir}/redis/auth, AOF in {run_dir}/redis)\n"
                f"  redis-cli: {cli_recipe(run_dir, server.port, client_tls)}"
            )
            with open(os.path.join(run_dir, "redis", "auth"), "w") as f:
                os.chmod(f.name, 0o600)
                f.write(server.password + "\n")
            with open(os.path.join(run_dir, "redis", "port"), "w") as f:
                f.write(f"{server.port}\n")
        env["NONSTOP_REDIS_URL"] = url
        preload_malloc(cfg.launch.malloc, env)  # the pools only: redis-server has its own
        env["NONSTOP_RUN_DIR"] = run_dir  # marks every process of the run (and its children)
        env.setdefault("NONSTOP_RUN_SECRET", secrets.token_hex(16))
        client = client or connect(url, reconnect_s=2.0, tls=client_tls)
        names = Names.of(cfg)
        shards = Shards.of(cfg, client, names)  # redis.mode=cluster: redis.shards partitions
        check_no_eviction(client)
        mark_run(client, names, run_dir=run_dir)
        client.delete(names.rendezvous)  # a previous trainer's address is stale now
        if client.hget(names.run_marker, DRAIN_FIELD) is not None:  # drained (actor/room.py)
            client.hdel(names.run_marker, DRAIN_FIELD)  # and launched again: it produces again
        cmds = pool_commands(cfg, config_path)
        sup = Supervisor(cfg, run_dir, env, cmds, server, groups={"trainer": trainer_names(cfg)})
        prom = Prometheus(cfg, run_dir) if cfg.metrics.prometheus else None
        if prom is not None:
            prom.start()
            print(
                f"prometheus: {prom.url} (scraping every pool every "
                f"{cfg.metrics.prometheus_scrape_s}s; storage in {prom.dir}/data)",
                flush=True,
            )
        start = time.time()
        try:
            sup.spawn_all()
        except KeyboardInterrupt:  # Ctrl-C or SIGTERM while the pools start: stop those started
            print("\ninterrupted while starting the pools: stopping every pool", flush=True)
            outcome, code = "interrupted", 130
        else:
            outcome, code = supervise(cfg, sup, client, names, prom)
        if outcome == "finished":
            try:
                wait_for_final_sync(client, names, cfg, cfg.trainer.max_steps)
                if prom is not None:  # one more scrape of every pool: the final values
                    final_scrape(cfg, prom, client, names)
                # the actors and preprocessors have nothing left to do: they stop now, so
                # the final evaluation has the cores (an actor kept generating groups no
                # step would train, beside it) and their stop overlaps it
                done = [n for n in sup.procs if n.startswith(DONE_AT_SYNC)]
                sup.stop(only=done, why=SYNCED)
                if (
                    wait_for_final_eval(client, names, cfg)
                    and prom is not None
                    and ("evaluator" in sup.procs)
                ):
                    final_scrape(cfg, prom, client, names)  # the evaluator's last values
            except (redis.ConnectionError, redis.TimeoutError) as e:
                print(f"redis did not answer while waiting for the last version ({e})")
        sup.stop()
        # from disk alone when redis does not answer (the machine shutting down)
        summary = write_summary(run_dir, client, names, outcome, time.time() - start, shards)
        print(summary.render())
        if summary.redis_unavailable:
            print(
                f"\nredis did not answer at the end ({summary.redis_error}): "
                f"{run_dir}/summary.json was written from metrics.jsonl and the run "
                "directory; its redis_unavailable lists what it lacks. Launch again on this "
                "run directory to go on from what redis kept",
                flush=True,
            )
        if code == 0 and summary.outcome != outcome:  # finished, but weights did not arrive
            print(f"\nrun {summary.outcome}", flush=True)
            code = 1
        return code
    finally:
        _keep_stopping()  # a second signal no longer cuts the stop short
        if sup is not None:
            sup.stop()
        if prom is not None:
            prom.stop()
        if server is not None:
            server.stop()


@hydra.main(version_base=None, config_path="../conf", config_name="config")
def main(cfg) -> None:
    try:
        code = run(cfg)
    except (ValueError, RedisUnavailable) as e:
        print(f"error: {e}", file=sys.stderr)
        code = 2
    except RedisNotRestarted as e:  # every pool was stopped on the way out (run's finally)
        print(f"error: {e}", file=sys.stderr)
        code = 1
    except KeyboardInterrupt:  # before any pool started; what had started was stopped
        print("\ninterrupted before the run started", file=sys.stderr)
        code = 130
    sys.exit(code)


if __name__ == "__main__":
    try:  # redis.tls=true: redis.tls.enabled=true; engine.X: refused, naming sampling.X
        sys.argv[1:] = expand_shorthands(sys.argv[1:])
        check_experiment_sections(sys.argv[1:], CONF_DIR)  # an exp file's engine: section
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    main()
