#!/usr/bin/env bash
# Install the vLLM engine and Snakemake on an H200 that has no package index, from the parts that
# scripts/device/engine_wheels.sh made (.gpu-inputs/engine-parts/: engine.tar.part-NNN, engine.sha256).
#
# Runs ON the H200, in the repository root. A run there carries at most 64 MiB, the working tree
# included, so the tar travels one part per run, and this script appends each part to
# /tmp/wmtp-engine/engine.tar. The H200 keeps /tmp only while runs follow each other within 30 s, so
# send the runs back to back, in order, each carrying its part and the manifest engine.sha256:
#   run 1:     bash scripts/device/engine_install.sh .gpu-inputs/engine-parts/engine.tar.part-000
#   run 2:     bash scripts/device/engine_install.sh .gpu-inputs/engine-parts/engine.tar.part-001
#   ...
#   last run:  bash scripts/device/engine_install.sh .gpu-inputs/engine-parts/engine.tar.part-<last> --install
# With --install (alone, or after the last part) it checks the whole tar against the manifest, unpacks
# the wheels, installs them with `pip install --no-index --no-deps --target /tmp/wmtp-engine/site`, lists
# any requirement that the image and the carried set leave unmet, installs this checkout's wmtp beside them
# (the servers import the plugin from there), and prints the installed vLLM and Snakemake versions. --wmtp alone
# installs this checkout's wmtp again where its sources changed (scripts/device/h200_background.sh does, each start).
# The workflow's own runs follow within 30 s, with
#   export PYTHONPATH=$PWD/src:/tmp/wmtp-engine/site
#
# Every step can be repeated: a part already appended is skipped (same name and hash), a part out of
# order is refused with the part expected next, and --install on an installed tree only prints the
# version. If the H200 was released in between (/tmp/wmtp-engine is gone or holds another tar), start
# again from part-000; --reset clears the state by hand.
#
# Usage: engine_install.sh [--reset] [PART] [--install] [--wmtp] [--manifest FILE]
set -euo pipefail

dir=${ENGINE_DIR:-/tmp/wmtp-engine} # ENGINE_DIR=/tmp/wmtp-sglang for SGLang's parts
tar_file=$dir/engine.tar
log=$dir/parts.log  # one line per appended part: index, sha256, size in bytes
python=${PYTHON:-python3}

die() { echo "engine_install: ERROR: $*" >&2; exit 1; }
trap 'echo "engine_install: ERROR: failed at line $LINENO: $BASH_COMMAND" >&2' ERR

part="" install=0 manifest="" wmtp=0
while [ $# -gt 0 ]; do
  case $1 in
    --install) install=1 ;;
    --wmtp) wmtp=1 ;;
    --reset) rm -rf "$dir"; echo "engine_install: cleared $dir" ;;
    --manifest) [ $# -ge 2 ] || die "--manifest needs a file"; manifest=$2; shift ;;
    -h | --help) sed -n '2,26p' "$0"; exit 0 ;;
    -*) die "unknown option $1" ;;
    *) [ -z "$part" ] || die "one part per run (got $part and $1)"; part=$1 ;;
  esac
  shift
done
[ -n "$part" ] || [ "$install" = 1 ] || [ "$wmtp" = 1 ] || die "nothing to do: name a part, --install or --wmtp (see --help)"

# This checkout's wmtp beside the engine: a server's PYTHONPATH is the engine's site alone (the study's engine env),
# and vLLM loads the plugin from there. Marked by a hash of its sources: a changed checkout installs again.
install_wmtp() {
  local rev
  rev=$(find src pyproject.toml -type f -not -path '*/__pycache__/*' | sort | xargs sha256sum | sha256sum | cut -c1-16)
  if [ "$(cat "$dir/site/.wmtp-installed" 2>/dev/null)" = "$rev" ]; then
    echo "engine_install: this checkout's wmtp is beside the engine"
    return
  fi
  "$python" -m pip install -q --no-deps --no-index --no-build-isolation --upgrade --target "$dir/site" . ||
    die "could not install this checkout's wmtp beside the engine"
  echo "$rev" >"$dir/site/.wmtp-installed"
  echo "engine_install: installed this checkout's wmtp beside the engine ($rev)"
}

if [ "$wmtp" = 1 ] && [ -z "$part" ] && [ "$install" = 0 ]; then
  [ -f "$dir/site/.wmtp-engine-installed" ] || die "no engine in $dir/site: install it first (its last part with --install)"
  install_wmtp
  exit 0
fi

mkdir -p "$dir"
touch "$log"

# The manifest travels with the parts; keep the latest copy beside the tar.
if [ -z "$manifest" ] && [ -n "$part" ] && [ -f "$(dirname "$part")/engine.sha256" ]; then
  manifest=$(dirname "$part")/engine.sha256
fi
if [ -n "$manifest" ]; then
  [ -f "$manifest" ] || die "no manifest at $manifest"
  if [ -f "$dir/engine.sha256" ] && ! cmp -s "$manifest" "$dir/engine.sha256"; then
    die "$manifest is not the manifest of the tar being assembled in $dir (parts of another build?); rerun with --reset from part-000"
  fi
  cp "$manifest" "$dir/engine.sha256"
fi

expected_sha() {  # sha256 the manifest gives for a name, or nothing
  [ -f "$dir/engine.sha256" ] && awk -v n="$1" '$2 == n { print $1 }' "$dir/engine.sha256" || true
}

# Undo a half-written append: the tar must be exactly the parts the log records.
recorded=$(awk '{ s += $3 } END { print s + 0 }' "$log")
actual=$(stat -c %s "$tar_file" 2>/dev/null || echo 0)
if [ "$actual" -gt "$recorded" ]; then
  echo "engine_install: dropping $((actual - recorded)) bytes of an interrupted append"
  truncate -s "$recorded" "$tar_file"
elif [ "$actual" -lt "$recorded" ]; then
  die "$tar_file holds $actual bytes but the log records $recorded; rerun with --reset from part-000"
fi

if [ -n "$part" ]; then
  [ -f "$part" ] || die "no part at $part (carry it with this run)"
  name=$(basename "$part")
  [[ $name =~ ^engine\.tar\.part-([0-9]+)$ ]] || die "$name is not named engine.tar.part-NNN"
  index=$((10#${BASH_REMATCH[1]}))
  sha=$(sha256sum "$part" | cut -d' ' -f1)
  size=$(stat -c %s "$part")
  want=$(expected_sha "$name")
  if [ -n "$want" ]; then
    [ "$sha" = "$want" ] || die "$name: sha256 $sha, the manifest says $want (damaged in transit?)"
  else
    echo "engine_install: warning: no manifest entry for $name; not verified" >&2
  fi
  done_sha=$(awk -v i="$index" '$1 == i { print $2 }' "$log")
  next=$(wc -l <"$log")
  if [ -n "$done_sha" ]; then
    [ "$done_sha" = "$sha" ] || die "$name differs from the part $index appended before; rerun with --reset from part-000"
    echo "engine_install: $name already appended; skipped"
  elif [ "$index" -ne "$next" ]; then
    if [ "$next" -eq 0 ]; then
      die "$name out of order: $dir is empty, so the H200 was released since the last run; start again from part-000"
    fi
    die "$name out of order: expected part $(printf %03d "$next") next"
  else
    cat "$part" >>"$tar_file"
    echo "$index $sha $size" >>"$log"
    echo "engine_install: appended $name ($size bytes); $tar_file now $(stat -c %s "$tar_file") bytes"
  fi
fi

[ "$install" = 1 ] || exit 0

[ -f "$dir/engine.sha256" ] || die "no manifest: carry engine.sha256 with the parts or pass --manifest"
parts_listed=$(awk '$2 ~ /^engine\.tar\.part-/' "$dir/engine.sha256" | wc -l)
parts_done=$(wc -l <"$log")
[ "$parts_done" -eq "$parts_listed" ] ||
  die "$parts_done of $parts_listed parts appended; next is part $(printf %03d "$parts_done")"
want=$(expected_sha engine.tar)
[ -n "$want" ] || die "the manifest has no line for engine.tar"
marker=$dir/site/.wmtp-engine-installed

if [ -f "$marker" ] && [ "$(cat "$marker")" = "$want" ]; then
  echo "engine_install: already installed in $dir/site from this tar"
else
  sha=$(sha256sum "$tar_file" | cut -d' ' -f1)
  [ "$sha" = "$want" ] || die "$tar_file: sha256 $sha, the manifest says $want"
  echo "engine_install: tar verified ($want)"
  rm -rf "$dir/wheels" "$dir/site"
  tar -xf "$tar_file" -C "$dir"
  shopt -s nullglob
  wheels=("$dir"/wheels/*.whl)
  [ ${#wheels[@]} -gt 0 ] || die "no wheels in $tar_file"
  echo "engine_install: installing ${#wheels[@]} wheels into $dir/site"
  "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$dir/site" "${wheels[@]}"
  # nvidia-cutlass-dsl-libs-base and -libs-cu13 write the same paths under nvidia_cutlass_dsl/ and pip
  # gives no order between them; vLLM wants the cu13 files (it checks them against that wheel's RECORD).
  for wheel in "$dir"/wheels/nvidia_cutlass_dsl_libs_cu13-*.whl; do
    "$python" -c 'import sys, zipfile
z = zipfile.ZipFile(sys.argv[1])
z.extractall(sys.argv[2], [n for n in z.namelist() if n.startswith("nvidia_cutlass_dsl/")])' "$wheel" "$dir/site"
    echo "engine_install: laid $(basename "$wheel")'s files over nvidia_cutlass_dsl/"
  done
  rm -rf "$dir/wheels"
  echo "$want" >"$marker"
fi

export PYTHONPATH=$dir/site${PYTHONPATH:+:$PYTHONPATH}

# Requirements the image plus the carried set leave unmet (the image's own versions were not chosen for
# vLLM): listed, not fatal; a missing module shows up again, louder, at the import below.
"$python" - "$dir/site" <<'EOF' || echo "engine_install: warning: requirement check did not run" >&2
import importlib.metadata as md, sys
try:
    from packaging.requirements import Requirement
except ImportError:  # pip's own copy
    from pip._vendor.packaging.requirements import Requirement
site = sys.argv[1]
unmet = []
for dist in md.distributions(path=[site]):
    for text in dist.requires or []:
        req = Requirement(text)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        try:
            have = md.version(req.name)
        except md.PackageNotFoundError:
            unmet.append(f"{dist.metadata['Name']} needs {req}: not installed")
            continue
        if req.specifier and not req.specifier.contains(have, prereleases=True):
            unmet.append(f"{dist.metadata['Name']} needs {req}: found {have}")
for line in sorted(set(unmet)):
    print("engine_install: unmet:", line)
print(f"engine_install: {len(set(unmet))} unmet requirement(s)")
EOF

install_wmtp
echo "engine_install: PYTHONPATH=$PYTHONPATH"
# What the workflow itself imports beside vLLM, named before any run needs it.
PYTHONPATH=$PWD/src:$PYTHONPATH "$python" -c 'import pandas, pyarrow, pydantic, yaml, httpx, tokenizers, jinja2, wmtp' ||
  die "the image and the carried set lack a module the workflow needs (above)"
echo "engine_install: snakemake $("$python" -m snakemake --version)"
# The engine the parts carried: vLLM's or SGLang's version.
"$python" -c 'import importlib.util as u
name = "vllm" if u.find_spec("vllm") else "sglang"
print(name, __import__(name).__version__)'
