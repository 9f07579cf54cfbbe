#!/usr/bin/env bash
# The one prepared GPU check: on a machine with CUDA, run the CUDA-parametrised tests, the main
# example and every benchmark on the GPU, then print a summary. Logs go to $OUT (the device tool's
# return folder) or /tmp/pyhvp-gpu-check. Uses the machine's own torch (no install, no network).
#   bash scripts/gpu-check.sh            # about 5 minutes on an H200
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
logs=${OUT:-/tmp/pyhvp-gpu-check}
mkdir -p "$logs"
python3 -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print('torch', torch.__version__, torch.cuda.get_device_name())" || exit 1

status=()
step() {  # step NAME SECONDS COMMAND...: run with a time limit, log, remember the outcome
  local name=$1 limit=$2; shift 2
  echo "=== $name"
  timeout "$limit" "$@" 2>&1 | tee "$logs/$name.log"
  status+=("$name: exit ${PIPESTATUS[0]}")
}

step tests-cuda 240 python3 -m pytest tests -q -p no:cacheprovider -k cuda
step example 60 python3 examples/particles_hvp.py
for bench in benchmarks/bench_*.py; do
  step "$(basename "$bench" .py)" 120 python3 "$bench" cuda
done

echo "=== summary"
printf '%s\n' "${status[@]}" | tee "$logs/summary.log"
grep -h -E "passed|failed" "$logs/tests-cuda.log" | tail -1
