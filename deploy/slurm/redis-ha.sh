#!/bin/bash
# One task of the Redis step in redis.mode=sentinel (nonstop_start_redis, common.sh):
# tasks 0..NONSTOP_REDIS_REPLICAS run a redis-server node each (AOF in
# $NONSTOP_RUN_DIR/redis/node-K; node $(cat redis/primary_node), default 0, starts as the
# primary, the others as its replicas) and every task runs a sentinel (at least three
# tasks: quorum 2), each on a free port (or NONSTOP_REDIS_PORT + K, NONSTOP_SENTINEL_PORT
# + K) of this task's node. Spread the tasks over nodes (sbatch -N3 -n3): the replica on
# another node than the primary is what survives the loss of the primary's node.
# Addresses go to $NONSTOP_RUN_DIR/redis/node.K and sentinel.K. A node that dies is not
# restarted as it was: once the sentinels name another primary, it restarts as that
# primary's replica (its data directory recreated if it was lost), so the new primary
# again has the replica its min-replicas-to-write needs. The task whose node is the
# primary (named so by the sentinels and master by its own ROLE) keeps its index in
# redis/primary_node, checked every second, so a resubmitted job starts from the newest
# data. Not only at the stop: Slurm's SIGTERM reaches every process of the step at once,
# the sentinels included, so at the stop nobody may be left to ask. SIGTERM stops both
# cleanly. With NONSTOP_REDIS_TLS_SERVER_CERT set (and _SERVER_KEY, _CA, and the client's
# NONSTOP_REDIS_TLS_CERT/_KEY, which the nodes and sentinels present to each other) every
# node and sentinel is on TLS only (rediss+sentinel://; deploy/README.md "Sentinels and
# Redis Cluster over TLS").
set -euo pipefail
source "$NONSTOP_DEPLOY/slurm/common.sh"
: "${NONSTOP_REDIS_PASSWORD:?set by nonstop_start_redis (common.sh)}"
k=${SLURM_PROCID:?run as a task of an srun step}
replicas=${NONSTOP_REDIS_REPLICAS:-1}
service=${NONSTOP_REDIS_SERVICE:?set by nonstop_start_redis (redis.sentinel_service)}
addr=$(nonstop_node_addr)
rd=$NONSTOP_RUN_DIR/redis
primary_node=$(cat "$rd/primary_node" 2>/dev/null || echo 0)
runtime=$(mktemp -d "${TMPDIR:-/tmp}/nonstop-redis-ha.XXXXXX")
export REDISCLI_AUTH=$NONSTOP_REDIS_PASSWORD  # redis-cli's password, off the command line
scheme=redis+sentinel cli=(redis-cli)  # TLS when the job has a server certificate
if [ -n "${NONSTOP_REDIS_TLS_SERVER_CERT:-}" ]; then
  scheme=rediss+sentinel
  cli+=(--tls --cacert "${NONSTOP_REDIS_TLS_CA:?TLS: set NONSTOP_REDIS_TLS_CA}")
  cli+=(--cert "${NONSTOP_REDIS_TLS_CERT:?TLS: set NONSTOP_REDIS_TLS_CERT}")
  cli+=(--key "${NONSTOP_REDIS_TLS_KEY:?TLS: set NONSTOP_REDIS_TLS_KEY}")
fi
url="$scheme://:$NONSTOP_REDIS_PASSWORD@$addr:0/$service/0"  # the password for the scripts
node_pid= sentinel_pid= stopping=
stop() {
  trap '' TERM INT  # once: Slurm's SIGTERM reaches this task and its node both
  stopping=1
  record_primary || true  # a last look, if the sentinel still answers
  # shellcheck disable=SC2046  # every background job: the node and sentinel of any restart
  kill -TERM $sentinel_pid $node_pid $(jobs -p) 2>/dev/null || true
  nonstop_stop_servers "$node_pid" "$sentinel_pid"  # again until they exit (a replica may refuse one)
  wait 2>/dev/null || true
  rm -rf "$runtime"
  exit 0
}
trap stop TERM INT

publish() {  # publish FILE VALUE, atomically, mode 0600
  (umask 077 && echo "$2" >"$1.tmp") && mv "$1.tmp" "$1"
}

wait_file() {  # the address another task published
  local waited=0
  while [ ! -s "$1" ]; do
    [ "$waited" -lt 120 ] || { echo "no $1 after 120 s (see $rd/*.log)" >&2; exit 1; }
    sleep 1
    waited=$((waited + 1))
  done
  cat "$1"
}

start_node() {  # start_node [HOST:PORT of the primary to follow]
  local dir=$rd/node-$k
  # a private copy of the config: the sentinels CONFIG REWRITE a node's config file
  cp "$NONSTOP_DEPLOY/redis/nonstop-redis.conf" "$runtime/redis.conf"
  NONSTOP_REDIS_URL=$url NONSTOP_REDIS_NODE_PORT=$node_port NONSTOP_REDIS_DIR=$dir \
    NONSTOP_REDIS_RUNTIME=$runtime/node NONSTOP_REDIS_BIND="${NONSTOP_REDIS_BIND:-$addr 127.0.0.1}" \
    NONSTOP_REDIS_ANNOUNCE_IP=$addr NONSTOP_REDIS_ROLE=${1:+replica} NONSTOP_REDIS_REPLICAOF=${1:-} \
    nonstop-redis-start "$runtime/redis.conf" --logfile "$rd/node-$k.log" &
  node_pid=$!
}

if [ "$k" -le "$replicas" ]; then
  node_port=$(nonstop_free_port)
  [ -z "${NONSTOP_REDIS_PORT:-}" ] || node_port=$((NONSTOP_REDIS_PORT + k))
  if [ "$k" -eq "$primary_node" ]; then
    start_node
  else
    of=$(wait_file "$rd/node.$primary_node")  # set -e: no file, no node (never a primary)
    start_node "$of"
  fi
  until "${cli[@]}" -h "$addr" -p "$node_port" ping 2>/dev/null | grep -q -e PONG -e MASTERDOWN; do
    kill -0 "$node_pid" 2>/dev/null || { echo "redis node $k exited (see $rd/node-$k.log)" >&2; exit 1; }
    sleep 0.2
  done
  publish "$rd/node.$k" "$addr:$node_port"
fi
sentinel_port=$(nonstop_free_port)
[ -z "${NONSTOP_SENTINEL_PORT:-}" ] || sentinel_port=$((NONSTOP_SENTINEL_PORT + k))
first=$(wait_file "$rd/node.$primary_node")
NONSTOP_REDIS_URL=$url NONSTOP_REDIS_PRIMARY=$first \
  NONSTOP_SENTINEL_PORT=$sentinel_port NONSTOP_SENTINEL_DIR=$runtime/sentinel \
  NONSTOP_SENTINEL_ANNOUNCE_IP=$addr NONSTOP_REDIS_BIND="${NONSTOP_REDIS_BIND:-$addr 127.0.0.1}" \
  NONSTOP_SENTINEL_DOWN_AFTER_MS=${NONSTOP_SENTINEL_DOWN_AFTER_MS:-5000} \
  nonstop-sentinel-start --logfile "$rd/sentinel-$k.log" &
sentinel_pid=$!
publish "$rd/sentinel.$k" "$addr:$sentinel_port"
echo "redis task $k on node ${SLURMD_NODENAME:-$(hostname)}: sentinel $addr:$sentinel_port" \
  "${node_pid:+, node $addr:$node_port (AOF in $rd/node-$k)}"

named_primary() {  # HOST:PORT the local sentinel names as the primary
  "${cli[@]}" -h "$addr" -p "$sentinel_port" --raw sentinel get-master-addr-by-name "$service" \
    2>/dev/null | paste -sd: -
}
record_primary() {  # this task's node is the primary: its index, for the next job
  local role
  [ -n "$node_pid" ] && [ "$(named_primary)" = "$addr:${node_port:-}" ] || return 0
  role=$("${cli[@]}" -h "$addr" -p "$node_port" --raw role 2>/dev/null) || return 0
  [ "${role%%$'\n'*}" = master ] || return 0
  [ "$(cat "$rd/primary_node" 2>/dev/null)" = "$k" ] || publish "$rd/primary_node" "$k"
}
while [ -z "$stopping" ]; do
  record_primary
  if [ -n "$node_pid" ] && ! kill -0 "$node_pid" 2>/dev/null && [ -z "$stopping" ]; then
    wait "$node_pid" 2>/dev/null || true
    echo "redis node $k ($addr:$node_port) died; waiting for the sentinels to name a primary"
    p=
    until [ -n "$stopping" ] || { [ -n "$p" ] && [ "$p" != "$addr:$node_port" ] \
      && "${cli[@]}" -h "${p%:*}" -p "${p##*:}" ping 2>/dev/null | grep -q PONG; }; do
      sleep 1 & wait $! || true
      p=$(named_primary) || p=
    done
    [ -z "$stopping" ] || break
    echo "restarting redis node $k as a replica of $p"
    start_node "$p"
  fi
  if ! kill -0 "$sentinel_pid" 2>/dev/null && [ -z "$stopping" ]; then
    echo "sentinel $k exited; restarting it from its configuration"
    NONSTOP_REDIS_URL=$url NONSTOP_REDIS_PRIMARY=$first \
      NONSTOP_SENTINEL_DIR=$runtime/sentinel nonstop-sentinel-start --logfile "$rd/sentinel-$k.log" &
    sentinel_pid=$!
  fi
  sleep 1 & wait $! || true
done
stop
