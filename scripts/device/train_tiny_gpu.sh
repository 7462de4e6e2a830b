#!/usr/bin/env bash
# Train the tiny hybrid MTP checkpoint on a GPU (an H200) with a larger budget than CPU training allows:
# enough steps for the target (and its MTP head) to learn to copy a passage from far back, so that the
# copy-task workload really needs far context. Same code as `python -m wmtp.model.train train` on CPU.
#
# Inputs copied into .gpu-inputs/ at the repository root beforehand (ignored by git):
#   transformers-5.19.0-py3-none-any.whl   the engine venv's transformers (the GPU machine's image has 5.17)
#   pydantic, pydantic_core (cp312), annotated_types, typing_inspection, typing_extensions wheels
#                                          (wmtp.config needs pydantic; the image has none)
#   stdlib.tar.gz                          CPython 3.11's standard-library corpus files (the GPU machine
#                                          runs 3.12: same files as the CPU corpus, same held-out split)
# Usage, from the repository root, with OUT naming the output directory:
#   OUT=/path/to/out bash scripts/device/train_tiny_gpu.sh NAME 'BUDGET_JSON'
set -euo pipefail
name=$1
budget=$2
# Scratch space of this run only (the device machine is fresh each time).
work="$(mktemp -d)"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$work"/site .gpu-inputs/*.whl
export PYTHONPATH="$work"/site:$PWD/src PYTHONUNBUFFERED=1
mkdir -p "$work"/stdlib && tar xzf .gpu-inputs/stdlib.tar.gz -C "$work"/stdlib
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
python3 -m wmtp.model.train train --out "$OUT/$name" --seed 0 --tokenizer src/wmtp/model/tiny-trained/tokenizer.json \
  --stdlib "$work"/stdlib --budget "$budget" 2>&1 | tee "$OUT/$name.log"
