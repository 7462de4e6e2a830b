#!/usr/bin/env bash
# The workflow on an H200 for longer than one device call: Snakemake, piece by piece, in its own session.
#
# A device call lasts at most 10 minutes and the machine keeps its disk only while calls follow each other within
# about 30 s. So one call starts the runs in the background and returns, and each later call follows them for a
# while and brings back what is there so far: the progress log, Snakemake's output, the raw files packed afresh, the
# step files once made (packed), the kernel caches. A piece cut short by the lease's end costs only itself; every
# finished piece's raw files are in each call's $OUT.
#
# Runs ON the H200, from the repository root, after scripts/device/engine_install.sh installed the carried vLLM and
# Snakemake (docs/gpu.md). Every run is `snakemake --workflow-profile profiles/h200 --configfile STUDY TARGET`;
# the rules do the work, so any single-GPU machine with a package index runs the same commands without this script.
#
# Usage, from the repository root on the H200:
#   bash scripts/device/h200_background.sh start LAST_START_S STUDY ["PIECES ARGS" ...]
#       the pieces `wmtp pieces --config STUDY PIECES ARGS` names (each quoted group in turn; none: every piece the
#       study lists), in that order, one Snakemake run each; a piece that is there is passed over, and none starts
#       later than LAST_START_S seconds after this call; a failed piece stops the runs. Then, where every piece the
#       study lists is there, its step files (results/<study>/steps/), which start no server
#   bash scripts/device/h200_background.sh plan STUDY ["PIECES ARGS" ...]
#       what start would run: snakemake -n over the same pieces, in the foreground
#   bash scripts/device/h200_background.sh follow WAIT_S
#       waits until the runs are over or WAIT_S seconds have passed, then copies their state into $OUT
# Exit status of follow: 0 once the runs have ended, 3 while they still run.
#
# The runs keep their state (pid, progress log, Snakemake's output) in /tmp/wmtp-background, or in the folder
# $WMTP_BACKGROUND_STATE names, which start empties first: name one that holds nothing else.
#
# Compile caches: .gpu-inputs/compile-cache.tar.gz (or $CARRIED_CACHE), when carried in, is unpacked into the
# engine's cache (results/engines/vllm/cache, or $ENGINE_CACHE) before the first server starts: Triton's kernels,
# the largest part of a cold start's minutes, and SGLang's JIT kernels. follow packs those two back when they fit what
# comes back.
set -uo pipefail

state=${WMTP_BACKGROUND_STATE:-/tmp/wmtp-background} # the runs' own folder, outside every copy of the tree
# The carried engine: vLLM's under /tmp/wmtp-engine; ENGINE_DIR=/tmp/wmtp-sglang (with ENGINE_CACHE=
# results/engines/sglang/cache) for SGLang's, which carries its own Snakemake.
export ENGINE_DIR=${ENGINE_DIR:-/tmp/wmtp-engine}
site=$ENGINE_DIR/site
cache=${ENGINE_CACHE:-results/engines/vllm/cache}
# One carried cache per engine: CARRIED_CACHE=.gpu-inputs/sglang-compile-cache.tar.gz for SGLang's.
carried_cache=${CARRIED_CACHE:-.gpu-inputs/compile-cache.tar.gz}
cache_limit=$((15 * 1024 * 1024)) # what one file back from the H200 may weigh, with room
py=python3

die() { echo "h200_background: ERROR: $*" >&2; exit 1; }
say() { echo "h200_background: $(date -u +%H:%M:%S) $*" | tee -a "$state/progress.log"; }

workflow_env() {
  [ -d "$site" ] || die "no engine at $site: run scripts/device/engine_install.sh first (its last part with --install)"
  export PYTHONPATH="$PWD/src:$site" PYTHONUNBUFFERED=1
  # NVLink multicast is off on these machines.
  export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
  # Triton's kernels beside vLLM's compile cache, which the cells keep in the engine's folder: a second server of
  # the shape starts without the first one's minutes of JIT while the machine stays up.
  export TRITON_CACHE_DIR=$PWD/$cache/triton
  # SGLang's own JIT kernels (nvcc, through TVM-FFI) beside them, for the same reason.
  export TVM_FFI_CACHE_DIR=$PWD/$cache/tvm-ffi
}

snakemake_run() { # snakemake_run STUDY [OPTION ...] -- TARGET ...: the workflow, as any single-GPU machine runs it
  local study=$1
  shift
  # --configfile takes every word up to the next option: the targets come after "--".
  "$py" -m snakemake --workflow-profile profiles/h200 --configfile "$study" "$@"
}

targets() { # targets STUDY ["PIECES ARGS" ...]: the pieces' target paths, in order, each once
  local study=$1 group args
  shift
  [ $# -gt 0 ] || set -- ""
  for group in "$@"; do
    read -ra args <<<"$group"
    "$py" -m wmtp pieces --config "$study" "${args[@]}" || die "wmtp pieces --config $study $group failed (above)"
  done | awk '!seen[$0]++'
}

start() {
  local last_start=$1 study=$2
  shift 2
  [ -f "$state/pid" ] && kill -0 "$(cat "$state/pid")" 2>/dev/null && die "runs already under way (pid $(cat "$state/pid"))"
  # Only a folder of earlier runs is emptied: one holding anything else is someone's.
  if [ -d "$state" ] && [ -n "$(ls -A "$state")" ] && [ ! -f "$state/progress.log" ]; then
    die "$state holds files of no earlier runs; name another folder in WMTP_BACKGROUND_STATE"
  fi
  rm -rf "$state"
  mkdir -p "$state"
  workflow_env
  bash scripts/device/engine_install.sh --wmtp | tee -a "$state/progress.log" || die "wmtp is not beside the engine"
  targets "$study" "$@" >"$state/targets" || exit 1
  [ -s "$state/targets" ] || die "no piece to run"
  if [ -f "$carried_cache" ] && [ ! -d "$cache" ]; then
    if mkdir -p "$cache" && tar xzf "$carried_cache" -C "$cache"; then
      say "compile caches from $carried_cache: $(du -sh "$cache" | cut -f1)"
    else
      rm -rf "$cache"
      say "could not unpack $carried_cache; the servers compile from scratch"
    fi
  fi
  if command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv,noheader >>"$state/progress.log"
  fi
  # A copy: the next call's fresh working tree must not change the script under a running bash.
  cp "$0" "$state/background.sh"
  pwd >"$state/root"
  echo "$cache" >"$state/cache" # where the servers keep their kernels: follow packs them from there
  local deadline=$(($(date +%s) + last_start))
  say "starting $(wc -l <"$state/targets") piece(s) of $study; none starts after $(date -u -d "@$deadline" +%H:%M:%S)"
  setsid nohup bash "$state/background.sh" _run "$deadline" "$study" </dev/null >>"$state/snakemake.log" 2>&1 &
  echo $! >"$state/pid"
}

run_pieces() { # in the background: each piece in turn, then the step files (and any trace table) once every listed piece is there
  local deadline=$1 study=$2 target started missing=0
  workflow_env
  while IFS= read -r target; do
    # Snakemake would find it there too; passing it over here spares a start of Snakemake.
    if [ -f "$target" ]; then
      say "there: $target"
      continue
    fi
    if [ "$(date +%s)" -ge "$deadline" ]; then
      say "past the last start: not starting $target (and any after it)"
      break
    fi
    say "piece: $target"
    started=$SECONDS
    if snakemake_run "$study" -- "$target"; then
      say "done in $((SECONDS - started)) s: $target"
    else
      say "FAILED after $((SECONDS - started)) s: $target (snakemake.log has its log; raw.tar.gz its failure.json)"
      break
    fi
  done <"$state/targets"
  while IFS= read -r target; do
    [ -f "$target" ] || missing=$((missing + 1))
  done < <("$py" -m wmtp pieces --config "$study")
  if [ "$missing" -eq 0 ]; then
    mapfile -t steps < <("$py" -m wmtp pieces --config "$study" --step-files)
    if snakemake_run "$study" -- "${steps[@]}"; then say "step files: ${steps[*]}"; else say "FAILED: the step files"; fi
  else
    say "$missing piece(s) the study lists are not there yet: no step file"
  fi
  touch "$state/done"
}

plan() {
  local study=$1
  shift
  workflow_env
  mapfile -t pieces < <(targets "$study" "$@")
  [ ${#pieces[@]} -gt 0 ] || die "no piece to run"
  snakemake_run "$study" -n -- "${pieces[@]}"
}

follow() {
  local wait_s=$1 waited=0 size
  [ -n "${OUT:-}" ] || die "set OUT to the folder that comes back"
  [ -d "$state" ] || die "nothing was started on this machine (its disk was reset if the last call was > 30 s ago)"
  # A device call ends at 600 s, and one cut short brings nothing back: leave the copies their time.
  if [ "$wait_s" -gt 540 ]; then
    echo "h200_background: waiting 540 s, not $wait_s: a call cut short at 600 s would bring nothing back" >&2
    wait_s=540
  fi
  while [ ! -f "$state/done" ] && [ "$waited" -lt "$wait_s" ]; do
    sleep 5
    waited=$((waited + 5))
  done
  cp "$state"/progress.log "$state"/targets "$OUT"/ 2>/dev/null
  tail -c 2000000 "$state/snakemake.log" >"$OUT/snakemake.log" 2>/dev/null
  # The runs write where they started, which need not be this call's copy of the tree.
  (
    cd "$(cat "$state/root")" || exit 1
    cache=$(cat "$state/cache" 2>/dev/null || echo "$cache")
    mapfile -t raw < <(find results -mindepth 2 -maxdepth 2 -name raw -type d 2>/dev/null | sort)
    [ ${#raw[@]} -eq 0 ] || tar czf "$OUT/raw.tar.gz" "${raw[@]}"
    # Packed, not copied: a step file's name holds a "~", which the way back from the H200 refuses.
    mapfile -t steps < <(find results -mindepth 3 -maxdepth 3 -path '*/steps/*.csv' 2>/dev/null | sort)
    [ ${#steps[@]} -eq 0 ] || tar czf "$OUT/steps.tar.gz" "${steps[@]}"
    # A profiling study's trace table, beside its traces in raw.tar.gz.
    for traces in results/*/traces.csv; do
      [ -f "$traces" ] || continue
      cp "$traces" "$OUT/traces-$(basename "$(dirname "$traces")").csv"
    done
    # Triton's kernels (the GDN kernels' JIT is the longest part of a cold start) and SGLang's JIT kernels come
    # back, as much of them as fits, Triton's first; vLLM's torch.compile artefacts, hundreds of MiB over the
    # pieces, stay on the machine.
    kernels=()
    for part in triton tvm-ffi; do
      [ -d "$cache/$part" ] || continue
      tar czf "$OUT/compile-cache.next.tar.gz" -C "$cache" "${kernels[@]}" "$part" 2>/dev/null
      size=$(stat -c %s "$OUT/compile-cache.next.tar.gz" 2>/dev/null || echo 0)
      if [ "$size" -gt 0 ] && [ "$size" -le "$cache_limit" ]; then
        kernels+=("$part")
        mv "$OUT/compile-cache.next.tar.gz" "$OUT/compile-cache.tar.gz"
      else
        echo "kernel cache $part: $((size / 1048576)) MiB packed with ${kernels[*]:-nothing else}, more than comes back; left on the machine" >>"$OUT/progress.log"
        rm -f "$OUT/compile-cache.next.tar.gz"
      fi
    done
  )
  echo "load average: $(cut -d' ' -f1-3 /proc/loadavg)" | tee "$OUT/load.txt"
  tail -n 8 "$state/progress.log" 2>/dev/null
  [ -f "$state/done" ] && return 0
  return 3
}

case ${1:-} in
  start) shift; [ $# -ge 2 ] || die "usage: start LAST_START_S STUDY [\"PIECES ARGS\" ...]"; start "$@" ;;
  plan) shift; [ $# -ge 1 ] || die "usage: plan STUDY [\"PIECES ARGS\" ...]"; plan "$@" ;;
  follow) [ $# -eq 2 ] || die "usage: follow WAIT_S"; follow "$2" ;;
  _run) shift; run_pieces "$@" ;;
  *) sed -n '2,31p' "$0"; exit 2 ;;
esac
