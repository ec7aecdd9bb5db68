#!/usr/bin/env bash
# A one-node Slurm cluster on this machine, for tests/train/test_slurm.py and trying the template.
#
#   scripts/slurm/local_cluster.sh up      install (root + apt) if missing, start munged, slurmctld,
#                                          slurmd; wait until the node is idle; print SLURM_CONF=...
#   scripts/slurm/local_cluster.sh down    stop the daemons this script started
#   scripts/slurm/local_cluster.sh status  sinfo
#
# Then: export SLURM_CONF=$STATE/slurm.conf (what `up` prints) and use sbatch, squeue, scontrol.
# Environment: UPTRAIN_SLURM_STATE state folder (default /tmp/uptrain-slurm: config, spool, logs,
# pid files); UPTRAIN_SLURM_PORT slurmctld's port (default 6917; slurmd gets the next one).
# Idempotent: `up` on a running cluster only checks it; a fresh start has an empty queue (jobs of
# an earlier, stopped cluster are not brought back). Needs root (SlurmUser=root) and only loopback
# addresses. Exit codes: 0 up/down, 3 Slurm or munge is missing and cannot be installed, 4 a daemon
# did not start (the last lines of its log are printed).
set -euo pipefail
STATE=${UPTRAIN_SLURM_STATE:-/tmp/uptrain-slurm}
PORT=${UPTRAIN_SLURM_PORT:-6917}
CONF=$STATE/slurm.conf
export SLURM_CONF=$CONF
NODE=$(hostname -s)

say() { echo "local_cluster: $*" >&2; }

install_if_missing() {
  command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v munged >/dev/null && return 0
  if [[ $(id -u) -ne 0 ]] || ! command -v apt-get >/dev/null; then
    say "slurmctld/slurmd/munged missing and cannot install them (needs root and apt-get)"
    exit 3
  fi
  say "installing slurm-wlm and munge (apt-get)"
  if ! { DEBIAN_FRONTEND=noninteractive apt-get update -qq &&
         DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm munge; } >"$STATE/apt.log" 2>&1; then
    say "apt-get install slurm-wlm munge failed:"; tail -n 5 "$STATE/apt.log" >&2
    exit 3
  fi
}

start_munge() {
  # Slurm authenticates every RPC with munge, on munge's default socket.
  if munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then return 0; fi
  mkdir -p /etc/munge /var/lib/munge /var/log/munge /run/munge
  if [[ ! -s /etc/munge/munge.key ]]; then
    mungekey --create --keyfile /etc/munge/munge.key 2>/dev/null ||
      dd if=/dev/urandom of=/etc/munge/munge.key bs=1 count=1024 status=none
  fi
  chown -R munge:munge /etc/munge /var/lib/munge /var/log/munge /run/munge
  chmod 700 /etc/munge; chmod 400 /etc/munge/munge.key
  runuser -u munge -- munged 2>"$STATE/munged.err" || su -s /bin/sh munge -c munged 2>>"$STATE/munged.err" || true
  for _ in $(seq 50); do
    munge -n 2>/dev/null | unmunge >/dev/null 2>&1 && return 0
    sleep 0.1
  done
  say "munged did not start:"; cat "$STATE/munged.err" >&2
  exit 4
}

write_conf() {
  local cpus mem
  cpus=$(nproc)
  mem=$(( $(free -m | awk '/^Mem:/ {print $2}') * 8 / 10 ))  # below what the node reports
  mkdir -p "$STATE/state" "$STATE/spool"
  cat >"$CONF.tmp" <<EOF
# Written by scripts/slurm/local_cluster.sh: one node ($NODE) on the loopback address.
ClusterName=uptrain-local
SlurmctldHost=$NODE(127.0.0.1)
SlurmctldPort=$PORT
SlurmdPort=$((PORT + 1))
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# A requeued job waits until its old credential expires (default 120 s; then the job would fail with
# "Job credential revoked" if started sooner): 10 s here, so that a test sees the restart soon.
AuthInfo=cred_expire=10
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SwitchType=switch/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
# Look for startable jobs every 2 s (defaults 30 s, 60 s): a requeued job starts as soon as it may.
SchedulerParameters=bf_interval=2,sched_interval=2
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
JobAcctGatherType=jobacct_gather/none
ReturnToService=2
JobRequeue=1
# Keep finished jobs visible to scontrol for a while (the test reads their state and restarts).
MinJobAge=600
# Seconds between SIGTERM and SIGKILL at a time limit or scancel (Slurm's default).
KillWait=30
StateSaveLocation=$STATE/state
SlurmdSpoolDir=$STATE/spool
SlurmctldPidFile=$STATE/slurmctld.pid
SlurmdPidFile=$STATE/slurmd.pid
SlurmctldLogFile=$STATE/slurmctld.log
SlurmdLogFile=$STATE/slurmd.log
NodeName=$NODE NodeAddr=127.0.0.1 NodeHostname=$NODE CPUs=$cpus RealMemory=$mem State=UNKNOWN
PartitionName=local Nodes=$NODE Default=YES MaxTime=INFINITE State=UP
EOF
  mv "$CONF.tmp" "$CONF"
}

running() {  # the daemon whose pid file is $1 is alive
  [[ -s $1 ]] && kill -0 "$(cat "$1")" 2>/dev/null
}

node_idle() {
  [[ $(sinfo -h -N -n "$NODE" -o %t 2>/dev/null) =~ ^(idle|mix|alloc) ]]
}

up() {
  mkdir -p "$STATE"
  install_if_missing
  start_munge
  running "$STATE/slurmctld.pid" || write_conf
  if ! running "$STATE/slurmctld.pid"; then
    # A fresh start begins with an empty queue (-c): the state saved by an earlier controller holds
    # jobs whose processes died with it. Recovered, such a job counts as running on the (exclusive)
    # node, so every new job would wait behind a ghost: seen in CI after a cluster was stopped mid-job.
    rm -rf "$STATE/state" && mkdir -p "$STATE/state"
    slurmctld -c -f "$CONF" || { say "slurmctld failed:"; tail -n 20 "$STATE/slurmctld.log" >&2; exit 4; }
  fi
  if ! running "$STATE/slurmd.pid"; then
    rm -rf "$STATE/spool" && mkdir -p "$STATE/spool"  # the dead slurmd's job step records
    slurmd -f "$CONF" || { say "slurmd failed:"; tail -n 20 "$STATE/slurmd.log" >&2; exit 4; }
  fi
  for _ in $(seq 100); do
    if node_idle; then
      echo "SLURM_CONF=$CONF"
      return 0
    fi
    # a node left down by an earlier run (ReturnToService covers most cases)
    scontrol update NodeName="$NODE" State=RESUME >/dev/null 2>&1 || true
    sleep 0.3
  done
  say "node $NODE not idle after 30 s:"; sinfo -N >&2 || true
  tail -n 10 "$STATE/slurmctld.log" "$STATE/slurmd.log" >&2 || true
  exit 4
}

down() {
  local name pid
  for name in slurmd slurmctld; do
    running "$STATE/$name.pid" || continue
    pid=$(cat "$STATE/$name.pid")
    kill "$pid" 2>/dev/null || true
    for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
  done
  # munged is shared with anything else on the machine using munge: left running.
}

case "${1:-}" in
  up) up ;;
  down) down ;;
  status) sinfo ;;
  *) sed -n '2,14p' "$0" >&2; exit 2 ;;
esac
