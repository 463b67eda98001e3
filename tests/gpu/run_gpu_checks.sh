#!/usr/bin/env bash
# The GPU checks: tests/gpu/test_cuda.py, `rayjobs bench attention` and `rayjobs bench train`, on one
# CUDA GPU. Needs only torch, numpy, pyarrow and pytest (no Ray or pydantic; the Hugging Face flex
# check also needs transformers and is skipped without it), so it runs from a bare checkout
# on a GPU machine. Logs and the benches' JSON go to $1 (default: gpu-checks/).
# bench train reads an export made beforehand where Ray is installed (default gpu-checks/export,
# or $2), and carried to the GPU machine with the checkout:
#   rayjobs export configs/bench_train.yaml --out gpu-checks/export
# Each step has its own time limit (cold flex compiles take tens of seconds each), so a slow
# step cannot use up the machine's call and leave the later ones unrun; every step runs whatever
# the one before it did, and its log is written as it goes.
set -uo pipefail
cd "$(dirname "$0")/.." && cd ..  # the repository root (the script lies in tests/gpu)
out=${1:-gpu-checks}
mkdir -p "$out"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
python3 - <<'PY' 2>&1 | tee "$out/device.txt"
import torch
print(torch.cuda.get_device_name(), "torch", torch.__version__, "cuda", torch.version.cuda)
PY
limit() { timeout -k 10 "$@"; }  # limit SECONDS command...: exit 124 when it ran out
# -s: the tests print their measured differences (docs/benchmarks.md)
limit 220 python3 -m pytest -q -s -p no:cacheprovider -rs tests/gpu/test_cuda.py 2>&1 \
  | tee "$out/test_cuda.log"
tests=$?
limit 180 python3 -m rayjobs.bench.attention --json "$out/attention.json" 2>&1 \
  | tee "$out/bench_attention.log"
bench=$?
export_dir=${2:-gpu-checks/export}
if [ -f "$export_dir/_manifest.json" ] || [ -f "$export_dir/manifest.json" ]; then
  limit 180 python3 -m rayjobs.bench.train --export "$export_dir" --json "$out/train.json" 2>&1 \
    | tee "$out/bench_train.log"
  train=$?
else
  echo "no export at $export_dir: rayjobs export configs/bench_train.yaml --out $export_dir" >&2
  train=1
fi
echo "tests exit $tests, bench attention exit $bench, bench train exit $train"
exit $(( tests || bench || train ))
