# Shared by the nonstop-rl Slurm scripts (sourced; bash). Rendezvous goes through the
# run directory on a shared filesystem and the environment:
#   NONSTOP_RUN_DIR      the run directory, on a filesystem every node sees (required)
#   NONSTOP_CONFIG       the run's config.yaml (default $NONSTOP_RUN_DIR/config.yaml;
#                        composed from NONSTOP_COMPOSE="+exp=... key=value" when missing)
#   NONSTOP_PYTHON       the venv's python (default: python3 on PATH)
#   NONSTOP_DEPLOY       this deploy/ folder (default $SLURM_SUBMIT_DIR/deploy: submit
#                        from the repository root)
#   NONSTOP_REDIS_URL    the run's Redis; default: read from $NONSTOP_RUN_DIR/redis/url,
#                        which the Redis job (redis.sbatch, run.sbatch) writes
# Each job exports them, so every srun step inherits them.

nonstop_init() {
  : "${NONSTOP_RUN_DIR:?set NONSTOP_RUN_DIR to the run directory on a shared filesystem}"
  NONSTOP_RUN_DIR=$(mkdir -p "$NONSTOP_RUN_DIR" && cd "$NONSTOP_RUN_DIR" && pwd)
  NONSTOP_DEPLOY=${NONSTOP_DEPLOY:-${SLURM_SUBMIT_DIR:-.}/deploy}
  NONSTOP_PYTHON=${NONSTOP_PYTHON:-$(command -v python3)}
  NONSTOP_CONFIG=${NONSTOP_CONFIG:-$NONSTOP_RUN_DIR/config.yaml}
  export NONSTOP_RUN_DIR NONSTOP_DEPLOY NONSTOP_PYTHON NONSTOP_CONFIG
  export PATH="$NONSTOP_DEPLOY/bin:$PATH"
  if [ ! -x "$NONSTOP_DEPLOY/bin/nonstop-pool" ]; then
    echo "no $NONSTOP_DEPLOY/bin/nonstop-pool: submit from the repository root or set NONSTOP_DEPLOY" >&2
    return 2
  fi
  if [ ! -f "$NONSTOP_CONFIG" ] && [ -n "${NONSTOP_COMPOSE:-}" ]; then
    # shellcheck disable=SC2086  # NONSTOP_COMPOSE holds several overrides
    (cd "$NONSTOP_DEPLOY/.." && "$NONSTOP_PYTHON" -m pipeline.launch $NONSTOP_COMPOSE \
      "run_dir=$NONSTOP_RUN_DIR" --cfg job) >"$NONSTOP_CONFIG.tmp" && mv "$NONSTOP_CONFIG.tmp" "$NONSTOP_CONFIG"
  fi
  if [ ! -f "$NONSTOP_CONFIG" ]; then
    echo "no run config $NONSTOP_CONFIG: write it (python -m pipeline.launch +exp=... run_dir=DIR --cfg job > DIR/config.yaml) or set NONSTOP_COMPOSE" >&2
    return 2
  fi
}

nonstop_node_addr() {  # this node's address: its name's (not loopback), else its first one
  local addr
  addr=$(getent hosts "$(hostname)" 2>/dev/null | awk '{print $1; exit}')
  case $addr in
    '' | 127.* | ::1) addr=$(hostname -I 2>/dev/null | awk '{print $1}') ;;
  esac
  echo "${addr:-127.0.0.1}"
}

nonstop_free_port() {
  "$NONSTOP_PYTHON" -c 'import socket; s = socket.socket(); s.bind(("", 0)); print(s.getsockname()[1])'
}

nonstop_cluster_port() {  # a free port P whose cluster bus port P + 10000 is free too
  "$NONSTOP_PYTHON" -c 'import socket, sys
for _ in range(200):
    with socket.socket() as s:
        s.bind(("", 0))
        port = s.getsockname()[1]
        if port > 55535:
            continue
        try:
            with socket.socket() as bus:
                bus.bind(("", port + 10000))
        except OSError:
            continue
    print(port)
    break
else:
    sys.exit("no free port pair (P, P + 10000) for a redis cluster node")'
}

nonstop_cfg() {  # one key of the run's config, e.g. nonstop_cfg redis.mode
  "$NONSTOP_PYTHON" -c 'import os, sys
from omegaconf import OmegaConf
from pipeline.config import load_config
print(OmegaConf.select(load_config(os.environ["NONSTOP_CONFIG"]), sys.argv[1]))' "$1"
}

# Wait until FILE ($1) is not empty while the Redis srun step (REDIS_PID) lives, within
# NONSTOP_REDIS_WAIT_S (120) seconds in all (NONSTOP_WAITED counts them over the calls
# of one start); else print the rest of the arguments as one line, stop the step, fail.
nonstop_wait_file() {
  local file=$1 tick=0
  shift
  while [ ! -s "$file" ]; do
    if ! kill -0 "$REDIS_PID" 2>/dev/null || [ "$NONSTOP_WAITED" -ge "${NONSTOP_REDIS_WAIT_S:-120}" ]; then
      echo "$*" >&2
      kill "$REDIS_PID" 2>/dev/null
      return 1
    fi
    sleep 0.2  # the file is seen within 0.2 s of its writing; NONSTOP_WAITED counts seconds
    tick=$((tick + 1))
    [ $((tick % 5)) -ne 0 ] || NONSTOP_WAITED=$((NONSTOP_WAITED + 1))
  done
}

# Start the run's Redis as one srun step in the background (srun options in "$@", e.g.
# --het-group=0), by redis.mode: single (deploy/slurm/redis-single.sh: one redis-server,
# AOF in $NONSTOP_RUN_DIR/redis), sentinel (nonstop_start_redis_ha) or cluster
# (nonstop_start_redis_cluster). Waits until it answers, then exports NONSTOP_REDIS_URL
# (a fresh password) and publishes it in $NONSTOP_RUN_DIR/redis/url (mode 0600, written
# last: it signals the per-pool jobs), with the run's secret in redis/secret. Sets
# REDIS_PID (the srun).
nonstop_start_redis() {
  local mode
  NONSTOP_WAITED=0
  mode=$(nonstop_cfg redis.mode)
  mkdir -p "$NONSTOP_RUN_DIR/redis"
  rm -f "$NONSTOP_RUN_DIR"/redis/url "$NONSTOP_RUN_DIR"/redis/url.*
  NONSTOP_REDIS_PASSWORD=$("$NONSTOP_PYTHON" -c 'import secrets; print(secrets.token_hex(24))')
  export NONSTOP_REDIS_PASSWORD
  case $mode in
    sentinel) nonstop_start_redis_ha "$@"; return ;;
    cluster) nonstop_start_redis_cluster "$@"; return ;;
  esac
  if [ "$(nonstop_cfg redis.shards)" != 1 ]; then
    echo "redis.shards=$(nonstop_cfg redis.shards) needs redis.mode=cluster (compose with redis=cluster):" \
      "the Slurm scripts start no independent shard instances" >&2
    return 2
  fi
  srun "$@" --ntasks=1 "$NONSTOP_DEPLOY/slurm/redis-single.sh" &
  REDIS_PID=$!
  nonstop_wait_file "$NONSTOP_RUN_DIR/redis/url.0" "redis-server did not start" \
    "(see $NONSTOP_RUN_DIR/redis/redis.log)" || return 1
  NONSTOP_REDIS_URL=$(cat "$NONSTOP_RUN_DIR/redis/url.0")
  export NONSTOP_REDIS_URL
  nonstop_publish_redis || return 1
  echo "redis-server on ${NONSTOP_REDIS_URL##*@} (URL in $NONSTOP_RUN_DIR/redis/url)"
}

# Delete a previous trainer's address (stale now), write the run's secret (it signs
# weight-transfer joins) and then NONSTOP_REDIS_URL to $NONSTOP_RUN_DIR/redis/url
# (0600, last: it signals the per-pool jobs); stops the Redis step on failure.
nonstop_publish_redis() {
  "$NONSTOP_PYTHON" - <<'PY' || { kill "$REDIS_PID" 2>/dev/null; return 1; }
import os
from pipeline.config import load_config
from pipeline.streams import Names, connect
cfg = load_config(os.environ["NONSTOP_CONFIG"])
run = os.environ.get("NONSTOP_RUN") or cfg.run.name
names = Names(cfg.redis.prefix, run, cluster=cfg.redis.mode == "cluster")
connect(os.environ["NONSTOP_REDIS_URL"], startup_s=30).delete(names.key("rendezvous"))
PY
  export NONSTOP_RUN_SECRET=${NONSTOP_RUN_SECRET:-$("$NONSTOP_PYTHON" -c 'import secrets; print(secrets.token_hex(16))')}
  (umask 077 && echo "$NONSTOP_RUN_SECRET" >"$NONSTOP_RUN_DIR/redis/secret")
  (umask 077 && echo "$NONSTOP_REDIS_URL" >"$NONSTOP_RUN_DIR/redis/url.tmp")
  mv "$NONSTOP_RUN_DIR/redis/url.tmp" "$NONSTOP_RUN_DIR/redis/url"
}

# redis.mode=sentinel: a primary, NONSTOP_REDIS_REPLICAS (1) replicas and a sentinel per
# task (at least 3 tasks) as one srun step (deploy/slurm/redis-ha.sh; srun options in
# "$@"); waits until the sentinels name the primary, a replica is in sync and every
# sentinel knows the replicas and the other sentinels (could fail over now), then
# exports and publishes the redis+sentinel:// URL as nonstop_start_redis does (with
# NONSTOP_REDIS_TLS_SERVER_CERT set: every node and sentinel on TLS only, rediss+sentinel://).
nonstop_start_redis_ha() {
  local replicas=${NONSTOP_REDIS_REPLICAS:-1} tasks k hosts=""
  NONSTOP_WAITED=0
  tasks=$((replicas + 1))
  [ "$tasks" -ge 3 ] || tasks=3
  NONSTOP_REDIS_SERVICE=$(nonstop_cfg redis.sentinel_service)
  export NONSTOP_REDIS_SERVICE NONSTOP_REDIS_REPLICAS=$replicas
  rm -f "$NONSTOP_RUN_DIR"/redis/node.* "$NONSTOP_RUN_DIR"/redis/sentinel.*
  srun "$@" --ntasks="$tasks" --distribution=cyclic "$NONSTOP_DEPLOY/slurm/redis-ha.sh" &
  REDIS_PID=$!
  for k in $(seq 0 $((tasks - 1))); do
    nonstop_wait_file "$NONSTOP_RUN_DIR/redis/sentinel.$k" "redis task $k did not start" \
      "(redis.mode=sentinel needs $tasks tasks in the Redis group, on separate nodes:" \
      "sbatch -N$tasks -n$tasks ...; see $NONSTOP_RUN_DIR/redis/*.log)" || return 1
    hosts="$hosts${hosts:+,}$(cat "$NONSTOP_RUN_DIR/redis/sentinel.$k")"
  done
  scheme=redis+sentinel
  [ -z "${NONSTOP_REDIS_TLS_SERVER_CERT:-}" ] || scheme=rediss+sentinel
  NONSTOP_REDIS_URL="$scheme://:$NONSTOP_REDIS_PASSWORD@$hosts/$NONSTOP_REDIS_SERVICE/0"
  export NONSTOP_REDIS_URL
  # the sentinels name a primary that answers, with a replica in sync (bounded)
  "$NONSTOP_PYTHON" - <<'PY' || { kill "$REDIS_PID" 2>/dev/null; return 1; }
import os, sys, time
from pipeline.config.env import tls_files
from pipeline.streams import connect
from pipeline.streams.sentinel import failover_gap, parse
client = connect(os.environ["NONSTOP_REDIS_URL"], startup_s=60)
deadline = time.monotonic() + float(os.environ.get("NONSTOP_REDIS_WAIT_S", 120))
while int(client.info("replication").get("min_slaves_good_slaves", 0)) < 1:
    if time.monotonic() > deadline:
        sys.exit("no replica in sync with the primary: see $NONSTOP_RUN_DIR/redis/node-*.log")
    time.sleep(0.5)
# every sentinel knows the replicas and the other sentinels: one that learns of a replica
# only at the primary's next INFO (10 s) could not fail a primary lost before then over
replicas, url = int(os.environ["NONSTOP_REDIS_REPLICAS"]), parse(os.environ["NONSTOP_REDIS_URL"])
if url.tls:
    url.files = tls_files()  # NONSTOP_REDIS_TLS_CA, _CERT, _KEY
while (gap := failover_gap(url, replicas)) is not None:
    if time.monotonic() > deadline:
        sys.exit(f"the sentinels could not fail over yet: {gap}; see $NONSTOP_RUN_DIR/redis/sentinel-*.log")
    time.sleep(0.5)
PY
  nonstop_publish_redis || return 1
  echo "redis primary + $replicas replica(s), $tasks sentinels ${hosts} (service $NONSTOP_REDIS_SERVICE)"
}

# redis.mode=cluster: a Redis Cluster of NONSTOP_REDIS_CLUSTER_NODES (6) nodes, one per
# task of one srun step (deploy/slurm/redis-cluster.sh; srun options in "$@"; tasks spread
# over the step's nodes, --distribution=cyclic), NONSTOP_REDIS_CLUSTER_REPLICAS (1) replicas
# per primary, so nodes / (1 + replicas) >= 3 primaries. Once every node answers: nodes
# that are all new are joined (redis-cli --cluster create of the primaries, chosen one per
# Slurm node in turn, then each replica told to replicate a primary on another Slurm node
# where there is one); nodes that resume from their nodes.conf (a resubmitted job, new
# ports or hosts) meet each other again at their new addresses (CLUSTER MEET), a node that
# lost its data directory joins as the replica of a primary short of one and the others
# forget its old id. Waits (NONSTOP_REDIS_WAIT_S) until every node says cluster_state:ok
# with all slots served, knows every node, every primary has its replicas and every
# replica is in sync, then exports and publishes the redis+cluster:// URL (every node) as
# nonstop_start_redis does; rediss+cluster:// with NONSTOP_REDIS_TLS_SERVER_CERT.
nonstop_start_redis_cluster() {
  local nodes=${NONSTOP_REDIS_CLUSTER_NODES:-6} replicas=${NONSTOP_REDIS_CLUSTER_REPLICAS:-1}
  local k addr where hosts="" scheme=redis+cluster specs=()
  NONSTOP_WAITED=0
  case $nodes$replicas in
    *[!0-9]*) echo "NONSTOP_REDIS_CLUSTER_NODES=$nodes / _REPLICAS=$replicas: give whole numbers" >&2; return 2 ;;
  esac
  if [ $((nodes / (1 + replicas))) -lt 3 ]; then
    echo "NONSTOP_REDIS_CLUSTER_NODES=$nodes with NONSTOP_REDIS_CLUSTER_REPLICAS=$replicas leaves" \
      "$((nodes / (1 + replicas))) primaries; a Redis Cluster needs 3: give at least $((3 * (1 + replicas))) nodes" >&2
    return 2
  fi
  export NONSTOP_REDIS_CLUSTER_NODES=$nodes NONSTOP_REDIS_CLUSTER_REPLICAS=$replicas
  rm -f "$NONSTOP_RUN_DIR"/redis/node.*
  srun "$@" --ntasks="$nodes" --distribution=cyclic "$NONSTOP_DEPLOY/slurm/redis-cluster.sh" &
  REDIS_PID=$!
  for k in $(seq 0 $((nodes - 1))); do
    nonstop_wait_file "$NONSTOP_RUN_DIR/redis/node.$k" "redis cluster node $k did not start" \
      "(redis.mode=cluster runs $nodes nodes, one per task: give the Redis group $nodes" \
      "tasks over several nodes, e.g. sbatch -N3 -n6 --ntasks-per-node=2 ...;" \
      "see $NONSTOP_RUN_DIR/redis/node-*.log)" || return 1
    read -r addr where <"$NONSTOP_RUN_DIR/redis/node.$k"  # HOST:PORT SLURM-NODE
    hosts="$hosts${hosts:+,}$addr"
    specs+=("$addr=$where")
  done
  [ -z "${NONSTOP_REDIS_TLS_SERVER_CERT:-}" ] || scheme=rediss+cluster
  NONSTOP_REDIS_URL="$scheme://:$NONSTOP_REDIS_PASSWORD@$hosts/"
  export NONSTOP_REDIS_URL
  # join the nodes (or bring a resumed cluster back together) and wait until it is whole
  "$NONSTOP_PYTHON" "$NONSTOP_DEPLOY/bin/nonstop-cluster-form" "${specs[@]}" || {
    kill "$REDIS_PID" 2>/dev/null
    return 1
  }
  nonstop_publish_redis || return 1
  echo "redis cluster of $nodes nodes ($replicas replica(s) per primary): $hosts"
}

# Stop the redis-server (and sentinel) processes "$@" of a Redis task cleanly (AOF
# written): SIGTERM, sent again every second while any of them lives. One SIGTERM is not
# enough: redis-server 7.0 refuses one that arrives while a replica writes its initial
# AOF after a full sync ("Writing initial AOF, can't exit.") and runs on, so a task that
# sent one and waited outlived scancel --signal=TERM. A later SIGTERM stops it once that
# AOF is written; after NONSTOP_REDIS_STOP_S (60) seconds, SIGKILL.
nonstop_stop_servers() {
  local pid stat live ticks=0 limit=$((${NONSTOP_REDIS_STOP_S:-60} * 10))
  while :; do
    live=
    for pid in "$@"; do  # running: not gone, not a zombie (exited, not yet reaped)
      # no server of this kind on this task ("": a sentinel-only task's node); an empty
      # pid read /proc//stat, which is /proc/stat, and kept the stop waiting its 60 s
      [ -n "$pid" ] || continue
      { read -r stat <"/proc/$pid/stat"; } 2>/dev/null || continue
      stat=${stat##*) }
      [ "${stat%% *}" = Z ] || live="$live $pid"
    done
    [ -n "$live" ] || return 0
    if [ "$ticks" -ge "$limit" ]; then
      echo "redis did not stop ${NONSTOP_REDIS_STOP_S:-60} s after SIGTERM: killing$live" >&2
      # shellcheck disable=SC2086  # several pids
      kill -KILL $live 2>/dev/null || true
      return 0
    fi
    # shellcheck disable=SC2086  # several pids
    [ $((ticks % 10)) -ne 0 ] || kill -TERM $live 2>/dev/null || true
    sleep 0.1  # a foreground wait: bash reaps the servers that exited meanwhile
    ticks=$((ticks + 1))
  done
}

# Stop Redis (the step nonstop_start_redis started; $1: its het component's job id, or
# this job's): SIGTERM to its tasks, which stop redis-server cleanly (AOF written).
nonstop_stop_redis() {
  scancel --signal=TERM "${1:-$SLURM_JOB_ID}" 2>/dev/null || true
  wait "$REDIS_PID" 2>/dev/null || true
  rm -f "$NONSTOP_RUN_DIR"/redis/url "$NONSTOP_RUN_DIR"/redis/url.* "$NONSTOP_RUN_DIR"/redis/node.* \
    "$NONSTOP_RUN_DIR"/redis/sentinel.*
}

# NONSTOP_REDIS_URL from the environment, or from the Redis job's file (waits for it).
nonstop_find_redis() {
  local file="$NONSTOP_RUN_DIR/redis/url" waited=0
  if [ -n "${NONSTOP_REDIS_URL:-}" ] && [ -n "${NONSTOP_RUN_SECRET:-}" ]; then return 0; fi
  while [ ! -s "$file" ]; do
    if [ "$waited" -ge "${NONSTOP_REDIS_WAIT_S:-600}" ]; then
      echo "no $file after ${waited}s: is the Redis job (redis.sbatch) running?" >&2
      return 1
    fi
    sleep 2
    waited=$((waited + 2))
  done
  NONSTOP_REDIS_URL=${NONSTOP_REDIS_URL:-$(cat "$file")}
  NONSTOP_RUN_SECRET=${NONSTOP_RUN_SECRET:-$(cat "$NONSTOP_RUN_DIR/redis/secret")}
  export NONSTOP_REDIS_URL NONSTOP_RUN_SECRET
}

# Stop the pools started with `srun ... &` (their srun PIDs in $1): SIGTERM to the
# tasks of the steps of the job ids in $3 (a heterogeneous job's components, e.g.
# $SLURM_JOB_ID_HET_GROUP_1: signalling one component leaves the others, such as
# Redis, running; default this job), never to this batch shell (`scancel
# --signal=TERM`; signalling srun itself would make it SIGKILL its tasks), wait up to
# $2 s, then force.
nonstop_stop() {
  local pids=$1 timeout=${2:-60} jobs=${3:-${SLURM_JOB_ID:-}} pid waited=0
  if [ -n "$jobs" ]; then
    # shellcheck disable=SC2086  # several job ids
    scancel --signal=TERM $jobs 2>/dev/null || true
  fi
  for pid in $pids; do
    while kill -0 "$pid" 2>/dev/null && [ "$waited" -lt $((timeout * 5)) ]; do
      sleep 0.2  # a pool's end is seen within 0.2 s; waited counts fifths of a second
      waited=$((waited + 1))
    done
    kill -TERM "$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
  done
}
