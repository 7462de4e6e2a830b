#!/usr/bin/env bash
# Runs h200_cells.sh longer than one device call allows: in its own session on the H200, followed by short calls.
#
# A device call lasts at most 10 minutes and the machine keeps its disk only while calls follow each other within
# about 30 s. So one call starts the runs in the background and returns, and each later call follows them for a
# while and brings back what is there so far: the progress log, the raw files packed afresh, the step file once a
# run has written it. A piece cut short by the lease's end costs only itself; the raw files of every finished piece
# are in each call's $OUT.
#
# Usage, from the repository root on the H200:
#   bash scripts/device/h200_background.sh start LAST_START_S -- "CELLS ARGS" ["CELLS ARGS" ...]
#       runs `h200_cells.sh CELLS ARGS` for each quoted group in turn, with the same $WMTP_REVISION; no piece of any
#       group starts later than LAST_START_S seconds after this call (each group's --budget-s is what is left;
#       a group with nothing left only collects)
#   bash scripts/device/h200_background.sh follow WAIT_S
#       waits until the runs are over or WAIT_S seconds have passed, then copies their state into $OUT
# Exit status of follow: 0 once every group has ended, 3 while they still run.
set -uo pipefail

state=/tmp/wmtp-background
cells_out=$state/out
raw_root=results/h200-vllm/raw

die() { echo "h200_background: ERROR: $*" >&2; exit 1; }

start() {
  local last_start=$1
  shift
  [ "${1:-}" = "--" ] && shift
  [ $# -gt 0 ] || die "name at least one group of h200_cells.sh arguments"
  [ -f "$state/pid" ] && kill -0 "$(cat "$state/pid")" 2>/dev/null && die "runs already under way (pid $(cat "$state/pid"))"
  rm -rf "$state"
  mkdir -p "$cells_out"
  # A copy: the next call's fresh working tree must not change the script under a running bash.
  cp scripts/device/h200_cells.sh "$state/cells.sh"
  printf '%s\n' "$@" >"$state/groups"
  pwd >"$state/root"
  local deadline=$(($(date +%s) + last_start))
  setsid nohup bash -c '
    state=$1 deadline=$2
    while IFS= read -r group; do
      left=$((deadline - $(date +%s)))
      # h200_cells.sh reads --budget-s 0 as no limit, and --pieces 0 as collect only.
      if [ "$left" -gt 0 ]; then limits="--budget-s $left"; else limits="--pieces 0"; fi
      echo "group: $group $limits" >>"$state/groups.log"
      eval "OUT=$state/out bash $state/cells.sh $group $limits" >>"$state/cells.log" 2>&1
      echo "exit $? for: $group" >>"$state/groups.log"
    done <"$state/groups"
    touch "$state/done"
  ' background "$state" "$deadline" </dev/null >/dev/null 2>&1 &
  echo $! >"$state/pid"
  echo "h200_background: started pid $(cat "$state/pid"); no piece starts after $(date -u -d "@$deadline" +%H:%M:%S)"
}

follow() {
  local wait_s=$1 waited=0
  [ -n "${OUT:-}" ] || die "set OUT to the folder that comes back"
  [ -d "$state" ] || die "nothing was started on this machine (its disk was reset if the last call was > 30 s ago)"
  while [ ! -f "$state/done" ] && [ "$waited" -lt "$wait_s" ]; do
    sleep 5
    waited=$((waited + 5))
  done
  cp "$state"/groups.log "$state"/cells.log "$OUT"/ 2>/dev/null
  cp "$cells_out"/*.csv "$cells_out"/progress.log "$cells_out"/failure.json "$OUT"/ 2>/dev/null
  # The runs write where they started, which need not be this call's copy of the tree.
  (cd "$(cat "$state/root")" && [ -d "$raw_root" ] && tar czf "$OUT/raw.tar.gz" "$raw_root")
  echo "load average: $(cut -d' ' -f1-3 /proc/loadavg)" | tee "$OUT/load.txt"
  tail -n 8 "$cells_out/progress.log" 2>/dev/null
  [ -f "$state/done" ] && { cat "$state/groups.log"; return 0; }
  return 3
}

case ${1:-} in
  start) shift; [ $# -ge 2 ] || die "usage: start LAST_START_S -- \"CELLS ARGS\" ..."; start "$@" ;;
  follow) [ $# -eq 2 ] || die "usage: follow WAIT_S"; follow "$2" ;;
  *) sed -n '2,17p' "$0"; exit 2 ;;
esac
