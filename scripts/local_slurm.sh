#!/usr/bin/env bash
# A two-node Slurm cluster on this one host, for the tests marked `slurm` (tests/test_slurm.py) and for trying the
# batch scripts by hand. Debian's Slurm (22.05 on bookworm) and munge; root only.
#
#   scripts/local_slurm.sh up       # install when missing, write the config, start munged, slurmctld and the
#                                   # nodes n1 and n2 (slurmd -N n1 / -N n2), wait until both are idle
#   scripts/local_slurm.sh status   # sinfo; exit 0 when both nodes answer
#   scripts/local_slurm.sh down     # undo what `up` did (below)
#
# Idempotent: `up` on a running cluster only checks it. The nodes are 127.0.0.1 under the names n1 and n2
# (/etc/hosts entries are added), each with its own port, spool, log and pid file (without its own pid file the
# second slurmd silently stops the first). CPUs per node: SLURM_LOCAL_CPUS (default: this host's count, at least 1).
# Partition `debug` (default), no accounting, no time-limit enforcement beyond the job's own --time.
#
# What `up` changes is recorded under the state directory, and `down` undoes exactly that: it stops the daemons
# (each pid is checked against the expected program, and slurmd's node name, before a signal is sent: a stale pid
# file never kills an unrelated process), stops munged if `up` started it, removes the /etc/hosts lines `up` added,
# puts back the slurm.conf that was there before (`up` keeps a copy) or removes the one it wrote, removes the munge
# key it created, and removes its state and run directories. The packages it installed stay; the logs stay.
#
# Paths can be moved for tests (tests/test_local_slurm.py runs up/down against stub daemons this way):
# LOCAL_SLURM_ETC, LOCAL_SLURM_HOSTS, LOCAL_SLURM_STATE, LOCAL_SLURM_LOG, LOCAL_SLURM_RUN, LOCAL_SLURM_MUNGE_ETC,
# LOCAL_SLURM_MUNGE_RUN (SLURM_CONF then points the daemons at the moved slurm.conf).
set -euo pipefail

etc=${LOCAL_SLURM_ETC:-/etc/slurm}
hosts=${LOCAL_SLURM_HOSTS:-/etc/hosts}
state=${LOCAL_SLURM_STATE:-/var/lib/slurm-local}
log=${LOCAL_SLURM_LOG:-/var/log/slurm-local}
run=${LOCAL_SLURM_RUN:-/run/slurm-local}
munge_etc=${LOCAL_SLURM_MUNGE_ETC:-/etc/munge}
munge_run=${LOCAL_SLURM_MUNGE_RUN:-/run/munge}
conf=$etc/slurm.conf
export SLURM_CONF=$conf
header="# Written by scripts/local_slurm.sh: two nodes on one host, for tests."
record=$state/undo            # what `up` changed, for `down`
backup=$record/slurm.conf.before

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

runs() {  # runs PIDFILE PROGRAM [ARGS]: the pid in PIDFILE is a running PROGRAM whose command line holds ARGS
  [[ -f $1 ]] || return 1
  local pid
  pid=$(tr -d '[:space:]' < "$1")
  [[ $pid =~ ^[0-9]+$ && -r /proc/$pid/comm ]] || return 1
  [[ $(< "/proc/$pid/comm") == "$2" ]] || return 1
  [[ -z ${3:-} ]] && return 0
  local cmdline
  cmdline=" $(tr '\0' ' ' < "/proc/$pid/cmdline")"
  [[ $cmdline == *" $3 "* ]]
}

stop() {  # stop PIDFILE PROGRAM [ARGS]: SIGTERM to the process if it is that program, then wait for it (30 s)
  if ! runs "$@"; then
    if [[ -f $1 ]]; then
      echo "local_slurm: $1 does not name a running $2${3:+ ($3)}: nothing signalled"
    fi
    return 0
  fi
  local pid
  pid=$(tr -d '[:space:]' < "$1")
  kill "$pid"
  for _ in $(seq 300); do
    [[ -d /proc/$pid ]] || return 0
    sleep 0.1
  done
  echo "local_slurm: $2 ($pid) did not stop within 30 s" >&2
}

write_config() {
  local cpus=${SLURM_LOCAL_CPUS:-$(nproc)}
  local host
  host=$(hostname -s)
  mkdir -p "$etc" "$state/ctld" "$state/d" "$log" "$run" "$record"
  for node in n1 n2; do
    if ! grep -qE "^[^#]*[[:space:]]$node([[:space:]]|$)" "$hosts"; then
      echo "127.0.0.1 $node" >> "$hosts"
      echo "127.0.0.1 $node" >> "$record/hosts-added"
    fi
  done
  if [[ -f $conf && ! -f $backup ]] && [[ $(head -n 1 "$conf") != "$header" ]]; then
    cp -p "$conf" "$backup"   # somebody else's slurm.conf: put back by `down`
  fi
  cat > "$conf.new" <<EOF
$header
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

start_munge() {
  if [[ ! -f $munge_etc/munge.key ]]; then
    mkdir -p "$munge_etc"
    dd if=/dev/urandom of="$munge_etc/munge.key" bs=1024 count=1 status=none
    touch "$record/munge-key-created"
  fi
  chown munge:munge "$munge_etc/munge.key" 2>/dev/null || true
  chmod 400 "$munge_etc/munge.key"
  mkdir -p "$munge_run" /var/log/munge /var/lib/munge
  chown munge:munge "$munge_run" /var/log/munge /var/lib/munge 2>/dev/null || true
  if ! munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
    local munged
    munged=$(command -v munged)
    if id munge >/dev/null 2>&1; then
      su -s /bin/sh munge -c "$munged --force" || "$munged" --force
    else
      "$munged" --force
    fi
    touch "$record/munged-started"
  fi
}

up() {
  need_root
  install_packages
  write_config
  start_munge
  runs "$run/slurmctld.pid" slurmctld || slurmctld
  for node in n1 n2; do
    runs "$run/slurmd-$node.pid" slurmd "-N $node" || slurmd -N "$node"
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
  for node in n1 n2; do
    stop "$run/slurmd-$node.pid" slurmd "-N $node"
  done
  stop "$run/slurmctld.pid" slurmctld
  if [[ -f $record/munged-started ]]; then
    stop "$munge_run/munged.pid" munged
  fi
  if [[ -f $record/hosts-added ]]; then
    # In place (cat >, not mv): /etc/hosts is often a bind mount in containers.
    local kept
    kept=$(grep -vxF -f "$record/hosts-added" "$hosts" || true)
    printf '%s\n' "$kept" > "$hosts"
  fi
  if [[ -f $backup ]]; then
    cp -p "$backup" "$conf"
  elif [[ -f $conf ]] && [[ $(head -n 1 "$conf") == "$header" ]]; then
    rm "$conf"
  fi
  if [[ -f $record/munge-key-created ]]; then
    rm -f "$munge_etc/munge.key"
  fi
  rm -rf "$state" "$run"
  echo "local_slurm: down (logs kept in $log)"
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
