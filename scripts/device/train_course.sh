#!/usr/bin/env bash
# The tiny training budget's course (wmtp.model.reproduce) on another machine's CPU: an H200 host's processor,
# with the torch its image has. Trains `python -m wmtp.model.train train --tiny` at the AVX2 and scalar dispatch
# levels and prints each run's course; tests/fixtures/tiny-budget-expected.json is such a course, and every CPU
# must reproduce it (tests/test_train.py).
#
# Inputs in .gpu-inputs/train/ at the repository root (ignored by git), carried in:
#   transformers, tokenizers, huggingface_hub (+ httpx2, httpcore2, sniffio), pydantic (+ pydantic_core,
#   annotated_types, typing_inspection, typing_extensions) wheels for CPython 3.12 at the engine venv's versions
#   stdlib.tar.gz   CPython 3.11's standard-library .py files (the corpus; that machine runs 3.12)
# Usage, from the repository root: OUT=/path/to/out bash scripts/device/train_course.sh
# Writes $OUT/course-LEVEL.json, $OUT/train-LEVEL.log and $OUT/cpu.txt.
set -euo pipefail
work="$(mktemp -d)"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$work"/site \
  .gpu-inputs/train/*.whl
export PYTHONPATH="$work"/site:$PWD/src PYTHONUNBUFFERED=1
mkdir -p "$work"/stdlib && tar xzf .gpu-inputs/train/stdlib.tar.gz -C "$work"/stdlib
{ grep -m1 'model name' /proc/cpuinfo; grep -m1 '^flags' /proc/cpuinfo | tr ' ' '\n' | grep -E 'avx512f|amx' | tr '\n' ' '
  echo; python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
} | tee "$OUT"/cpu.txt
for level in avx2 default; do
  python3 -m wmtp.model.train train --tiny --seed 0 --out "$work/$level" --stdlib "$work"/stdlib \
    --tokenizer src/wmtp/model/tiny-trained/tokenizer.json --budget "{\"cpu_dispatch\": \"$level\"}" \
    >"$OUT/train-$level.log" 2>&1
  python3 -m wmtp.model.train expect --model "$work/$level" >"$OUT/course-$level.json"
  grep 'sha256' "$OUT/train-$level.log" | tail -1
done
