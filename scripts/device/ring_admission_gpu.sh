#!/usr/bin/env bash
# The ring's admission proof on an H200 at the 35B shape: three requests of 1,040,000 tokens at once, in vLLM 0.24
# (CUDA) with the plugin, one arm per background run. An arm is three 1M prefills of about 150 s and a minute of
# decode after its engine's start: about 10-11 minutes where the machine already compiled this shape's kernels, 13-15
# from cold (each arm's engine is compiled afresh: its KV memory and the ring's setting are in vLLM's compile hash).
# So one arm a lease, or two where the first leaves time for the second; never start one with less than 15 minutes
# of the lease left. It needs an H200: the 35B's 66 GiB of weights and the proof's 64-68 GB of KV do not fit 80 GB.
#
# The arms (wmtp.measure.admission.ARMS), each in its own engine, in this order across device calls:
#   wmtp-ring   at the proof's KV memory: should run all three at once;
#   wmtp        at the same memory: should run two and queue the third;
#   "wmtp, all at once"  at room for three: the batches the ring runs, the reference of its outputs.
# The memory is the one vLLM 0.24's own scheduler, driven without a GPU, found to admit two under wmtp and three
# under the ring (measurements/h200/ring_blocks_vllm-0.24.0.json, `kv_cache_memory_bytes`), and the requests'
# length and output tokens are that record's. Each arm writes its record (what ran at once, the engine's capacity,
# decode steps timed by batch size, the outputs); `python -m wmtp.measure.admission --combine` makes the proof of
# three records, here or on the H200.
#
# Runs ON the H200, from the repository root, after scripts/device/engine_install.sh installed the carried vLLM
# (its last part with --install). Usage:
#   bash scripts/device/ring_admission_gpu.sh start ARM       starts ARM in the background and returns
#   OUT=/path bash scripts/device/ring_admission_gpu.sh follow WAIT_S
#       waits until the run is over or WAIT_S seconds have passed, then copies its log and record into $OUT;
#       exit status 0 once it has ended, 3 while it runs
# Environment: ENGINE_KWARGS (JSON, vLLM's LLM(...) arguments beyond the proof's; default below), KV_BYTES (the
# proof's memory; default the record's), ROOM_BYTES (the all-at-once arm's; default 1 % over what wmtp needs for all
# N + 1 requests by the record: 71.5 GB, which with the 69 GiB the servers' weights, activations and graphs took
# leaves about 5 GiB of the H200's 140 GiB).
set -uo pipefail

state=${WMTP_RING_STATE:-/tmp/wmtp-ring-admission}
site=/tmp/wmtp-engine/site
prediction=measurements/h200/ring_blocks_vllm-0.24.0.json
model=results/models/qwen3.6-35b-a3b-ring
py=python3
# Dummy weights (the checkpoint has none), the recurrent layers' Triton prefill (FlashInfer's compiles with nvcc at
# start-up), CUDA graphs as the study's servers run, with the split cap they run at by default.
# At most the four sequences the study's servers were sized for (vLLM's offline default is 1,024: CUDA graphs up to
# 512 and a sampler warm-up of 1,024 rows, gigabytes the all-at-once arm does not have).
engine_kwargs=${ENGINE_KWARGS:-'{"load_format": "dummy", "gdn_prefill_backend": "triton", "enforce_eager": false, "max_num_seqs": 4}'}
# Triton's kernels: carried in (.gpu-inputs/compile-cache.tar.gz, as scripts/device/h200_background.sh brings it
# back) and kept beside the servers' cache, so an arm does not spend a cold start's JIT on them.
cache=results/engines/vllm/cache
carried_cache=.gpu-inputs/compile-cache.tar.gz
# What a call may wait before it copies: a device call ends at 600 s, and one cut short copies nothing.
max_wait_s=540

die() { echo "ring_admission_gpu: ERROR: $*" >&2; exit 1; }
field() { "$py" -c "import json,sys; print(json.load(open('$prediction'))[sys.argv[1]])" "$1"; }

start() {
  local arm=$1 kv
  [ -d "$site" ] || die "no engine at $site: run scripts/device/engine_install.sh first"
  [ -f "$state/pid" ] && kill -0 "$(cat "$state/pid")" 2>/dev/null && die "a run is under way (pid $(cat "$state/pid"))"
  local memory
  memory=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | head -n 1)
  [ "${memory:-0}" -ge 140000 ] 2>/dev/null ||
    die "this GPU has ${memory:-no} MiB: the proof's 35B and its 64-68 GB of KV need an H200's 141 GB"
  mkdir -p "$state"
  rm -f "$state/done" "$state/pid"
  export PYTHONPATH="$PWD/src:$site" PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 HF_HUB_OFFLINE=1
  export TRITON_CACHE_DIR=$PWD/$cache/triton
  if [ -f "$carried_cache" ] && [ ! -d "$TRITON_CACHE_DIR" ]; then
    mkdir -p "$cache" && tar xzf "$carried_cache" -C "$cache" triton >>"$state/progress.log" 2>&1 ||
      echo "could not unpack $carried_cache: Triton compiles from scratch" >>"$state/progress.log"
  fi
  bash scripts/device/engine_install.sh --wmtp >>"$state/progress.log" 2>&1 || die "wmtp is not beside the engine"
  [ -f "$model/config.json" ] || "$py" -m wmtp.model.dummy --architecture config/models/qwen3.6-35b-a3b.json \
    --out "$model" --max-position-embeddings "$(field max_model_len)" || die "could not write the dummy checkpoint"
  case "$arm" in
    wmtp | wmtp-ring) kv=${KV_BYTES:-$(field kv_cache_memory_bytes)} ;;
    "wmtp, all at once")
      kv=${ROOM_BYTES:-$("$py" -c "import json; r = json.load(open('$prediction'))
print(int(1.01 * (r['n'] + 1) * r['bytes_per_request']['wmtp']))")}
      ;;
    *) die "no arm $arm (wmtp, wmtp-ring, \"wmtp, all at once\")" ;;
  esac
  local name=${arm//[ ,]/_}
  { date -u +%FT%TZ; echo "load average: $(cut -d" " -f1-3 /proc/loadavg)"; nvidia-smi --query-gpu=name,uuid,memory.used,memory.total --format=csv,noheader; } \
    >>"$state/progress.log" 2>&1
  echo "arm $arm: KV $kv bytes, engine $engine_kwargs" >>"$state/progress.log"
  setsid nohup "$py" -m wmtp.measure.admission --model "$model" --arm "$arm" --kv-bytes "$kv" \
    --engine-kwargs "$engine_kwargs" --sink "$(field sink)" --window "$(field window)" --k "$(field k)" \
    --n "$(field n)" --max-model-len "$(field max_model_len)" --tokens "$(field output_tokens)" \
    --chunk "$(field chunk)" --out "$state/$name.json" >"$state/$name.log" 2>&1 </dev/null &
  echo $! >"$state/pid"
  echo "started $arm (pid $(cat "$state/pid")), log $state/$name.log"
}

follow() {
  local wait_s=$1 waited=0
  [ -f "$state/pid" ] || die "nothing started"
  if [ "$wait_s" -gt "$max_wait_s" ]; then
    echo "waiting $max_wait_s s, not $wait_s: a call cut short at 600 s would bring nothing back" >&2
    wait_s=$max_wait_s
  fi
  while kill -0 "$(cat "$state/pid")" 2>/dev/null && [ "$waited" -lt "$wait_s" ]; do
    sleep 5
    waited=$((waited + 5))
  done
  mkdir -p "${OUT:?set OUT}"
  cp "$state"/*.json "$state"/progress.log "$OUT"/ 2>/dev/null
  for log in "$state"/*.log; do
    [ "$log" = "$state/progress.log" ] || tail -c 2000000 "$log" >"$OUT/$(basename "$log")"
  done
  tail -n 5 "$state"/*.log
  kill -0 "$(cat "$state/pid")" 2>/dev/null && exit 3
  exit 0
}

case "${1:-}" in
  start) start "${2:?an arm}" ;;
  follow) follow "${2:?seconds}" ;;
  *) die "usage: $0 start ARM | follow WAIT_S" ;;
esac
