#!/usr/bin/env bash
# The cells of config/studies/h200-vllm.yaml on an H200, piece by piece, with the pipeline's own commands.
#
# Runs ON the H200, from the repository root, after scripts/device/engine_install.sh has installed the carried
# vLLM under /tmp/wmtp-engine/site (docs/gpu.md). The H200 has no Snakemake, so this calls what the rules call:
#   python -m wmtp.model.dummy        rule dummy_model (the weightless checkpoint)
#   python -m wmtp engine-build       rule engine (adopts python3, checks the plugin's hook points)
#   python -m wmtp cell               rule cell, with the study that `wmtp cell-study` narrows to the cell
#   python -m wmtp collect            rule collect
# and then `wmtp step-table`, which writes the step file (one row per arm, k, S, W, context, batch) into $OUT.
#
# One piece is one server lifetime: one cell over one rung (a cold start of this shape takes about 280 s, a
# 1M-token prefill minutes), or with --together one cell over every selected rung it lacks, as the pipeline's own
# cells sweep them. Pieces run longest rung first; a rung of a cell whose raw files are there
# (results/h200-vllm/raw/rung~R/<cell id>/manifest.json, or rungs~R1-R2/<cell id>/ for a piece over several) is
# not run again, so the same command, run again, goes on where the last one stopped. Every run ends by collecting
# what is there and writing the step file.
#
# Usage: OUT=/path bash scripts/device/h200_cells.sh [--arms "none mtp wmtp"] [--k "1 3 5"] [--windows "4096"]
#                                                    [--rungs "1048576 524288 131072"] [--pieces N] [--budget-s S]
#                                                    [--together]
#   --arms "A B"   the arms to run, in the order each server's pieces run them (default "none mtp wmtp")
#   --windows "W"  of the windowed cells, only those with these W (default: every W of the study)
#   --servers "N"  only these of each configuration's servers (default: all the study starts)
#   --pieces N     run at most N pieces that are not there yet (default 1); 0 only collects (no engine needed)
#   --budget-s S   start no piece after S seconds of this run (default 0: no limit)
#   --together     a piece is one cell over all its missing rungs of --rungs, in one server
#   --again        with --together, a piece is one cell over every rung of --rungs, also those other pieces hold
#                  (another server lifetime of the cell: a server that measures all its contexts, so that growth
#                  between them is timed in one server); only a piece over exactly these rungs counts as there
#   --plan         list the pieces this run would start, and stop (no engine needed)
# Compile caches: .gpu-inputs/compile-cache.tar.gz, when carried in, is unpacked into results/engines/vllm/cache
# before the first server starts (Triton's kernels: the largest part of a cold start's minutes).
# Writes to $OUT: vllm_qwen3.6-35b-a3b.csv (the step file), raw.tar.gz (every piece's raw files, to carry back in
# as results/h200-vllm/raw), compile-cache.tar.gz (Triton's cache, when it fits what comes back), progress.log, and
# the failed piece's log and failure.json when one fails.
set -uo pipefail
study=config/studies/h200-vllm.yaml
site=/tmp/wmtp-engine/site
results=results/h200-vllm
raw_root=$results/raw
model=qwen3.6-35b-a3b
model_dir=results/models/$model
engine_manifest=results/engines/vllm/manifest.json
cache=results/engines/vllm/cache
carried_cache=.gpu-inputs/compile-cache.tar.gz
cache_limit=$((15 * 1024 * 1024))  # what one file back from the H200 may weigh, with room
arms="none mtp wmtp" ks="1 3 5" windows="" rungs="" pieces=1 budget=0 plan=0 together=0 again=0 servers=""
py=python3

die() { echo "h200_cells: ERROR: $*" >&2; exit 1; }
say() { echo "h200_cells: $(date -u +%H:%M:%S) $*" | tee -a "${OUT:-/tmp}/progress.log"; }

while [ $# -gt 0 ]; do
  case $1 in
    --arms) arms=$2; shift ;;
    --k) ks=$2; shift ;;
    --windows) windows=$2; shift ;;
    --servers) servers=$2; shift ;;
    --rungs) rungs=$2; shift ;;
    --pieces) pieces=$2; shift ;;
    --budget-s) budget=$2; shift ;;
    --plan) plan=1 ;;
    --together) together=1 ;;
    --again) again=1 ;;
    -h | --help) sed -n '2,36p' "$0"; exit 0 ;;
    *) die "unknown argument $1 (see --help)" ;;
  esac
  shift
done
[ -n "${OUT:-}" ] || die "set OUT to the folder that comes back"
mkdir -p "$OUT"
started=$SECONDS

export PYTHONPATH="$PWD/src:$site" PYTHONUNBUFFERED=1
$py -m wmtp check-config --config "$study" >"$OUT/check-config.txt" 2>&1 ||
  die "the study does not validate: $(cat "$OUT/check-config.txt")"

# The study's cells, filtered by arm and k; its rungs, longest first.
cells=() ordered=()
while read -r cell; do
  arm=$(sed -n 's|.*/arm~\([^/]*\)/.*|\1|p' <<<"$cell")
  k=$(sed -n 's|.*/k~\([0-9]*\)/.*|\1|p' <<<"$cell")
  w=$(sed -n 's|.*/w~\([0-9]*\)/.*|\1|p' <<<"$cell")
  [[ " $arms " == *" $arm "* ]] || continue
  [ -z "$k" ] || [[ " $ks " == *" $k "* ]] || continue
  [ -z "$w" ] || [ -z "$windows" ] || [[ " $windows " == *" $w "* ]] || continue
  server=$(sed -n 's|.*/server~\([0-9]*\)$|\1|p' <<<"$cell")
  [ -z "$servers" ] || [[ " $servers " == *" ${server:-1} "* ]] || continue
  arm_rank=$(tr ' ' '\n' <<<"$arms" | sed '/^$/d' | grep -nx "$arm" | cut -d: -f1)
  ordered+=("${server:-1} $arm_rank $cell")
done < <(sed -n 's/^  \(model~[^ ]*\)$/\1/p' "$OUT/check-config.txt")
# Server by server, and within a server in the order --arms names the arms: the arms interleave in time.
[ ${#ordered[@]} -eq 0 ] || mapfile -t cells < <(printf '%s\n' "${ordered[@]}" | sort -s -n -k1,1 -k2,2 | cut -d' ' -f3)
[ -n "$rungs" ] || rungs=$($py -c "from wmtp.config import load_study; print(*load_study('$study').protocol.rungs)")
rungs=$(tr ' ' '\n' <<<"$rungs" | sed '/^$/d' | sort -rn | tr '\n' ' ')
[ ${#cells[@]} -gt 0 ] || die "no cell of the study has arm in '$arms' and k in '$ks'"
say "${#cells[@]} cell(s) × rungs $rungs; at most $pieces new piece(s) this run"

have() {  # have CELL RUNG: a piece holding that rung of that cell has its raw files
  local dir group
  for dir in "$raw_root"/rung~*/"$1" "$raw_root"/rungs~*/"$1"; do
    [ -f "$dir/manifest.json" ] || continue
    group=${dir#"$raw_root"/}
    group=${group%%/*}
    [[ "-${group#*~}-" == *"-$2-"* ]] && return 0
  done
  return 1
}

missing() {  # missing CELL: its rungs of this run without raw files, longest first
  local rung out=""
  for rung in $rungs; do have "$1" "$rung" || out="$out $rung"; done
  echo $out
}

# The pieces, in order: "cell|rung rung ..." (longest rung first; a piece per rung unless --together).
plan_pieces=()
[ "$again" = 0 ] || [ "$together" = 1 ] || die "--again needs --together"
if [ "$together" = 1 ]; then
  for cell in "${cells[@]}"; do
    if [ "$again" = 1 ]; then
      todo=$(echo $rungs)
      [ ! -f "$raw_root/rungs~$(tr ' ' '-' <<<"$todo")/$cell/manifest.json" ] || todo=""
    else
      todo=$(missing "$cell")
    fi
    [ -z "$todo" ] || plan_pieces+=("$cell|$todo")
  done
else
  for rung in $rungs; do
    for cell in "${cells[@]}"; do
      have "$cell" "$rung" || plan_pieces+=("$cell|$rung")
    done
  done
fi

if [ "$plan" = 1 ]; then
  for piece in ${plan_pieces[@]+"${plan_pieces[@]}"}; do echo "h200_cells: plan: to-run ${piece#*|} ${piece%%|*}"; done
  [ ${#plan_pieces[@]} -gt 0 ] || echo "h200_cells: plan: every piece is there"
  exit 0
fi

if [ "$pieces" -gt 0 ]; then
[ -d "$site" ] || die "no engine at $site: run scripts/device/engine_install.sh first (its last part with --install)"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# Triton's compiled kernels beside vLLM's compile cache (results/engines/vllm/cache), which the cells keep: a
# second server of the shape starts without the first one's minutes of JIT while the machine stays up.
export TRITON_CACHE_DIR=$PWD/$cache/triton
if [ -f "$carried_cache" ] && [ ! -d "$cache" ]; then
  if mkdir -p "$cache" && tar xzf "$carried_cache" -C "$cache"; then
    say "compile caches from $carried_cache: $(du -sh "$cache" | cut -f1)"
  else
    rm -rf "$cache"
    say "could not unpack $carried_cache; the servers compile from scratch"
  fi
fi
# The pipeline's own modules need these beside vLLM: name what is missing before any server starts.
$py -c 'import pandas, pyarrow, pydantic, yaml, httpx, tokenizers, jinja2' ||
  die "the image lacks a module the cells need (above); carry it with the engine"

# The server imports the plugin from the engine's site (the study's env sets PYTHONPATH to it alone).
rev=$(find src pyproject.toml -type f -not -path '*/__pycache__/*' | sort | xargs sha256sum | sha256sum | cut -c1-16)
if [ "$(cat "$site/.wmtp-installed" 2>/dev/null)" != "$rev" ]; then
  say "installing this checkout's wmtp beside the engine"
  $py -m pip install -q --no-deps --no-index --no-build-isolation --upgrade --target "$site" . ||
    die "could not install wmtp beside the engine"
  echo "$rev" >"$site/.wmtp-installed"
fi

nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv,noheader | tee -a "$OUT/progress.log"

if [ ! -f "$model_dir/config.json" ] || [ ! -f "$model_dir/tokenizer.json" ]; then
  max_len=$($py -c "from wmtp.config import load_study; print(load_study('$study').model('$model').max_model_len)")
  say "writing the dummy checkpoint $model_dir (max_position_embeddings $max_len)"
  $py -m wmtp.model.dummy --architecture "config/models/$model.json" --out "$model_dir" \
    --max-position-embeddings "$max_len" || die "the dummy checkpoint was not written"
fi

say "engine: adopting python3 with vLLM from $site and checking the plugin's hook points"
$py -m wmtp --log results/engines/vllm/build.snakemake.log engine-build --config "$study" --engine vllm \
  --out "$engine_manifest" --windowed >"$OUT/engine-build.log" 2>&1 || { tail -n 30 "$OUT/engine-build.log"; die "engine build failed"; }
say "engine ready: vLLM $($py -c "import json; print(json.load(open('$engine_manifest'))['versions']['vllm'])")"
fi

ran=0 failed=0
for piece in ${plan_pieces[@]+"${plan_pieces[@]}"}; do
  cell=${piece%%|*} piece_rungs=${piece#*|}
  if [ "$ran" -ge "$pieces" ]; then
    say "not yet: $cell at $piece_rungs (and any after it); run again"
    break
  fi
  if [ "$budget" -gt 0 ] && [ $((SECONDS - started)) -ge "$budget" ]; then
    say "budget of ${budget}s spent; not starting $cell at $piece_rungs"
    break
  fi
  ran=$((ran + 1))
  read -ra list <<<"$piece_rungs"
  if [ ${#list[@]} -eq 1 ]; then group="rung~${list[0]}"; else group="rungs~$(tr ' ' '-' <<<"$piece_rungs")"; fi
  out_dir=$raw_root/$group/$cell
  log=$results/logs/cells/$group/$cell.log
  mkdir -p "$(dirname "$log")"
  study_json=$($py -m wmtp cell-study --config "$study" --cell "$cell" --rungs "${list[@]}") || die "no study for $cell"
  say "piece $ran: $cell at $piece_rungs tokens"
  piece_started=$SECONDS
  if $py -m wmtp --log "$log" cell --study-json "$study_json" --cell "$cell" --engine-manifest "$engine_manifest" \
    --model-dir "$model_dir" --out "$out_dir" >"$log.out" 2>&1; then
    say "done in $((SECONDS - piece_started)) s: $cell at $piece_rungs"
    grep -h "wmtp plugin (pid" "$out_dir"/server*.log 2>/dev/null | tail -n 1 | cut -c1-300 | tee -a "$OUT/progress.log"
  else
    failed=1
    say "FAILED after $((SECONDS - piece_started)) s: $cell at $piece_rungs (log: $log)"
    mkdir -p "$OUT/failed"
    cp "$log" "$log.out" "$OUT/failed/" 2>/dev/null
    cp "$out_dir/failure.json" "$OUT/failed/" 2>/dev/null
    find "$out_dir" -name 'server*.log' -exec tail -n 200 {} + >"$OUT/failed/server-tail.log" 2>/dev/null
    tail -n 20 "$log.out"
    break
  fi
done

# Collect each group of pieces on its own (a piece's protocol holds its rungs), then one step file of them all.
tidy_dirs=()
for group_dir in "$raw_root"/rung~* "$raw_root"/rungs~*; do
  [ -d "$group_dir" ] || continue
  group=$(basename "$group_dir")
  mapfile -t manifests < <(find "$group_dir" -path '*/c~*/manifest.json' -not -path '*/.*' 2>/dev/null | sort)
  [ ${#manifests[@]} -gt 0 ] || continue
  tidy=$results/tidy/$group
  if $py -m wmtp --log "$results/logs/collect-$group.log" collect --out "$tidy" "${manifests[@]}" >/dev/null 2>&1; then
    tidy_dirs+=("$tidy")
    say "collected ${#manifests[@]} piece(s) of $group"
  else
    say "collect failed for $group (log: $results/logs/collect-$group.log)"
    cp "$results/logs/collect-$group.log" "$OUT/" 2>/dev/null
    failed=1
  fi
done
if [ ${#tidy_dirs[@]} -gt 0 ]; then
  # The engine release as each piece recorded it (its manifest's engine.versions): one per step file.
  version=$(find "$raw_root" -path '*/c~*/manifest.json' -not -path '*/.*' -exec $py -c '
import json, sys
print("\n".join(sorted({json.load(open(f))["engine"]["versions"].get("vllm", "?") for f in sys.argv[1:]})))' {} +)
  [ "$(wc -l <<<"$version")" -eq 1 ] || die "the pieces ran different vLLM releases: $version"
  $py -m wmtp step-table --tidy "${tidy_dirs[@]}" --engine-version "$version" --out "$OUT/vllm_$model.csv" &&
    $py -c 'import sys, pandas as pd; pd.set_option("display.width", 250)
columns = ["arm", "W", "context", "step_ms", "server_step_ms", "n", "clock", "client_step_ms", "over_floor", "ttft_s"]
print(pd.read_csv(sys.argv[1])[columns].to_string(index=False))' "$OUT/vllm_$model.csv"
fi
[ -d "$raw_root" ] && tar czf "$OUT/raw.tar.gz" "$raw_root"
# Triton's kernels alone come back (the GDN kernels' JIT is the longest part of a cold start); vLLM's torch.compile
# artefacts, hundreds of MiB over the cells, stay on the machine.
if [ -d "$cache/triton" ]; then
  tar czf "$OUT/compile-cache.tar.gz" -C "$cache" triton 2>/dev/null || rm -f "$OUT/compile-cache.tar.gz"
  size=$(stat -c %s "$OUT/compile-cache.tar.gz" 2>/dev/null || echo 0)
  if [ "$size" -gt "$cache_limit" ]; then
    say "Triton's cache is $((size / 1048576)) MiB packed, more than comes back; left on the machine"
    rm -f "$OUT/compile-cache.tar.gz"
  fi
  du -sh "$cache"/* 2>/dev/null | tee -a "$OUT/progress.log"
fi
say "run took $((SECONDS - started)) s"
exit $failed
