#!/usr/bin/env bash
# A real single-node SLURM (Debian's 22.05) for CI and for trying the slurm profile on one machine:
# installs slurmctld, slurmd, slurm-client and munge with apt-get, writes a config under a state dir,
# starts munged, slurmctld and slurmd (no systemd needed), and waits until the node takes jobs.
# Idempotent: a running cluster whose node answers is left alone. Needs root.
#
# The node advertises a fake GPU gres (gpu:2, its File= entries are links to /dev/null and /dev/zero), so
# jobs that ask --gpus get CUDA_VISIBLE_DEVICES set, as on a GPU cluster. There is no accounting database:
# `sacct` cannot answer, so Snakemake's slurm plugin must query job states with `squeue`
# (--slurm-status-command squeue), and MinJobAge is kept at 300 s so squeue still lists finished jobs.
#
# Environment: WMTP_SLURM_DIR (state, spool, logs; default /var/tmp/wmtp-slurm).
set -euo pipefail

STATE="${WMTP_SLURM_DIR:-/var/tmp/wmtp-slurm}"
CONF_DIR=/etc/slurm
NODE="$(hostname -s)"

log() { echo "slurm-up: $*" >&2; }

node_ready() {
    scontrol ping >/dev/null 2>&1 || return 1
    local state
    state="$(sinfo -h -n "$NODE" -o %t 2>/dev/null | head -1)"
    [[ "$state" == idle* || "$state" == mix* || "$state" == alloc* ]]
}

if command -v scontrol >/dev/null 2>&1 && node_ready; then
    log "already up: node $NODE $(sinfo -h -n "$NODE" -o %t | head -1)"
    exit 0
fi

if [[ "$(id -u)" != 0 ]]; then
    log "needs root (apt-get, munged as the munge user, slurmd)"; exit 1
fi

if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null || ! command -v sbatch >/dev/null \
        || ! command -v munged >/dev/null; then
    log "installing slurmctld slurmd slurm-client munge"
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y -qq slurmctld slurmd slurm-client munge >/dev/null \
        || { apt-get update -qq && apt-get install -y -qq slurmctld slurmd slurm-client munge >/dev/null; }
fi

# --- munge ------------------------------------------------------------------------------------------
mkdir -p /run/munge /var/log/munge /var/lib/munge /etc/munge
if [[ ! -s /etc/munge/munge.key ]]; then
    if command -v mungekey >/dev/null; then mungekey --create --keyfile=/etc/munge/munge.key
    else dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none; fi
fi
chown -R munge:munge /run/munge /var/log/munge /var/lib/munge /etc/munge
chmod 0700 /etc/munge /var/lib/munge /var/log/munge
chmod 0755 /run/munge
chmod 0400 /etc/munge/munge.key
if ! munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
    log "starting munged"
    runuser -u munge -- /usr/sbin/munged
    for _ in $(seq 50); do munge -n 2>/dev/null | unmunge >/dev/null 2>&1 && break; sleep 0.1; done
fi

# --- slurm.conf -------------------------------------------------------------------------------------
mkdir -p "$STATE"/{state,spool,log,dev} "$CONF_DIR"
ln -sf /dev/null "$STATE/dev/gpu0"
ln -sf /dev/zero "$STATE/dev/gpu1"
cpus="$(nproc)"
mem_mb="$(awk '/MemTotal/ {printf "%d", $2 / 1024 * 0.9}' /proc/meminfo)"
cat > "$CONF_DIR/slurm.conf" <<EOF
# Written by wmtp scripts/ci/slurm-up.sh: one node, no accounting, a fake gpu:2 gres.
ClusterName=wmtp-ci
SlurmctldHost=$NODE(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation=$STATE/state
SlurmdSpoolDir=$STATE/spool
SlurmctldPidFile=$STATE/slurmctld.pid
SlurmdPidFile=$STATE/slurmd.pid
SlurmctldLogFile=$STATE/log/slurmctld.log
SlurmdLogFile=$STATE/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
# Finished jobs stay visible to squeue this long; the slurm plugin needs >= 3x its first status delay.
MinJobAge=300
ReturnToService=2
SchedulerType=sched/backfill
GresTypes=gpu
NodeName=$NODE NodeAddr=127.0.0.1 CPUs=$cpus RealMemory=$mem_mb Gres=gpu:2 State=UNKNOWN
PartitionName=ci Nodes=$NODE Default=YES MaxTime=INFINITE State=UP
EOF
cat > "$CONF_DIR/gres.conf" <<EOF
# Fake GPUs: slurmd only needs device files to hand out; jobs get CUDA_VISIBLE_DEVICES from them.
NodeName=$NODE Name=gpu File=$STATE/dev/gpu0
NodeName=$NODE Name=gpu File=$STATE/dev/gpu1
EOF

# --- daemons ----------------------------------------------------------------------------------------
running() { [[ -f "$1" ]] && kill -0 "$(cat "$1")" 2>/dev/null; }
if running "$STATE/slurmctld.pid"; then
    scontrol reconfigure >/dev/null 2>&1 || true
else
    log "starting slurmctld"
    slurmctld
fi
if ! running "$STATE/slurmd.pid"; then
    log "starting slurmd"
    slurmd
fi

for i in $(seq 60); do
    if node_ready; then
        log "up after ${i}x0.5 s: $(sinfo -h -o '%P %D %t %G' | head -1)"
        exit 0
    fi
    state="$(sinfo -h -n "$NODE" -o %t 2>/dev/null | head -1 || true)"
    if [[ "$state" == down* || "$state" == drain* || "$state" == unk* ]] && (( i % 4 == 0 )); then
        scontrol update nodename="$NODE" state=resume >/dev/null 2>&1 || true
    fi
    sleep 0.5
done
log "the node did not become ready: $(sinfo -h -N -o '%N %t %E' 2>&1 | head -3)"
tail -n 20 "$STATE/log/slurmctld.log" "$STATE/log/slurmd.log" >&2 || true
exit 1
