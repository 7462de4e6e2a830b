#!/usr/bin/env bash
# Build the carry set of an engine for an H200 that has no package index: every wheel that vLLM (VLLM_VERSION,
# default 0.24.0, the CUDA build) or, with ENGINE=sglang, SGLang (SGLANG_VERSION, default 0.5.17) and Snakemake (the
# version pyproject.toml pins) need at run time on CPython 3.12 / x86-64 manylinux, less the packages the H200's
# image already holds, packed into one tar and cut into parts small enough to travel with one run on the H200 each. Snakemake travels with the engine so that
# the H200 runs the workflow itself (docs/gpu.md); the two are resolved together, so they agree on every package
# they share.
#
# Runs here, where pip reaches the package index:
#   bash scripts/device/engine_wheels.sh [OUT_DIR]          # OUT_DIR defaults to .gpu-inputs/engine-parts
#   ENGINE=sglang bash scripts/device/engine_wheels.sh      # SGLang's set, in .gpu-inputs/sglang-parts
#
# It resolves vLLM's and Snakemake's requirements with `pip install --dry-run --report` for the H200's interpreter
# and platform (the versions the image is known to hold are passed as constraints, so the carried packages
# agree with them), drops torch, torchvision, torchaudio, triton and every other package of the image
# (IMAGE_PACKAGES below, compared by normalised name), downloads exactly one wheel of each remaining
# package with `pip download --no-deps`, and writes into OUT_DIR (replaced as a whole):
#   engine.tar.part-000, engine.tar.part-001, ...   the tar, cut with `split -b PART_SIZE`; names sort in order
#   engine.sha256                                   sha256 of the whole tar (line "engine.tar") and of each part
#   packages.txt                                    name, version, wheel file and size of every carried package
# The tar holds wheels/*.whl and wheels/packages.txt.
#
# On the H200 (no network), from the repository root, scripts/device/engine_install.sh takes one part
# per run, in order, each run within 30 s of the previous one (the H200 keeps /tmp only that long
# between runs), each carrying its part and engine.sha256:
#   run 1:    bash scripts/device/engine_install.sh .gpu-inputs/engine-parts/engine.tar.part-000
#   run k:    bash scripts/device/engine_install.sh .gpu-inputs/engine-parts/engine.tar.part-<k-1>
#   last run: bash scripts/device/engine_install.sh .gpu-inputs/engine-parts/engine.tar.part-<last> --install
# and the engine's own run follows within 30 s, with PYTHONPATH=/tmp/wmtp-engine/site. SGLang's parts install
# the same way, each run with ENGINE_DIR=/tmp/wmtp-sglang, into /tmp/wmtp-sglang/site: the two engines pin
# different transformers, so neither shares the other's site.
#
# A run on the H200 carries at most 64 MiB, the repository's working tree included, so PART_SIZE
# defaults to 50M (the tree is about 8 MiB); raise it only while part + tree stays under that.
#
# Environment:
#   ENGINE         vllm (default) or sglang
#   VLLM_VERSION   vLLM release to carry (default 0.24.0)
#   SGLANG_VERSION SGLang release to carry (default 0.5.17: the last that pins the image's torch 2.11)
#   SNAKEMAKE_VERSION  Snakemake release to carry (default: the one pyproject.toml pins)
#   PYTHON         interpreter that runs pip; a CPython 3.12 is preferred, because pip evaluates
#                  environment markers (python_version) against the interpreter that runs it
#                  (default: python3.12 if it runs, else python3)
#   PART_SIZE      size of one part, as split -b takes it (default 50M; at most 55M)
#   GLIBC_MINOR    newest manylinux_2_N tag the H200's glibc accepts (default 39, Ubuntu 24.04)
#   ENGINE_SKIP    extra package names to leave out, separated by spaces
#
# Left out by default (LAZY_KERNELS): kernel libraries that vLLM imports only inside backends the H200 cells do
# not select (the CuTe-DSL GDN prefill, FlashInfer's prebuilt cubins, TileLang, TokenSpeed, CUTLASS' Python DSL
# and the CUDA compiler it drives). The cells serve FLASH_ATTN with `--gdn-prefill-backend triton`. Without them
# the set is about 380 MB instead of 1.3 GB: seven parts instead of 23. SGLang's (SGLANG_LAZY_KERNELS) are the
# Blackwell-only kernels and the compilers and solvers behind them; sgl-deep-gemm stays, because the draft's CUDA
# graph capture imports it. SGLang pins a transformers older than the image's, whose newer one some of its model
# modules do not import with, so its set carries its own transformers and tokenizers (TRANSFORMERS_CARRIED).
#
# Left out of Snakemake's set (UNUSED_BY_SNAKEMAKE): PuLP, 16 MB with the solver binaries it bundles, which only
# Snakemake's ILP scheduler imports; profiles/h200 schedules greedily (one GPU job at a time needs no solver).
# Built here (PURE_SDISTS): pure-Python requirements published as source only (pip takes only wheels for another
# platform), each built into a py3-none-any wheel first.
set -euo pipefail
LAZY_KERNELS="flashinfer-cubin tokenspeed-triton tokenspeed-mla nvidia-cutlass-dsl nvidia-cutlass-dsl-libs-base
  nvidia-cutlass-dsl-libs-cu13 nvidia-nvvm nvidia-cuda-nvcc nvidia-cuda-crt nvidia-cuda-cccl nvidia-cuda-tileiras
  cuda-tile tilelang z3-solver quack-kernels humming-kernels"
SGLANG_LAZY_KERNELS="tokenspeed-triton tokenspeed-mla nvidia-cutlass-dsl nvidia-cutlass-dsl-libs-base
  nvidia-cutlass-dsl-libs-core nvidia-cutlass-dsl-libs-cu12 nvidia-cutlass-dsl-libs-cu13 flash-attn-4 quack-kernels
  tilelang z3-solver nvidia-mathdx humming-kernels nvidia-cuda-nvcc nvidia-cuda-nvdisasm nvidia-cuda-cccl cuda-tile
  nvidia-nvvm"
TRANSFORMERS_CARRIED="transformers tokenizers"
UNUSED_BY_SNAKEMAKE="pulp"
PURE_SDISTS="connection-pool"

engine=${ENGINE:-vllm}
vllm_version=${VLLM_VERSION:-0.24.0}
sglang_version=${SGLANG_VERSION:-0.5.17}
case $engine in
  vllm) requirement="vllm==$vllm_version" lazy=$LAZY_KERNELS default_out=.gpu-inputs/engine-parts ;;
  sglang) requirement="sglang==$sglang_version" lazy=$SGLANG_LAZY_KERNELS default_out=.gpu-inputs/sglang-parts ;;
  *) echo "engine_wheels: error: ENGINE is vllm or sglang, not $engine" >&2; exit 1 ;;
esac
out=${1:-$default_out}
part_size=${PART_SIZE:-50M}
glibc_minor=${GLIBC_MINOR:-39}

die() { echo "engine_wheels: error: $*" >&2; exit 1; }

if [ -n "${PYTHON:-}" ]; then
  python=$PYTHON
elif python3.12 -c '' >/dev/null 2>&1; then
  python=python3.12
else
  python=python3
fi
py_version=$("$python" -c 'import sys; print("%d.%d" % sys.version_info[:2])') || die "cannot run $python"
if [ "$py_version" != 3.12 ]; then
  echo "engine_wheels: warning: $python is Python $py_version; markers on python_version are evaluated for it," \
    "not for the H200's 3.12 (set PYTHON to a CPython 3.12)" >&2
fi
"$python" -m pip --version >/dev/null || die "$python has no pip"
root=$(cd "$(dirname "$0")/../.." && pwd)
# The Snakemake the pipeline pins, so that the H200 runs the release every other machine does.
snakemake_version=${SNAKEMAKE_VERSION:-}
if [ -z "$snakemake_version" ]; then
  snakemake_version=$("$python" - "$root/pyproject.toml" <<'EOF'
import re, sys, tomllib
with open(sys.argv[1], "rb") as f:
    extras = tomllib.load(f)["project"]["optional-dependencies"]
pins = [m.group(1) for dep in extras["pipeline"] if (m := re.fullmatch(r"snakemake==(\S+)", dep))]
print(pins[0] if pins else "")
EOF
  )
fi
[ -n "$snakemake_version" ] || die "pyproject.toml pins no snakemake==<version> in its pipeline extra; set SNAKEMAKE_VERSION"

# The Python packages of the H200's image. A carried copy of one of these would shadow the image's own
# build on PYTHONPATH, so none is carried (a newer image list goes here).
IMAGE_PACKAGES="absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch
build certifi charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core
cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock
flatbuffers flax fonttools formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx
huggingface-hub humanize hypothesis idna imageio iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin
jaxlib jaxtyping jinja2 joblib kiwisolver lazy-loader lightning lightning-utilities linear-operator lineax
llvmlite lxml markdown markdown-it-py markupsafe matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack
multidict multipledispatch mypy-extensions nanobind narwhals networkx ninja numba numba-cuda numpy numpyro
nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime nvidia-cudnn-cu13 nvidia-cufft
nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13 nvidia-ml-py
nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir onnxruntime onnxscript
opencv-python-headless optax opt-einsum opt-einsum-fx optimistix orbax-checkpoint packaging pandas pathspec
patsy peft pillow pip pluggy portalocker prometheus-client propcache protobuf psutil pyarrow pybind11
py-cpuinfo pygments pyparsing pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock
pytest-timeout pytest-xdist python-dateutil pytorch-lightning pyyaml regex requests rich sacrebleu
safetensors scikit-build-core scikit-image scikit-learn scipy seaborn sentencepiece sentence-transformers
setuptools shellingham simplejson six sortedcontainers statsmodels sympy tabulate tensorboard
tensorboard-data-server tensorstore threadpoolctl tifffile tiktoken timm tokenizers toolz torch torchaudio
torchdiffeq torch-geometric torchmetrics torchvision tqdm transformers treescope triton typer
typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel wrapt xarray xxhash yarl zipp"

# Versions the image is known to hold: the resolver must pick carried packages that agree with them.
# numpy is left out on purpose: vLLM pins numba==0.65.0, which wants numpy<2.5, while the image has
# numpy 2.5.2 and a numba of its own; neither is carried, so vLLM runs on the image's pair.
IMAGE_CONSTRAINTS="torch==2.11.0
torchvision==0.26.0
torchaudio==2.11.0
triton==3.6.0
transformers==5.17.0
tokenizers==0.23.2
huggingface-hub==1.33.0
safetensors==0.8.0
sentencepiece==0.2.2
tiktoken==0.14.0"

platforms=()
for ((n = glibc_minor; n >= 17; n--)); do platforms+=(--platform "manylinux_2_${n}_x86_64"); done
platforms+=(--platform manylinux2014_x86_64 --platform manylinux1_x86_64)
out=${out%/}
tmp="$out.tmp"
rm -rf "$tmp"
mkdir -p "$tmp/wheels" "$tmp/built"
trap 'rm -rf "$tmp"' EXIT
if [ "$engine" = sglang ]; then
  # Its own transformers and tokenizers travel (and shadow the image's on its PYTHONPATH).
  for name in $TRANSFORMERS_CARRIED; do
    IMAGE_PACKAGES=$(printf '%s\n' $IMAGE_PACKAGES | grep -vx "$name" | tr '\n' ' ')
    IMAGE_CONSTRAINTS=$(printf '%s\n' "$IMAGE_CONSTRAINTS" | grep -v "^$name==")
  done
fi
printf '%s\n' "$IMAGE_CONSTRAINTS" >"$tmp/constraints.txt"
target=(--python-version 3.12 --implementation cp "${platforms[@]}" --only-binary=:all: --find-links "$tmp/built")

for name in $PURE_SDISTS; do
  "$python" -m pip wheel --no-deps --quiet -w "$tmp/built" "$name" 2> >(grep -v '^WARNING: Location' >&2) ||
    die "could not build a wheel of $name"
done
for wheel in "$tmp"/built/*.whl; do
  [ -e "$wheel" ] || continue
  [[ $wheel == *-py3-none-any.whl ]] || die "$(basename "$wheel") is not pure Python: it would not run on the H200"
done

echo "engine_wheels: resolving $requirement and snakemake==$snakemake_version for CPython 3.12 manylinux" \
  "x86-64 (pip runs on $python)"
"$python" -m pip install --dry-run --ignore-installed --quiet --target "$tmp/never" --report "$tmp/report.json" \
  "${target[@]}" -c "$tmp/constraints.txt" "$requirement" "snakemake==$snakemake_version" \
  2> >(grep -v '^WARNING: Location' >&2) || die "pip could not resolve $requirement snakemake==$snakemake_version"

# The resolved set, less the image's packages: one name==version line each, and the report's hashes.
IMAGE_PACKAGES="$IMAGE_PACKAGES $lazy $UNUSED_BY_SNAKEMAKE ${ENGINE_SKIP:-}" "$python" - "$tmp" <<'EOF'
import json, os, re, sys
tmp = sys.argv[1]
norm = lambda name: re.sub(r"[-_.]+", "-", name).lower()
image = {norm(n) for n in os.environ["IMAGE_PACKAGES"].split()}
report = json.load(open(os.path.join(tmp, "report.json")))
seen, carried, left = {}, [], []
for item in report["install"]:
    name, version = item["metadata"]["name"], item["metadata"]["version"]
    key = norm(name)
    if key in seen:
        sys.exit(f"engine_wheels: error: the resolution holds {key} twice ({seen[key]}, {version})")
    seen[key] = version
    if key in image:
        left.append(f"{key}=={version}")
        continue
    sha = item["download_info"].get("archive_info", {}).get("hashes", {}).get("sha256", "")
    carried.append((key, version, sha))
with open(os.path.join(tmp, "requirements.txt"), "w") as f:
    f.writelines(f"{k}=={v}\n" for k, v, _ in carried)
with open(os.path.join(tmp, "expected.tsv"), "w") as f:
    f.writelines(f"{k}\t{v}\t{s}\n" for k, v, s in carried)
print(f"engine_wheels: {len(seen)} packages resolved, {len(carried)} to carry, {len(left)} left to the image:")
print("  " + " ".join(sorted(left)))
EOF

echo "engine_wheels: downloading $(wc -l <"$tmp/requirements.txt") wheels"
"$python" -m pip download --no-deps --quiet "${target[@]}" -d "$tmp/wheels" -r "$tmp/requirements.txt" \
  2> >(grep -v '^WARNING: Location' >&2) || die "pip download failed"

# Exactly one wheel of each carried package, of the resolved version; list them.
"$python" - "$tmp" <<'EOF'
import hashlib, os, re, sys
tmp = sys.argv[1]
norm = lambda name: re.sub(r"[-_.]+", "-", name).lower()
expected = {}
for line in open(os.path.join(tmp, "expected.tsv")):
    key, version, sha = line.rstrip("\n").split("\t")
    expected[key] = (version, sha)
found = {}
for wheel in sorted(os.listdir(os.path.join(tmp, "wheels"))):
    if not wheel.endswith(".whl"):
        sys.exit(f"engine_wheels: error: not a wheel: {wheel}")
    key = norm(wheel.split("-")[0])
    if key in found:
        sys.exit(f"engine_wheels: error: two wheels of {key}: {found[key]} and {wheel}")
    found[key] = wheel
missing = sorted(set(expected) - set(found))
extra = sorted(set(found) - set(expected))
if missing or extra:
    sys.exit(f"engine_wheels: error: wheels missing {missing}, unexpected {extra}")
rows = []
for key, wheel in sorted(found.items()):
    version, sha = expected[key]
    path = os.path.join(tmp, "wheels", wheel)
    if version not in wheel.split("-")[1]:
        # Wheel names keep the release's own spelling; compare loosely, then name what was found.
        print(f"engine_wheels: note: {wheel} for {key}=={version}")
    digest = hashlib.sha256(open(path, "rb").read()).hexdigest()
    if sha and digest != sha:
        print(f"engine_wheels: note: {wheel} is another build of {key}=={version} than the resolver saw")
    rows.append(f"{key}\t{version}\t{wheel}\t{os.path.getsize(path)}\n")
with open(os.path.join(tmp, "wheels", "packages.txt"), "w") as f:
    f.writelines(rows)
EOF

tar --sort=name --owner=0 --group=0 --numeric-owner --mtime=@0 -cf "$tmp/engine.tar" -C "$tmp" wheels
mkdir -p "$tmp/out"
split -b "$part_size" -d -a 3 "$tmp/engine.tar" "$tmp/out/engine.tar.part-"
(cd "$tmp" && sha256sum engine.tar) >"$tmp/out/engine.sha256"
(cd "$tmp/out" && sha256sum engine.tar.part-*) >>"$tmp/out/engine.sha256"
cp "$tmp/wheels/packages.txt" "$tmp/out/packages.txt"

rm -rf "$out"
mv "$tmp/out" "$out"

parts=$(ls "$out"/engine.tar.part-* | wc -l)
total=$(stat -c %s "$tmp/engine.tar")
echo "engine_wheels: $out: $parts parts of at most $part_size, $total bytes in all ($((total / 1048576)) MiB)"
ls -l "$out" | sed 1d
