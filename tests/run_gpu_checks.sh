#!/usr/bin/env bash
# The GPU checks: tests/test_cuda.py and `rayjobs bench attention`, on one CUDA GPU. Needs only
# torch, numpy, pyarrow and pytest (no Ray or pydantic; the Hugging Face flex check also needs
# transformers and is skipped without it), so it runs from a bare checkout
# on a GPU machine. Logs and the bench's JSON go to $1 (default: gpu-checks/).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-gpu-checks}
mkdir -p "$out"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
python3 - <<'PY' 2>&1 | tee "$out/device.txt"
import torch
print(torch.cuda.get_device_name(), "torch", torch.__version__, "cuda", torch.version.cuda)
PY
python3 -m pytest -q -p no:cacheprovider -rs tests/test_cuda.py 2>&1 | tee "$out/test_cuda.log"
tests=$?
python3 -m rayjobs.bench_attention --json "$out/attention.json" 2>&1 | tee "$out/bench_attention.log"
bench=$?
echo "tests exit $tests, bench exit $bench"
exit $(( tests || bench ))
