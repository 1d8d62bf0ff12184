#!/bin/bash
# A throwaway single-host Slurm cluster for trying the scripts here (and for the slow
# test): slurmctld and NODES slurmd daemons (node names n1..nNODES, all on 127.0.0.1;
# a heterogeneous job needs one node per component), munge auth, no cgroups
# (proctrack/linuxproc, task/none), everything under STATE_DIR. Needs root and Debian's
# slurm-wlm and munge (`make slurm-setup`).
#   deploy/slurm/local-cluster.sh start STATE_DIR [NODES=3] [CPUS_PER_NODE=4]
#   export SLURM_CONF=STATE_DIR/slurm.conf; sbatch ...
#   deploy/slurm/local-cluster.sh stop STATE_DIR
set -euo pipefail
cmd=${1:?usage: local-cluster.sh start|stop STATE_DIR [NODES] [CPUS_PER_NODE]}
dir=${2:?usage: local-cluster.sh start|stop STATE_DIR [NODES] [CPUS_PER_NODE]}
nodes=${3:-3}
cpus=${4:-8}
mkdir -p "$dir"
dir=$(cd "$dir" && pwd)
conf=$dir/slurm.conf

stop() {
  local f
  for f in "$dir"/slurmd-*.pid "$dir"/slurmctld.pid "$dir"/munged.pid; do
    [ -f "$f" ] || continue
    kill "$(cat "$f")" 2>/dev/null || true
    rm -f "$f"
  done
  rm -f "$(munge_base)".log "$(munge_base)".seed  # munged removes its socket and pid file
}

# COUNT consecutive free ports, below Linux's ephemeral range (32768-60999), so that a
# client connection opened meanwhile cannot take one before its daemon binds it
free_ports() {
  python3 - "$1" <<'PY'
import random, socket, sys
n = int(sys.argv[1])
for _ in range(1000):
    base = random.randrange(20000, 32000 - n)
    socks = []
    try:
        for port in range(base, base + n):
            s = socket.socket()
            socks.append(s)
            s.bind(("127.0.0.1", port))
    except OSError:
        continue
    finally:
        for s in socks:
            s.close()
    print(base)
    break
else:
    sys.exit("no free port range")
PY
}

# a munged of this cluster's own, on its own socket (AuthInfo in slurm.conf): another
# single-host Slurm's stop, or a system munged's, cannot take it away mid-job
munge_base() { echo "/run/munge/local-$(echo "$dir" | md5sum | cut -c1-12)"; }

start_munge() {
  local base
  base=$(munge_base)
  [ -f /etc/munge/munge.key ] || { echo "no /etc/munge/munge.key (apt-get install munge)" >&2; return 1; }
  mkdir -p /run/munge /var/log/munge /var/lib/munge
  chown munge:munge /run/munge /var/log/munge /var/lib/munge
  # more threads than its default 2: six slurmd, slurmctld and every srun ask it at once
  runuser -u munge -- munged --num-threads=10 --socket="$base.socket" \
    --pid-file="$base.pid" --seed-file="$base.seed" --log-file="$base.log"
  cp "$base.pid" "$dir/munged.pid"
  for _ in $(seq 50); do
    if munge -S "$base.socket" -n 2>/dev/null | unmunge -S "$base.socket" >/dev/null 2>&1; then
      return 0
    fi
    sleep 0.1
  done
  echo "munged did not come up on $base.socket (see $base.log)" >&2
  return 1
}

write_conf() {
  local ctl_port first last
  ctl_port=$(free_ports $((nodes + 1)))  # slurmctld, then one port per slurmd
  first=$((ctl_port + 1))
  last=$((first + nodes - 1))
  mkdir -p "$dir/state" "$dir/log"
  for i in $(seq "$nodes"); do mkdir -p "$dir/spool/n$i"; done
  cat >"$conf" <<CONF
ClusterName=nonstop-local
SlurmctldHost=$(hostname -s)(127.0.0.1)
SlurmctldPort=$ctl_port
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket=$(munge_base).socket
CredType=cred/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
SchedulerParameters=bf_interval=1
ReturnToService=2
MpiDefault=none
SwitchType=switch/none
KillWait=30
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool/%n
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd-%n.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd-%n.log
NodeName=n[1-$nodes] NodeHostname=$(hostname -s) NodeAddr=127.0.0.1 Port=[$first-$last] CPUs=$cpus State=UNKNOWN
PartitionName=local Nodes=ALL Default=YES MaxTime=INFINITE State=UP
CONF
}

case $cmd in
  start)
    [ "$(id -u)" = 0 ] || { echo "slurmd must run as root" >&2; exit 1; }
    stop
    start_munge
    write_conf
    slurmctld -f "$conf"
    for i in $(seq "$nodes"); do slurmd -f "$conf" -N "n$i"; done
    for _ in $(seq 300); do  # up to a minute: a loaded machine registers nodes slowly
      if SLURM_CONF=$conf sinfo -h -o '%T' 2>/dev/null | grep -qx idle &&
        [ "$(SLURM_CONF=$conf sinfo -h -N -o '%T' | grep -cx idle)" = "$nodes" ]; then
        echo "export SLURM_CONF=$conf"
        exit 0
      fi
      sleep 0.2
    done
    echo "the nodes did not become idle; see $dir/log" >&2
    SLURM_CONF=$conf sinfo -N >&2 || true
    exit 1
    ;;
  stop) stop ;;
  *) echo "usage: local-cluster.sh start|stop STATE_DIR [NODES] [CPUS_PER_NODE]" >&2; exit 2 ;;
esac
