#!/usr/bin/env bash
# Builds gpu-wheels/ (git-ignored): the wheels `tests/gpu/run_ray_gpu.sh` installs offline on the
# GPU machine, whose image has torch, transformers, tokenizers, numpy, pandas, pyarrow, fsspec,
# click, filelock, msgpack, protobuf, pyyaml, requests, jinja2 and psutil but no Ray and no
# pydantic, and which reaches no package index. A device call carries at most 64 MiB, the
# working tree included, so:
#   - Ray's wheel (the version pyproject.toml pins) without ray/jars/ray_dist.jar, its Java
#     workers' jar (31 MB of its 79 MB; a Python job never reads it), repacked as a valid wheel
#     (tests/gpu/strip_wheel.py: the jar's RECORD line goes, every hash is checked);
#   - what `ray[data,train]` and rayjobs need beyond that image: jsonschema and its three,
#     tensorboardX, pydantic and its three, and fastokens (the tokenizer backend `auto` picks);
#   - packaging and typing-extensions, which that image has, in case its versions are older than
#     Ray (packaging>=24.2) or pydantic-core (typing-extensions>=4.14.1) need: pip installs them
#     only then.
# Not ray[default] (dashboard, metrics export, runtime_env agents): its closure (opencensus,
# opentelemetry, google-auth, cryptography, virtualenv, py-spy, ...) adds 19 MB, past the limit;
# Ray runs without it, and nothing measured needs it.
# Versions are pinned (resolved 2026-12-05 for ray 2.60.0), so a rebuild fetches the same files.
#
#   tests/gpu/make_wheelhouse.sh [DIR]       DIR: default gpu-wheels
#   PYTHON_VERSION=3.11 tests/gpu/make_wheelhouse.sh /tmp/w311   # for a CPython 3.11 machine
#
# PYTHON_VERSION: the GPU machine's Python (3.12; `python3 --version` there). Needs pip and
# network here. Ends by printing the folder's size and the working tree's beside the limit.
set -euo pipefail
root=$(dirname "$(dirname "$(cd "$(dirname "$0")" && pwd)")") # the repository root
out=${1:-$root/gpu-wheels}
py=${PYTHON_VERSION:-3.12}
abi=cp${py/./}
ray_version=$(grep -oE '"ray\[[a-z,]+\]==[0-9.]+"' "$root/pyproject.toml" | grep -oE '[0-9.]+[0-9]')
deps=(
  jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py==2026.9.1
  tensorboardx==2.6.5
  pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
  packaging==26.4 typing-extensions==4.16.0
  fastokens==0.3.5
)
platform=(--only-binary=:all: --python-version "$py" --implementation cp --abi "$abi" --abi abi3)
for tag in manylinux2014_x86_64 manylinux_2_17_x86_64 manylinux_2_28_x86_64; do
  platform+=(--platform "$tag")
done
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
rm -rf "$out"
mkdir -p "$out"
python3 -m pip download -q --no-deps "${platform[@]}" -d "$tmp" "ray==$ray_version"
python3 "$root/tests/gpu/strip_wheel.py" "$tmp"/ray-*.whl "$out" ray/jars/ray_dist.jar
python3 -m pip download -q --no-deps "${platform[@]}" -d "$out" "${deps[@]}"
count=$(find "$out" -name '*.whl' | wc -l)
if [ "$count" -ne $((${#deps[@]} + 1)) ]; then
  echo "expected $((${#deps[@]} + 1)) wheels in $out, found $count" >&2
  exit 1
fi
mib() { awk '{ printf "%.1f", $1 / 1048576 }'; }
wheels=$(du -cb "$out"/*.whl | tail -1 | cut -f1)
tree=$(cd "$root" && git ls-files -co --exclude-standard -z | xargs -0 du -cb | tail -1 | cut -f1)
echo "$out: $count wheels, $(echo "$wheels" | mib) MiB (ray $ray_version, CPython $py)"
echo "with the working tree ($(echo "$tree" | mib) MiB): $(echo $((wheels + tree)) | mib) MiB" \
  "of the 64 MiB a device call carries"
if [ $((wheels + tree)) -gt $((64 * 1048576)) ]; then
  echo "over the limit: the device call would be refused" >&2
  exit 1
fi
