#!/usr/bin/env bash
# Stop the single-node SLURM that slurm-up.sh started (slurmd, slurmctld; munged too), from their pid files.
# Environment: WMTP_SLURM_DIR (the same state folder as slurm-up.sh; default /var/tmp/wmtp-slurm).
set -uo pipefail
STATE="${WMTP_SLURM_DIR:-/var/tmp/wmtp-slurm}"
for daemon in slurmd slurmctld; do
    pid=$(cat "$STATE/$daemon.pid" 2>/dev/null) || continue  # the daemon removes its pid file as it exits
    if [[ -n "$pid" ]] && kill -0 "$pid" 2>/dev/null; then
        kill "$pid"
        for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
        kill -9 "$pid" 2>/dev/null || true
    fi
done
pkill -u munge -x munged 2>/dev/null || true
echo "slurm-down: stopped" >&2
