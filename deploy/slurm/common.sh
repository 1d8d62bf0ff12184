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
#   NONSTOP_REDIS_SHARD_URLS  redis.shards > 1: shards 1.. (comma-joined); default: read
#                        from $NONSTOP_RUN_DIR/redis/shard_urls
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

nonstop_cfg() {  # one key of the run's config, e.g. nonstop_cfg redis.shards
  "$NONSTOP_PYTHON" -c 'import os, sys
from omegaconf import OmegaConf
from pipeline.config import load_config
print(OmegaConf.select(load_config(os.environ["NONSTOP_CONFIG"]), sys.argv[1]))' "$1"
}

# Wait until FILE ($1) is not empty while the Redis srun step (REDIS_PID) lives, within
# NONSTOP_REDIS_WAIT_S (120) seconds in all (NONSTOP_WAITED counts them over the calls
# of one start); else print the rest of the arguments as one line, stop the step, fail.
nonstop_wait_file() {
  local file=$1
  shift
  while [ ! -s "$file" ]; do
    if ! kill -0 "$REDIS_PID" 2>/dev/null || [ "$NONSTOP_WAITED" -ge "${NONSTOP_REDIS_WAIT_S:-120}" ]; then
      echo "$*" >&2
      kill "$REDIS_PID" 2>/dev/null
      return 1
    fi
    sleep 1
    NONSTOP_WAITED=$((NONSTOP_WAITED + 1))
  done
}

# Start the run's redis.shards redis-servers as one srun step in the background (srun
# options in "$@", e.g. --het-group=0; its tasks are spread over the step's nodes, one
# redis-server each: deploy/slurm/redis-shard.sh, AOF in $NONSTOP_RUN_DIR/redis and
# redis-shardK), wait until each answers, then export NONSTOP_REDIS_URL (shard 0, the
# primary) and NONSTOP_REDIS_SHARD_URLS (shards 1.., comma-joined) and publish them in
# $NONSTOP_RUN_DIR/redis/url and redis/shard_urls (mode 0600; url last: it signals the
# per-pool jobs). Sets REDIS_PID (the srun).
# redis.mode=sentinel: nonstop_start_redis_ha instead.
nonstop_start_redis() {
  local shards k shard_urls=""
  NONSTOP_WAITED=0
  shards=$(nonstop_cfg redis.shards)
  mkdir -p "$NONSTOP_RUN_DIR/redis"
  rm -f "$NONSTOP_RUN_DIR"/redis/url "$NONSTOP_RUN_DIR"/redis/url.* "$NONSTOP_RUN_DIR/redis/shard_urls"
  NONSTOP_REDIS_PASSWORD=$("$NONSTOP_PYTHON" -c 'import secrets; print(secrets.token_hex(24))')
  export NONSTOP_REDIS_PASSWORD
  if [ "$(nonstop_cfg redis.mode)" = sentinel ]; then
    nonstop_start_redis_ha "$@"
    return
  fi
  srun "$@" --ntasks="$shards" --distribution=cyclic "$NONSTOP_DEPLOY/slurm/redis-shard.sh" &
  REDIS_PID=$!
  for k in $(seq 0 $((shards - 1))); do
    nonstop_wait_file "$NONSTOP_RUN_DIR/redis/url.$k" "redis shard $k did not start" \
      "(redis.shards=$shards needs $shards tasks in the Redis group: sbatch -n$shards ...;" \
      "see $NONSTOP_RUN_DIR/redis*/redis.log)" || return 1
    [ "$k" -eq 0 ] || shard_urls="$shard_urls${shard_urls:+,}$(cat "$NONSTOP_RUN_DIR/redis/url.$k")"
  done
  NONSTOP_REDIS_URL=$(cat "$NONSTOP_RUN_DIR/redis/url.0")
  NONSTOP_REDIS_SHARD_URLS=$shard_urls
  export NONSTOP_REDIS_URL NONSTOP_REDIS_SHARD_URLS
  # no stale trainer address from a previous job
  "$NONSTOP_PYTHON" - <<'PY' || { kill "$REDIS_PID" 2>/dev/null; return 1; }
import os
from pipeline.config import load_config
from pipeline.streams import Names, connect
from pipeline.streams.sentinel import failover_gap, parse
cfg = load_config(os.environ["NONSTOP_CONFIG"])
names = Names(cfg.redis.prefix, os.environ.get("NONSTOP_RUN") or cfg.run.name)
connect(os.environ["NONSTOP_REDIS_URL"]).delete(names.key("rendezvous"))
PY
  # the run's secret signs weight-transfer joins; written before the URL, which signals
  export NONSTOP_RUN_SECRET=${NONSTOP_RUN_SECRET:-$("$NONSTOP_PYTHON" -c 'import secrets; print(secrets.token_hex(16))')}
  (umask 077 && echo "$NONSTOP_RUN_SECRET" >"$NONSTOP_RUN_DIR/redis/secret")
  (umask 077 && echo "$NONSTOP_REDIS_SHARD_URLS" >"$NONSTOP_RUN_DIR/redis/shard_urls")
  (umask 077 && echo "$NONSTOP_REDIS_URL" >"$NONSTOP_RUN_DIR/redis/url.tmp")
  mv "$NONSTOP_RUN_DIR/redis/url.tmp" "$NONSTOP_RUN_DIR/redis/url"
  echo "redis-server on ${NONSTOP_REDIS_URL##*@} ($shards instance(s); URLs in $NONSTOP_RUN_DIR/redis)"
}

# redis.mode=sentinel: a primary, NONSTOP_REDIS_REPLICAS (1) replicas and a sentinel per
# task (at least 3 tasks) as one srun step (deploy/slurm/redis-ha.sh; srun options in
# "$@"); waits until the sentinels name the primary, a replica is in sync and every
# sentinel knows the replicas and the other sentinels (could fail over now), then
# exports and publishes the redis+sentinel:// URL as nonstop_start_redis does.
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
  NONSTOP_REDIS_URL="redis+sentinel://:$NONSTOP_REDIS_PASSWORD@$hosts/$NONSTOP_REDIS_SERVICE/0"
  NONSTOP_REDIS_SHARD_URLS=
  export NONSTOP_REDIS_URL NONSTOP_REDIS_SHARD_URLS
  # the sentinels name a primary that answers, with a replica in sync (bounded)
  "$NONSTOP_PYTHON" - <<'PY' || { kill "$REDIS_PID" 2>/dev/null; return 1; }
import os, sys, time
from pipeline.config import load_config
from pipeline.streams import Names, connect
from pipeline.streams.sentinel import failover_gap, parse
cfg = load_config(os.environ["NONSTOP_CONFIG"])
client = connect(os.environ["NONSTOP_REDIS_URL"], startup_s=60)
deadline = time.monotonic() + float(os.environ.get("NONSTOP_REDIS_WAIT_S", 120))
while int(client.info("replication").get("min_slaves_good_slaves", 0)) < 1:
    if time.monotonic() > deadline:
        sys.exit("no replica in sync with the primary: see $NONSTOP_RUN_DIR/redis/node-*.log")
    time.sleep(0.5)
# every sentinel knows the replicas and the other sentinels: one that learns of a replica
# only at the primary's next INFO (10 s) could not fail a primary lost before then over
replicas, url = int(os.environ["NONSTOP_REDIS_REPLICAS"]), parse(os.environ["NONSTOP_REDIS_URL"])
while (gap := failover_gap(url, replicas)) is not None:
    if time.monotonic() > deadline:
        sys.exit(f"the sentinels could not fail over yet: {gap}; see $NONSTOP_RUN_DIR/redis/sentinel-*.log")
    time.sleep(0.5)
names = Names(cfg.redis.prefix, os.environ.get("NONSTOP_RUN") or cfg.run.name)
client.delete(names.key("rendezvous"))  # no stale trainer address from a previous job
PY
  export NONSTOP_RUN_SECRET=${NONSTOP_RUN_SECRET:-$("$NONSTOP_PYTHON" -c 'import secrets; print(secrets.token_hex(16))')}
  (umask 077 && echo "$NONSTOP_RUN_SECRET" >"$NONSTOP_RUN_DIR/redis/secret")
  (umask 077 && echo "" >"$NONSTOP_RUN_DIR/redis/shard_urls")
  (umask 077 && echo "$NONSTOP_REDIS_URL" >"$NONSTOP_RUN_DIR/redis/url.tmp")
  mv "$NONSTOP_RUN_DIR/redis/url.tmp" "$NONSTOP_RUN_DIR/redis/url"
  echo "redis primary + $replicas replica(s), $tasks sentinels ${hosts} (service $NONSTOP_REDIS_SERVICE)"
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
  if [ -z "${NONSTOP_REDIS_SHARD_URLS:-}" ] && [ -s "$NONSTOP_RUN_DIR/redis/shard_urls" ]; then
    NONSTOP_REDIS_SHARD_URLS=$(cat "$NONSTOP_RUN_DIR/redis/shard_urls")  # redis.shards > 1
  fi
  export NONSTOP_REDIS_URL NONSTOP_RUN_SECRET NONSTOP_REDIS_SHARD_URLS
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
    while kill -0 "$pid" 2>/dev/null && [ "$waited" -lt "$timeout" ]; do
      sleep 1
      waited=$((waited + 1))
    done
    kill -TERM "$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
  done
}
