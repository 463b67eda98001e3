#!/usr/bin/env bash
# The GPU path through Ray, on one CUDA machine whose image has no Ray (tests/gpu/README: the
# H200 the device tool lends, 16 cores):
#   1. install the wheelhouse tests/gpu/make_wheelhouse.sh built (gpu-wheels/, carried with the
#      checkout) offline: Ray without its jar, pydantic, and what else Ray needs beyond the image;
#   2. `rayjobs run configs/gpu_flex.yaml --json`: one GPU worker through Ray Train, FlexAttention,
#      streamed data; its summary's `throughput` is the run's tokens/s;
#   3. `rayjobs export` of the same config, then `rayjobs bench train` on it: the bare loop, the
#      same model (dim, layers, heads, vocabulary), rows per step, seq_len, precision, attention,
#      steps and warm-up steps; the ratio run / bare loop (bound: 90%);
#   4. `rayjobs bench pipeline` with 1, 8, 2, 4 and 14 Tokenize actors (that order: the bound's
#      two first), each at 8 copies of the data per actor, windows of 256 Ki tokens, no paced
#      pass: steady tokens/s against linear scaling from one actor (bound: 80% at 8 actors).
# Each step has its own time limit and all of them one budget (BUDGET_S, default 540 s), so a slow
# step cannot use up the device call; a step the budget has no room left for is skipped, and
# results.json is rewritten after every step with what has finished.
#
#   tests/gpu/run_ray_gpu.sh [OUT_DIR]                 OUT_DIR: default gpu-ray/
#   RAY_GPU_MODE=cpu tests/gpu/run_ray_gpu.sh OUT_DIR  the same steps on CPU (a dry run)
#
# OUT_DIR receives two files, log.txt (every step's output) and results.json (ray_gpu_results.py:
# the figures, each step's exit code and seconds, the run's summary, bench train's rows); the
# work files (the export, checkpoints, per-step JSON) stay in a temporary folder. Environment:
#   RAY_GPU_MODE  gpu (default) or cpu: use_gpu false, SDPA, fp32, a dim-128 2-layer decoder at
#                 seq_len 1024, 10 steps, one epoch, 1 and 2 Tokenize actors at 2 copies each;
#   PYTHON        the interpreter (default python3); WHEELS: the wheelhouse (default gpu-wheels;
#                 not a folder: no install, Ray must be there already); BUDGET_S: seconds in all.
set -uo pipefail
cd "$(dirname "$(dirname "$(cd "$(dirname "$0")" && pwd)")")" || exit 1 # the repository root
out=${1:-gpu-ray}
mode=${RAY_GPU_MODE:-gpu}
python=${PYTHON:-python3}
wheels=${WHEELS:-gpu-wheels}
mkdir -p "$out"
out=$(cd "$out" && pwd)
log=$out/log.txt
: >"$log"
work=$(mktemp -d)
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
config=configs/gpu_flex.yaml
if [ "$mode" = gpu ]; then
  budget=${BUDGET_S:-540}
  dim=768 layers=8 heads=12 seq_len=4096 rows=4 steps=120 cpus=4 epochs=14
  precision=bf16 attention=flex use_gpu=true variant=packed_flex
  actors=(1 8 2 4 14) per_actor=8
  limits=(install=150 run=240 export=120 bench_train=200 pipeline=75)
elif [ "$mode" = cpu ]; then
  budget=${BUDGET_S:-1500}
  dim=128 layers=2 heads=4 seq_len=1024 rows=4 steps=10 cpus=1 epochs=1
  precision=fp32 attention=sdpa use_gpu=false variant=packed_sdpa
  actors=(1 2) per_actor=2
  limits=(install=300 run=420 export=300 bench_train=300 pipeline=300)
else
  echo "RAY_GPU_MODE is gpu or cpu, not $mode" >&2
  exit 2
fi
warmup=$((steps / 10)) # the run's throughput leaves out its first tenth of the steps
overrides=(
  "train.use_gpu=$use_gpu" "train.attention=$attention" "train.precision=$precision"
  "train.model.dim=$dim" "train.model.n_layers=$layers" "train.model.n_heads=$heads"
  "packing.seq_len=$seq_len" "train.batch_size=$rows" "train.max_steps=$steps"
  "train.cpus_per_worker=$cpus" "train.epochs=$epochs" "train.num_workers=1"
  "train.storage_path=$work/runs"
)
start=$SECONDS
failed=()

limit_of() { # the limit named $1 in limits
  local entry
  for entry in "${limits[@]}"; do
    [ "${entry%%=*}" = "$1" ] && echo "${entry#*=}"
  done
}

gather() {
  "$python" tests/gpu/ray_gpu_results.py "$work" "$out/results.json" >"$work/report.txt" 2>&1
}

# step NAME LIMIT_NAME COMMAND...: runs COMMAND under its limit, or the budget's rest if less; its
# output goes to log.txt and $work/NAME.log; records its exit code, seconds and the load average
# at its end. Once more if Ray's start-up timed out (a fixed 30 s in Ray, which a loaded shared
# machine can miss).
step() {
  local name=$1 limit_name=$2 limit left began rc
  shift 2
  for _ in 1 2; do
    limit=$(limit_of "$limit_name")
    left=$((budget - (SECONDS - start)))
    if [ "$left" -lt 30 ]; then
      echo "== $name: skipped, $left s of the $budget s budget left" | tee -a "$log"
      printf '%s\tskipped\t0\t%s\n' "$name" "$(cut -d' ' -f1 /proc/loadavg)" >>"$work/steps.tsv"
      failed+=("$name")
      gather
      return 1
    fi
    [ "$limit" -gt "$left" ] && limit=$left
    echo "== $name (limit $limit s, at $((SECONDS - start)) s): $*" | tee -a "$log"
    began=$SECONDS
    timeout -k 10 "$limit" "$@" 2>&1 | tee "$work/$name.log" | tee -a "$log"
    rc=${PIPESTATUS[0]}
    printf '%s\t%s\t%s\t%s\n' "$name" "$rc" $((SECONDS - began)) "$(cut -d' ' -f1 /proc/loadavg)" \
      >>"$work/steps.tsv"
    echo "== $name: exit $rc after $((SECONDS - began)) s" | tee -a "$log"
    gather
    if [ "$rc" -eq 0 ] || ! grep -q "timed out during startup" "$work/$name.log"; then
      break
    fi
  done
  [ "$rc" -ne 0 ] && failed+=("$name")
  return "$rc"
}

install() {
  local ray_version
  ray_version=$(grep -oE '"ray\[[a-z,]+\]==[0-9.]+"' pyproject.toml | grep -oE '[0-9.]+[0-9]')
  if [ -d "$wheels" ]; then
    ls -l "$wheels"
    # with its dependencies from the image where their versions do, the wheelhouse's where not;
    # if pip finds no set that fits, every wheel without dependency checks (the import below
    # says whether that is enough)
    "$python" -m pip install -q --no-index --no-compile --no-cache-dir --find-links "$wheels" \
      "ray[data,train]==$ray_version" pydantic fastokens ||
      "$python" -m pip install -q --no-index --no-compile --no-cache-dir --no-deps \
        "$wheels"/*.whl || return 1
  else
    echo "no wheelhouse at $wheels: using the Ray already installed"
  fi
  "$python" - "$ray_version" <<'PY'
import sys
import pydantic
import ray
import ray.data
import ray.train.torch

print("ray", ray.__version__, "pydantic", pydantic.__version__)
assert ray.__version__ == sys.argv[1], f"ray {ray.__version__}, pyproject pins {sys.argv[1]}"
PY
}

"$python" - "$work/device.json" "$mode" <<'PY' 2>&1 | tee -a "$log"
import json, os, platform, sys
import torch

info = {
    "mode": sys.argv[2],
    "python": platform.python_version(),
    "torch": torch.__version__,
    "cuda": torch.version.cuda,
    "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    "cpus": os.cpu_count(),
    "load_average": os.getloadavg(),
}
print(info)
json.dump(info, open(sys.argv[1], "w"))
PY
if [ "$mode" = gpu ] && ! "$python" -c 'import torch; assert torch.cuda.is_available()'; then
  echo "RAY_GPU_MODE=gpu needs a CUDA GPU (RAY_GPU_MODE=cpu for the dry run)" | tee -a "$log"
  exit 1
fi
export -f install
export python wheels
if ! step install install bash -c install; then
  echo "no Ray to run: stopping" | tee -a "$log"
  cat "$work/report.txt"
  exit 1
fi
vocab=$("$python" -c 'import sys
from rayjobs.config import load_config
from rayjobs.data.tokenizer import Tokenizer
print(Tokenizer(load_config(sys.argv[1]).tokenizer).vocab_size)' "$config")
cat >"$work/params.json" <<EOF
{"mode": "$mode", "config": "$config", "overrides": "${overrides[*]}", "vocab_size": $vocab,
 "dim": $dim, "layers": $layers, "heads": $heads, "seq_len": $seq_len, "rows_per_step": $rows,
 "steps": $steps, "warmup_steps": $warmup, "precision": "$precision", "attention": "$attention",
 "variant": "$variant", "cpus_per_worker": $cpus, "tokenize_actors": [$(IFS=,; echo "${actors[*]}")],
 "copies_per_actor": $per_actor, "window_tokens": 262144, "budget_s": $budget}
EOF

step run run "$python" -m rayjobs.cli run "$config" "${overrides[@]}" --json
step export export "$python" -m rayjobs.cli export "$config" "${overrides[@]}" \
  --out "$work/export"
# the bare loop on as many CPU threads as the run's worker had (torch.set_num_threads there)
step bench_train bench_train env OMP_NUM_THREADS="$cpus" "$python" -m rayjobs.cli bench train \
  --export "$work/export" --rows "$rows" --steps "$steps" --warmup "$warmup" --dim "$dim" \
  --layers "$layers" --heads "$heads" --vocab-size "$vocab" --variants "$variant" \
  --json "$work/bench_train.json"
for n in "${actors[@]}"; do
  step "pipeline_$n" pipeline "$python" -m rayjobs.cli bench pipeline \
    --scales $((per_actor * n)) --tokenize-actors "$n" --window-tokens 262144 --pace 0 \
    --json "$work/pipeline_$n.json"
done
gather
tee -a "$log" <"$work/report.txt"
echo "results: $out/results.json, log: $log (at $((SECONDS - start)) s)" | tee -a "$log"
rm -rf "$work"
if [ ${#failed[@]} -gt 0 ]; then
  echo "failed or skipped: ${failed[*]}" | tee -a "$log"
  exit 1
fi
