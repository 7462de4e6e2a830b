#!/usr/bin/env bash
# Train the tiny hybrid MTP checkpoint with the far-copy recipe (wmtp.model.train.FAR_COPY_BUDGET) on one GPU (an
# H200): every row carries passages repeated up to its whole length later, 60 % of them random tokens, at lengths
# growing from 512 to 16K, so that the target and its MTP head learn to copy from far back. Each stage stops at its
# time limit, so the run fits one lease. Several variants may run side by side (each process is bound by kernel
# launches, not by the GPU), but three at once ran out of the GPU's memory at 16K: train the checkpoint alone.
#
# Inputs copied into .gpu-inputs/ at the repository root beforehand (ignored by git), as for train_tiny_gpu.sh:
#   transformers-5.19.0-py3-none-any.whl   the engine venv's transformers (the GPU machine's image has 5.17)
#   pydantic, pydantic_core (cp312), annotated_types, typing_inspection, typing_extensions wheels
#                                          (wmtp.config needs pydantic; the image has none)
#   stdlib.tar.gz                          CPython 3.11's standard-library .py files (the corpus and its held-out
#                                          split, as on the CPU; the GPU machine runs 3.12)
#   NAME.init.tar                          optional, per variant: a checkpoint tar this script wrote; the variant
#                                          continues from it (--init), e.g. with {"target_steps": 0} to train the
#                                          MTP head only
# Usage, from the repository root, with OUT naming the output directory; per variant a name, TinyShape overrides
# and Budget overrides (JSON). Writes $OUT/NAME.log and $OUT/NAME.tar (the checkpoint directory):
#   OUT=/path/to/out bash scripts/device/train_far_gpu.sh far '{}' '{}' far2 '{"full_attention_every": 2}' '{}'
# The committed checkpoint (src/wmtp/model/tiny-trained), four runs of 7-8 minutes each:
#   OUT=… bash scripts/device/train_far_gpu.sh farA '{}' '{}'
#   cp …/farA.tar .gpu-inputs/farA2b.init.tar
#   OUT=… bash scripts/device/train_far_gpu.sh farA2b '{}' '{"target_steps": 0, "mtp_seconds": 390, "mtp_lr": 0.003,
#     "mtp_phases": [[0, 48, 2048], [0.35, 16, 4096], [0.65, 3, 16384]]}'
# then target and head trained together (mtp_target_weight), twice, each run continuing the one before (its
# checkpoint directory tarred as .gpu-inputs/NAME.init.tar):
#   OUT=… bash scripts/device/train_far_gpu.sh farJ1 '{}' '{"target_steps": 0, "mtp_target_weight": 1.0,
#     "mtp_seconds": 450, "mtp_lr": 0.002, "mtp_phases": [[0, 16, 4096], [0.4, 3, 16384]]}'
#   OUT=… bash scripts/device/train_far_gpu.sh farJ3a '{}' '{"target_steps": 0, "mtp_target_weight": 1.0,
#     "mtp_seconds": 450, "mtp_lr": 0.002, "mtp_phases": [[0, 16, 4096], [0.5, 3, 16384]]}'
set -euo pipefail
# Scratch space of this run only (the device machine is fresh each time).
work="$(mktemp -d)"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$work"/site .gpu-inputs/*.whl
export PYTHONPATH="$work"/site:$PWD/src PYTHONUNBUFFERED=1
mkdir -p "$work"/stdlib "$work"/train && tar xzf .gpu-inputs/stdlib.tar.gz -C "$work"/stdlib
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
pids=()
while [ $# -ge 3 ]; do
  name=$1 shape=$2 budget=$3
  shift 3
  init=()
  if [ -f .gpu-inputs/"$name".init.tar ]; then
    mkdir -p "$work/init/$name" && tar xf .gpu-inputs/"$name".init.tar -C "$work/init/$name"
    init=(--init "$(dirname "$(find "$work/init/$name" -name model.safetensors)")")
  fi
  (
    python3 -m wmtp.model.train train "${init[@]}" --recipe far-copy --seed 0 --out "$work/train/$name" \
      --tokenizer src/wmtp/model/tiny-trained/tokenizer.json --stdlib "$work"/stdlib --shape "$shape" --budget "$budget" \
      >"$OUT/$name.log" 2>&1
    tar cf "$OUT/$name.tar" -C "$work"/train "$name"
  ) &
  pids+=($!)
done
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=1; done
grep -hE "held-out|tok/s\)$" "$OUT"/*.log | tail -n 20
exit $status
