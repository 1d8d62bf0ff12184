#!/bin/bash
# One redis-server of the run, as task $SLURM_PROCID of the Redis step that
# nonstop_start_redis (common.sh) runs: shard 0 is the primary (redis.url), shards 1..
# hold their part of the rollouts and batches streams (redis.shards, pipeline/streams/shards.py).
# On this task's node: a free port, the job's password (NONSTOP_REDIS_PASSWORD), TLS only
# when NONSTOP_REDIS_TLS_SERVER_CERT is set (with _SERVER_KEY and _CA: rediss:// URLs), the AOF
# in $NONSTOP_RUN_DIR/redis (shard 0) or $NONSTOP_RUN_DIR/redis-shardK (a resubmitted job
# resumes from it). Once it answers, its URL goes to $NONSTOP_RUN_DIR/redis/url.K
# (mode 0600). SIGTERM (scancel --signal=TERM) stops it cleanly.
set -euo pipefail
source "$NONSTOP_DEPLOY/slurm/common.sh"
: "${NONSTOP_REDIS_PASSWORD:?set by nonstop_start_redis (common.sh)}"
k=${SLURM_PROCID:?run as a task of an srun step}
addr=$(nonstop_node_addr)
port=$(nonstop_free_port)
[ -z "${NONSTOP_REDIS_PORT:-}" ] || port=$((NONSTOP_REDIS_PORT + k))  # fixed: shard k on PORT+k
dir=$NONSTOP_RUN_DIR/redis
[ "$k" -eq 0 ] || dir=$NONSTOP_RUN_DIR/redis-shard$k
mkdir -p "$dir" "$NONSTOP_RUN_DIR/redis"
runtime=$(mktemp -d "${TMPDIR:-/tmp}/nonstop-redis.XXXXXX")
scheme=redis  # TLS when the job has a server certificate (deploy/README.md, "Redis over TLS")
[ -z "${NONSTOP_REDIS_TLS_SERVER_CERT:-}" ] || scheme=rediss
url="$scheme://:$NONSTOP_REDIS_PASSWORD@$addr:$port/0"
NONSTOP_REDIS_URL=$url NONSTOP_REDIS_BIND="${NONSTOP_REDIS_BIND:-$addr 127.0.0.1}" \
  NONSTOP_REDIS_DIR="$dir" NONSTOP_REDIS_RUNTIME="$runtime" \
  nonstop-redis-start "$NONSTOP_DEPLOY/redis/nonstop-redis.conf" --logfile "$dir/redis.log" &
pid=$!
trap 'kill -TERM "$pid" 2>/dev/null; wait "$pid"; rm -rf "$runtime"; exit 0' TERM INT
NONSTOP_REDIS_URL=$url "$NONSTOP_PYTHON" -c 'import os
from pipeline.streams import connect
connect(os.environ["NONSTOP_REDIS_URL"], attempts=30)' || { kill "$pid"; exit 1; }
(umask 077 && echo "$url" >"$NONSTOP_RUN_DIR/redis/url.$k.tmp")
mv "$NONSTOP_RUN_DIR/redis/url.$k.tmp" "$NONSTOP_RUN_DIR/redis/url.$k"
echo "redis shard $k on node ${SLURMD_NODENAME:-$(hostname)} $addr:$port (AOF in $dir)"
wait "$pid"
