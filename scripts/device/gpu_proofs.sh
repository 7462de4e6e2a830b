#!/usr/bin/env bash
# On an H200, after scripts/device/engine_install.sh has installed the carried vLLM under /tmp/wmtp-engine/site:
# installs this checkout's wmtp beside it (so vLLM finds the plugin through its vllm.general_plugins entry point),
# trains the tiny budget's course on the host CPU (scripts/device/train_course.sh) and runs the plugin's proofs in
# the CUDA engine (scripts/device/vllm_gpu_proofs.py).
#
# Carried in: .gpu-inputs/train (train_course.sh's inputs) and .gpu-inputs/proofs/prompts.json
# (`python scripts/device/vllm_gpu_proofs.py prompts --out .gpu-inputs/proofs/prompts.json`, run here).
# Usage, from the repository root: OUT=/path/to/out bash scripts/device/gpu_proofs.sh [--no-course] [--ring]
# (with WMTP_REVISION=<commit> where the copy of the tree carries a stale history: the record names that commit)
# --no-course runs the proofs alone (about 5.5 minutes of the H200), without .gpu-inputs/train; --ring serves and
# proves the ring as well (a third engine).
# Writes to $OUT: cpu.txt, course-avx2.json, course-default.json (the course), gpu_proofs.json (the proofs; the
# script exits 1 when one fails), proofs.log (the engine's output) and details.tar.gz (training logs, the
# instrument's records, the plugin's counters).
set -uo pipefail
work="$(mktemp -d)"
site=/tmp/wmtp-engine/site
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
uptime
mkdir -p "$work"/course
course=1 ring=()
for arg in "$@"; do
  case $arg in
    --no-course) course=0 ;;
    --ring) ring=(--ring) ;;
    *) echo "gpu_proofs: unknown option $arg" >&2; exit 2 ;;
  esac
done
if [ "$course" = 1 ]; then
  OUT="$work"/course bash scripts/device/train_course.sh
  cp "$work"/course/cpu.txt "$work"/course/course-*.json "$OUT"/
fi
python3 -m pip install -q --no-deps --no-index --no-build-isolation --upgrade --target "$site" . ||
  { echo "gpu_proofs: could not install wmtp beside the engine" >&2; exit 1; }
PYTHONPATH="$PWD/src:$site" python3 scripts/device/vllm_gpu_proofs.py run --prompts .gpu-inputs/proofs/prompts.json \
  --out "$work"/proofs "${ring[@]}" >"$OUT"/proofs.log 2>&1
status=$?
cp "$work"/proofs/gpu_proofs.json "$OUT"/ 2>/dev/null
tail -n 40 "$OUT"/proofs.log
tar czf "$OUT"/details.tar.gz -C "$work" course proofs
exit $status
