#!/usr/bin/env bash
# A real two-node Slurm on one machine, for testing the launchers under sbatch
# (tests/launch/test_launchers.py::test_local_slurm_job and tests/bench/test_study.py::test_local_slurm_study,
# marked slow, on one cluster: tests/conftest.py's local_slurm). Debian 12 /
# Slurm 22.05, root, no systemd. What it sets up and why: docs/local-slurm.md.
#
#   bash scripts/launch/local_slurm.sh install        apt-get the Debian packages (idempotent)
#   bash scripts/launch/local_slurm.sh start DIR      config under DIR, start munged (if not
#                                                     running), slurmctld, slurmd node1 + node2
#   bash scripts/launch/local_slurm.sh stop DIR       stop what start started, by PID, and wait
#   export SLURM_CONF=DIR/etc/slurm.conf              for sbatch / squeue / scontrol
#
# The two nodes (node1, node2) are emulated on this host with 8 CPUs and 8 fake
# GPUs (/dev/null links) each, in one partition named batch (Frontier's, so the
# Frontier profiles' #SBATCH -p batch is taken as shipped); SlurmdParameters=config_overrides lets them claim
# more CPUs than the machine has. Emulated node names do not resolve: jobs use
# MASTER_ADDR=$(hostname -i), which the launcher does by default.
set -euo pipefail

cmd=${1:-}
me="scripts/launch/local_slurm.sh"

write_config() {
  local d=$1 host
  host=$(hostname -s)
  mkdir -p "$d/etc" "$d/state" "$d/spool" "$d/log" "$d/run" "$d/fakedev"
  for i in 0 1 2 3 4 5 6 7; do [ -e "$d/fakedev/gpu$i" ] || ln -s /dev/null "$d/fakedev/gpu$i"; done
  cat >"$d/etc/slurm.conf" <<EOF
ClusterName=lbplocal
SlurmctldHost=$host
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
MpiDefault=none
GresTypes=gpu
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SwitchType=switch/none
ReturnToService=2
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
StateSaveLocation=$d/state
SlurmdSpoolDir=$d/spool/%n
SlurmctldPidFile=$d/run/slurmctld.pid
SlurmdPidFile=$d/run/slurmd-%n.pid
SlurmctldLogFile=$d/log/slurmctld.log
SlurmdLogFile=$d/log/slurmd-%n.log
SlurmctldPort=${LBP_SLURMCTLD_PORT:-16817}
SlurmctldDebug=info
SlurmdDebug=info
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
InactiveLimit=0
KillWait=10
MinJobAge=300
SlurmctldTimeout=30
SlurmdTimeout=60
Waittime=0
NodeName=node[1-2] NodeHostname=$host NodeAddr=127.0.0.1 Port=[17001-17002] CPUs=8 Boards=1 SocketsPerBoard=1 CoresPerSocket=8 ThreadsPerCore=1 RealMemory=8000 Gres=gpu:8 State=UNKNOWN
PartitionName=batch Nodes=node[1-2] Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
EOF
  cat >"$d/etc/gres.conf" <<EOF
AutoDetect=off
NodeName=node[1-2] Name=gpu File=$d/fakedev/gpu[0-7]
EOF
}

case "$cmd" in
  install)
    if command -v slurmctld >/dev/null && command -v slurmd >/dev/null \
       && command -v sbatch >/dev/null && command -v munged >/dev/null; then
      echo "$me: slurm and munge already installed"; exit 0
    fi
    [ "$(id -u)" = 0 ] || { echo "$me: install needs root (apt-get)" >&2; exit 2; }
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
      slurmctld slurmd slurm-client munge >/dev/null
    echo "$me: installed $(sbatch --version)" ;;
  start)
    d=${2:?usage: $me start DIR}
    d=$(mkdir -p "$d" && cd "$d" && pwd)
    write_config "$d"
    export SLURM_CONF=$d/etc/slurm.conf
    install -d -o munge -g munge -m 0755 /run/munge
    if ! munge -n >/dev/null 2>&1; then
      runuser -u munge -- /usr/sbin/munged
      cp /run/munge/munged.pid "$d/run/munged.pid"  # ours: stop kills it
    fi
    for _ in $(seq 1 40); do munge -n >/dev/null 2>&1 && break; sleep 0.25; done
    slurmctld -f "$SLURM_CONF"
    slurmd -f "$SLURM_CONF" -N node1
    slurmd -f "$SLURM_CONF" -N node2
    for _ in $(seq 1 120); do
      [ "$(sinfo -h -N -o %T 2>/dev/null | grep -c '^idle')" = 2 ] && break
      sleep 0.25
    done
    sinfo -N -o '%N %P %T %c %G'
    [ "$(sinfo -h -N -o %T 2>/dev/null | grep -c '^idle')" = 2 ] \
      || { echo "$me: nodes not idle; logs in $d/log" >&2; exit 1; } ;;
  stop)
    d=${2:?usage: $me stop DIR}
    pids=()
    for f in "$d/run/slurmd-node1.pid" "$d/run/slurmd-node2.pid" "$d/run/slurmctld.pid" \
             "$d/run/munged.pid"; do
      [ -f "$f" ] || continue
      p=$(cat "$f")
      if kill "$p" 2>/dev/null; then echo "$me: sent TERM to $(basename "$f" .pid) ($p)"; pids+=("$p"); fi
    done
    for _ in $(seq 1 80); do
      alive=0
      for p in "${pids[@]}"; do kill -0 "$p" 2>/dev/null && alive=1; done
      [ "$alive" = 0 ] && { echo "$me: all stopped"; exit 0; }
      sleep 0.25
    done
    echo "$me: still running: ${pids[*]}" >&2; exit 1 ;;
  *)
    echo "usage: $me install | start DIR | stop DIR" >&2; exit 2 ;;
esac
