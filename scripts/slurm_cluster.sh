#!/usr/bin/env bash
# A single-node SLURM cluster on this machine, for the tests: munged, slurmctld and slurmd on
# localhost, one partition "debug" with all CPUs. Needs root; installs Debian's slurm-wlm and munge
# when missing.
#
#   scripts/slurm_cluster.sh start    # install if needed, configure, start, wait until the node is idle
#   scripts/slurm_cluster.sh stop     # stop the daemons this script started
#   scripts/slurm_cluster.sh status
#
# State, logs and spool live under $LZ_SLURM_DIR (default /tmp/lightning-zero-slurm).
set -euo pipefail
DIR=${LZ_SLURM_DIR:-/tmp/lightning-zero-slurm}
CONF=/etc/slurm/slurm.conf

install_if_missing() {
  if ! command -v slurmctld >/dev/null || ! command -v munged >/dev/null; then
    echo "installing slurm-wlm and munge ..."
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm munge >/dev/null
  fi
}

start_munge() {
  mkdir -p /etc/munge /run/munge /var/log/munge /var/lib/munge
  if [ ! -s /etc/munge/munge.key ]; then
    dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
  fi
  chmod 400 /etc/munge/munge.key
  if ! pgrep -x munged >/dev/null; then
    munged --force
  fi
}

write_conf() {
  local host cpus mem
  host=$(hostname)
  cpus=$(nproc --all)  # --all: OMP_NUM_THREADS, set by test runs, would shrink the node
  mem=$(( $(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 - 2048 ))
  mkdir -p "$DIR/state" "$DIR/spool" "$DIR/log" /etc/slurm
  cat > "$CONF" <<CONF
# written by lightning-zero scripts/slurm_cluster.sh
ClusterName=lzero
SlurmctldHost=$host
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/builtin
MpiDefault=none
ReturnToService=2
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd.log
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
NodeName=$host CPUs=$cpus RealMemory=$mem State=UNKNOWN
PartitionName=debug Nodes=$host Default=YES MaxTime=INFINITE State=UP
CONF
}

wait_idle() {
  local deadline=$((SECONDS + 60))
  until sinfo -h -o %T 2>/dev/null | grep -qE '^(idle|mixed|allocated)'; do
    if [ $SECONDS -ge $deadline ]; then
      echo "slurm did not become ready in 60 s; logs in $DIR/log" >&2
      sinfo >&2 || true
      exit 1
    fi
    sleep 1
  done
}

case "${1:-}" in
  start)
    install_if_missing
    start_munge
    write_conf
    pgrep -x slurmctld >/dev/null || slurmctld
    pgrep -x slurmd >/dev/null || slurmd
    wait_idle
    echo "slurm ready: $(sinfo -h -o '%P %D %c %T')"
    ;;
  stop)
    pkill -x slurmd || true
    pkill -x slurmctld || true
    pkill -x munged || true
    ;;
  status)
    sinfo && squeue
    ;;
  *)
    echo "usage: $0 start|stop|status" >&2
    exit 2
    ;;
esac
