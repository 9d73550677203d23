#!/usr/bin/env bash
# A two-node Slurm cluster on this one host, for the tests marked `slurm` (tests/test_slurm.py) and for trying the
# batch scripts by hand. Debian's Slurm (22.05 on bookworm) and munge; root only.
#
#   scripts/local_slurm.sh up       # install when missing, write the config, start munged, slurmctld and the
#                                   # nodes n1 and n2 (slurmd -N n1 / -N n2), wait until both are idle
#   scripts/local_slurm.sh status   # sinfo; exit 0 when both nodes answer
#   scripts/local_slurm.sh down     # stop the daemons this script started (by their pid files)
#
# Idempotent: `up` on a running cluster only checks it. The nodes are 127.0.0.1 under the names n1 and n2
# (/etc/hosts entries are added), each with its own port, spool, log and pid file (without its own pid file the
# second slurmd silently stops the first). CPUs per node: SLURM_LOCAL_CPUS (default: this host's count, at least 1).
# Partition `debug` (default), no accounting, no time-limit enforcement beyond the job's own --time.
set -euo pipefail

etc=/etc/slurm
state=/var/lib/slurm-local
log=/var/log/slurm-local
run=/run/slurm-local
conf=$etc/slurm.conf

need_root() {
  if [[ $(id -u) -ne 0 ]]; then
    echo "local_slurm: needs root (it installs packages and starts system daemons)" >&2
    exit 2
  fi
}

install_packages() {
  if command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v sbatch >/dev/null \
     && command -v munged >/dev/null; then
    return
  fi
  if ! command -v apt-get >/dev/null; then
    echo "local_slurm: Slurm is not installed and there is no apt-get to install it" >&2
    exit 3
  fi
  echo "local_slurm: installing slurmctld slurmd slurm-client munge (apt)"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq >/dev/null
  apt-get install -y -qq --no-install-recommends slurmctld slurmd slurm-client munge >/dev/null
}

write_config() {
  local cpus=${SLURM_LOCAL_CPUS:-$(nproc)}
  local host
  host=$(hostname -s)
  mkdir -p "$etc" "$state/ctld" "$state/d" "$log" "$run"
  for node in n1 n2; do
    grep -qE "^[^#]*[[:space:]]$node([[:space:]]|$)" /etc/hosts || echo "127.0.0.1 $node" >> /etc/hosts
  done
  cat > "$conf.new" <<EOF
# Written by scripts/local_slurm.sh: two nodes on one host, for tests.
ClusterName=local
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=16817
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation=$state/ctld
SlurmdSpoolDir=$state/d/%n
SlurmctldPidFile=$run/slurmctld.pid
SlurmdPidFile=$run/slurmd-%n.pid
SlurmctldLogFile=$log/slurmctld.log
SlurmdLogFile=$log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
ReturnToService=2
SchedulerType=sched/backfill
SchedulerParameters=bf_interval=1
MessageTimeout=20
KillWait=30
InactiveLimit=0
MinJobAge=300
JobRequeue=1
NodeName=n1 NodeHostname=$host NodeAddr=127.0.0.1 Port=17001 CPUs=$cpus State=UNKNOWN
NodeName=n2 NodeHostname=$host NodeAddr=127.0.0.1 Port=17002 CPUs=$cpus State=UNKNOWN
PartitionName=debug Nodes=n1,n2 Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
EOF
  if [[ -f $conf ]] && cmp -s "$conf" "$conf.new"; then
    rm "$conf.new"
  else
    mv "$conf.new" "$conf"
  fi
  mkdir -p "$state/d/n1" "$state/d/n2"
}

alive() {  # alive PIDFILE: the process named in PIDFILE runs
  [[ -f $1 ]] && kill -0 "$(cat "$1")" 2>/dev/null
}

start_munge() {
  if [[ ! -f /etc/munge/munge.key ]]; then
    mkdir -p /etc/munge
    dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
  fi
  chown munge:munge /etc/munge/munge.key 2>/dev/null || true
  chmod 400 /etc/munge/munge.key
  mkdir -p /run/munge /var/log/munge /var/lib/munge
  chown munge:munge /run/munge /var/log/munge /var/lib/munge 2>/dev/null || true
  if ! munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
    if id munge >/dev/null 2>&1; then
      su -s /bin/sh munge -c "munged --force" || munged --force
    else
      munged --force
    fi
  fi
}

up() {
  need_root
  install_packages
  write_config
  start_munge
  alive "$run/slurmctld.pid" || slurmctld
  for node in n1 n2; do
    alive "$run/slurmd-$node.pid" || slurmd -N "$node"
  done
  local deadline=$((SECONDS + ${SLURM_LOCAL_TIMEOUT:-60}))
  while (( SECONDS < deadline )); do
    # Nodes left down by an earlier run (a killed slurmd) come back without an admin's resume.
    scontrol update NodeName=n1,n2 State=RESUME >/dev/null 2>&1 || true
    local states
    states=$(sinfo -h -N -o '%N %t' 2>/dev/null | sort -u | tr '\n' ' ')
    if [[ $states =~ n1\ (idle|mix|alloc) ]] && [[ $states =~ n2\ (idle|mix|alloc) ]]; then
      echo "local_slurm: up: $states"
      return 0
    fi
    sleep 1
  done
  echo "local_slurm: the nodes did not become idle within ${SLURM_LOCAL_TIMEOUT:-60} s: ${states:-no answer}" >&2
  echo "local_slurm: logs in $log" >&2
  exit 1
}

down() {
  for pidfile in "$run/slurmd-n1.pid" "$run/slurmd-n2.pid" "$run/slurmctld.pid"; do
    if alive "$pidfile"; then
      kill "$(cat "$pidfile")"
    fi
  done
  echo "local_slurm: down"
}

status() {
  if ! command -v sinfo >/dev/null; then
    echo "local_slurm: not installed"
    exit 1
  fi
  local states
  states=$(sinfo -h -N -o '%N %t' 2>/dev/null | sort -u | tr '\n' ' ') || true
  echo "local_slurm: ${states:-no answer from slurmctld}"
  [[ $states =~ n1\ (idle|mix|alloc) ]] && [[ $states =~ n2\ (idle|mix|alloc) ]]
}

case ${1:-} in
  up) up ;;
  down) need_root; down ;;
  status) status ;;
  *) echo "usage: scripts/local_slurm.sh up|down|status" >&2; exit 2 ;;
esac
