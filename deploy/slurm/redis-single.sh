#!/bin/bash
# The run's one redis-server (redis.mode=single), as the one task of the Redis step that
# nonstop_start_redis (common.sh) runs. On this task's node: a free port (or
# NONSTOP_REDIS_PORT), the job's password (NONSTOP_REDIS_PASSWORD), TLS only when
# NONSTOP_REDIS_TLS_SERVER_CERT is set (with _SERVER_KEY and _CA: a rediss:// URL), the
# AOF in $NONSTOP_RUN_DIR/redis (a resubmitted job resumes from it). Once it answers,
# its URL goes to $NONSTOP_RUN_DIR/redis/url.0 (mode 0600). SIGTERM (scancel
# --signal=TERM) stops it cleanly.
set -euo pipefail
source "$NONSTOP_DEPLOY/slurm/common.sh"
: "${NONSTOP_REDIS_PASSWORD:?set by nonstop_start_redis (common.sh)}"
addr=$(nonstop_node_addr)
port=${NONSTOP_REDIS_PORT:-$(nonstop_free_port)}
dir=$NONSTOP_RUN_DIR/redis
mkdir -p "$dir"
runtime=$(mktemp -d "${TMPDIR:-/tmp}/nonstop-redis.XXXXXX")
scheme=redis  # TLS when the job has a server certificate (deploy/README.md, "Redis over TLS")
[ -z "${NONSTOP_REDIS_TLS_SERVER_CERT:-}" ] || scheme=rediss
url="$scheme://:$NONSTOP_REDIS_PASSWORD@$addr:$port/0"
NONSTOP_REDIS_URL=$url NONSTOP_REDIS_BIND="${NONSTOP_REDIS_BIND:-$addr 127.0.0.1}" \
  NONSTOP_REDIS_DIR="$dir" NONSTOP_REDIS_RUNTIME="$runtime" \
  nonstop-redis-start "$NONSTOP_DEPLOY/redis/nonstop-redis.conf" --logfile "$dir/redis.log" &
pid=$!
trap 'trap "" TERM INT; nonstop_stop_servers "$pid"; wait "$pid"; rm -rf "$runtime"; exit 0' TERM INT
NONSTOP_REDIS_URL=$url "$NONSTOP_PYTHON" -c 'import os
from pipeline.streams import connect
connect(os.environ["NONSTOP_REDIS_URL"], attempts=30)' || { kill "$pid"; exit 1; }
(umask 077 && echo "$url" >"$dir/url.0.tmp")
mv "$dir/url.0.tmp" "$dir/url.0"
echo "redis-server on node ${SLURMD_NODENAME:-$(hostname)} $addr:$port (AOF in $dir)"
wait "$pid"
