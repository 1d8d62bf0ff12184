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

# Start redis-server on this node in the background (AOF in $NONSTOP_RUN_DIR/redis, so a
# resubmitted run resumes), wait until it answers, publish its URL in
# $NONSTOP_RUN_DIR/redis/url (mode 0600) and export NONSTOP_REDIS_URL. Sets REDIS_PID.
nonstop_start_redis() {
  local addr port password runtime
  addr=$(nonstop_node_addr)
  port=${NONSTOP_REDIS_PORT:-$(nonstop_free_port)}
  password=$("$NONSTOP_PYTHON" -c 'import secrets; print(secrets.token_hex(24))')
  runtime=$(mktemp -d "${TMPDIR:-/tmp}/nonstop-redis.XXXXXX")
  mkdir -p "$NONSTOP_RUN_DIR/redis"
  NONSTOP_REDIS_URL="redis://:$password@$addr:$port/0" \
    NONSTOP_REDIS_BIND="${NONSTOP_REDIS_BIND:-$addr 127.0.0.1}" \
    NONSTOP_REDIS_DIR="$NONSTOP_RUN_DIR/redis" NONSTOP_REDIS_RUNTIME="$runtime" \
    nonstop-redis-start "$NONSTOP_DEPLOY/redis/nonstop-redis.conf" \
    --logfile "$NONSTOP_RUN_DIR/redis/redis.log" &
  REDIS_PID=$!
  export NONSTOP_REDIS_URL="redis://:$password@$addr:$port/0"
  # answers within the deadline, then: no stale trainer address from a previous job
  "$NONSTOP_PYTHON" - <<'PY' || { kill "$REDIS_PID" 2>/dev/null; return 1; }
import os
from pipeline.config import load_config
from pipeline.streams import Names, connect
cfg = load_config(os.environ["NONSTOP_CONFIG"])
names = Names(cfg.redis.prefix, os.environ.get("NONSTOP_RUN") or cfg.run.name)
connect(os.environ["NONSTOP_REDIS_URL"]).delete(names.key("rendezvous"))
PY
  # the run's secret signs weight-transfer joins; written before the URL, which signals
  export NONSTOP_RUN_SECRET=${NONSTOP_RUN_SECRET:-$("$NONSTOP_PYTHON" -c 'import secrets; print(secrets.token_hex(16))')}
  (umask 077 && echo "$NONSTOP_RUN_SECRET" >"$NONSTOP_RUN_DIR/redis/secret")
  (umask 077 && echo "$NONSTOP_REDIS_URL" >"$NONSTOP_RUN_DIR/redis/url.tmp")
  mv "$NONSTOP_RUN_DIR/redis/url.tmp" "$NONSTOP_RUN_DIR/redis/url"
  echo "redis-server on $addr:$port (URL in $NONSTOP_RUN_DIR/redis/url)"
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
# tasks of every step of this job, never to this batch shell (`scancel --signal=TERM`;
# signalling srun itself would make it SIGKILL its tasks), wait up to $2 s, then force.
nonstop_stop() {
  local pids=$1 timeout=${2:-60} pid waited=0
  if [ -n "${SLURM_JOB_ID:-}" ]; then
    scancel --signal=TERM "$SLURM_JOB_ID" 2>/dev/null || true
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
