#!/bin/bash
# One node of the run's Redis Cluster (redis.mode=cluster), as task $SLURM_PROCID of the
# Redis step that nonstop_start_redis_cluster (common.sh) runs, which then joins the
# nodes (deploy/bin/nonstop-cluster-form). On this task's node: a free port whose bus
# port (+ 10000) is free too (or NONSTOP_REDIS_PORT + K), the job's password
# (NONSTOP_REDIS_PASSWORD), cluster-node-timeout NONSTOP_REDIS_CLUSTER_NODE_TIMEOUT_MS
# (5000), the AOF and nodes.conf in $NONSTOP_RUN_DIR/redis/node-K (a resubmitted job
# resumes from them), TLS only when NONSTOP_REDIS_TLS_SERVER_CERT is set (with
# _SERVER_KEY, _CA and the client's NONSTOP_REDIS_TLS_CERT/_KEY, which the nodes present
# to each other on the bus and as replicas; tls-cluster, tls-replication: a
# rediss+cluster:// URL). Once it answers, "HOST:PORT SLURM-NODE" goes to
# $NONSTOP_RUN_DIR/redis/node.K (mode 0600).
# A node that dies is not restarted at once: the task waits until the other nodes have
# marked it failed (cluster-node-timeout) and the cluster is whole again (its replica
# promoted in its place, for a primary), then restarts it; with its nodes.conf it rejoins
# by itself (a former primary as the replica of the node that took its slots), without
# (its data directory lost) it meets another node, replicates a primary short of
# replicas and the others forget its old id. SIGTERM (scancel --signal=TERM) stops it
# cleanly (AOF written).
set -euo pipefail
source "$NONSTOP_DEPLOY/slurm/common.sh"
: "${NONSTOP_REDIS_PASSWORD:?set by nonstop_start_redis (common.sh)}"
k=${SLURM_PROCID:?run as a task of an srun step}
nodes=${NONSTOP_REDIS_CLUSTER_NODES:?set by nonstop_start_redis_cluster (common.sh)}
addr=$(nonstop_node_addr)
rd=$NONSTOP_RUN_DIR/redis
dir=$rd/node-$k
where=${SLURMD_NODENAME:-$(hostname)}
mkdir -p "$rd"
runtime=$(mktemp -d "${TMPDIR:-/tmp}/nonstop-redis-cluster.XXXXXX")
export REDISCLI_AUTH=$NONSTOP_REDIS_PASSWORD  # redis-cli's password, off the command line
scheme=redis+cluster cli=(redis-cli)  # TLS when the job has a server certificate
if [ -n "${NONSTOP_REDIS_TLS_SERVER_CERT:-}" ]; then
  scheme=rediss+cluster
  cli+=(--tls --cacert "${NONSTOP_REDIS_TLS_CA:?TLS: set NONSTOP_REDIS_TLS_CA}")
  cli+=(--cert "${NONSTOP_REDIS_TLS_CERT:?TLS: set NONSTOP_REDIS_TLS_CERT}")
  cli+=(--key "${NONSTOP_REDIS_TLS_KEY:?TLS: set NONSTOP_REDIS_TLS_KEY}")
fi
port=$(nonstop_cluster_port)
[ -z "${NONSTOP_REDIS_PORT:-}" ] || port=$((NONSTOP_REDIS_PORT + k))
url="$scheme://:$NONSTOP_REDIS_PASSWORD@$addr:$port/"
node_pid= stopping=
stop() {
  trap '' TERM INT  # once: Slurm's SIGTERM reaches this task and its node both
  stopping=1
  # shellcheck disable=SC2046  # the node and any background job
  kill -TERM $node_pid $(jobs -p) 2>/dev/null || true
  nonstop_stop_servers "$node_pid"  # again until it exits (a new replica may refuse one)
  wait 2>/dev/null || true
  rm -rf "$runtime"
  exit 0
}
trap stop TERM INT

here() { "${cli[@]}" -h "$addr" -p "$port" "$@" 2>/dev/null; }

start_node() {
  NONSTOP_REDIS_URL=$url NONSTOP_REDIS_NODE_PORT=$port NONSTOP_REDIS_DIR=$dir \
    NONSTOP_REDIS_RUNTIME=$runtime NONSTOP_REDIS_BIND="${NONSTOP_REDIS_BIND:-$addr 127.0.0.1}" \
    NONSTOP_REDIS_ANNOUNCE_IP=$addr \
    nonstop-redis-start "$NONSTOP_DEPLOY/redis/nonstop-redis.conf" --logfile "$rd/node-$k.log" &
  node_pid=$!
  until here ping | grep -q PONG; do
    kill -0 "$node_pid" 2>/dev/null || { echo "redis cluster node $k exited (see $rd/node-$k.log)" >&2; exit 1; }
    sleep 0.2
  done
  myid=$(here cluster myid)
}

peers() {  # HOST:PORT of the other nodes of this job
  local j
  for j in $(seq 0 $((nodes - 1))); do
    [ "$j" -eq "$k" ] || [ ! -s "$rd/node.$j" ] || cut -d' ' -f1 "$rd/node.$j"
  done
}

# a peer that answers says the cluster is whole and has marked node id $1 failed
failed_over() {
  local p
  for p in $(peers); do
    "${cli[@]}" -h "${p%:*}" -p "${p##*:}" cluster info 2>/dev/null | grep -q 'cluster_state:ok' || continue
    "${cli[@]}" -h "${p%:*}" -p "${p##*:}" cluster nodes 2>/dev/null |
      awk -v id="$1" '$1 == id && $3 ~ /fail/ && $3 !~ /fail\?/ {found = 1} END {exit !found}' && return 0
  done
  return 1
}

# a node started without its nodes.conf: meet a peer, replicate the primary with the
# fewest replicas (not on this Slurm node where possible), and have every node forget
# the old id $1
rejoin_new() {
  local old=$1 p lead="" waited=0
  for p in $(peers); do
    here cluster meet "${p%:*}" "${p##*:}" | grep -q OK && break
  done
  until here cluster info | grep -q 'cluster_state:ok'; do
    [ -z "$stopping" ] || return 1
    [ "$waited" -lt 60 ] || { echo "node $k: not part of the cluster 60 s after CLUSTER MEET" >&2; return 1; }
    sleep 1
    waited=$((waited + 1))
  done
  for p in $(peers); do
    "${cli[@]}" -h "${p%:*}" -p "${p##*:}" cluster forget "$old" >/dev/null 2>&1 || true
  done
  here cluster forget "$old" >/dev/null || true
  # primaries serving slots, by their number of live replicas (fewest first)
  lead=$(here cluster nodes | awk '
    $3 ~ /master/ && $3 !~ /fail/ && NF > 8 {count[$1] += 0}
    $3 ~ /slave/ && $3 !~ /fail/ {count[$4]++}
    END {for (id in count) print count[id], id}' | sort -n | awk 'NR == 1 {print $2}')
  [ -n "$lead" ] || { echo "node $k: no primary to replicate" >&2; return 1; }
  here cluster replicate "$lead" >/dev/null
  echo "redis cluster node $k came back without its data: a replica of $lead now (old id $old forgotten)"
}

mkdir -p "$dir"
start_node
(umask 077 && echo "$addr:$port $where" >"$rd/node.$k.tmp") && mv "$rd/node.$k.tmp" "$rd/node.$k"
echo "redis cluster node $k on node $where $addr:$port (AOF and nodes.conf in $dir)"

while [ -z "$stopping" ]; do
  if ! kill -0 "$node_pid" 2>/dev/null && [ -z "$stopping" ]; then
    wait "$node_pid" 2>/dev/null || true
    echo "redis cluster node $k ($addr:$port, id $myid) died; waiting for the cluster to fail it over"
    until [ -n "$stopping" ] || failed_over "$myid"; do
      sleep 1 & wait $! || true
    done
    [ -z "$stopping" ] || break
    old=$myid
    if [ -s "$dir/nodes.conf" ]; then
      start_node
      echo "restarted redis cluster node $k from its nodes.conf (it rejoins by itself)"
    else
      start_node
      rejoin_new "$old" || true
    fi
  fi
  sleep 0.2 & wait $! || true  # a dead node is seen within 0.2 s
done
stop
