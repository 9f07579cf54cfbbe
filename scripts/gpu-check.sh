#!/usr/bin/env bash
# The one prepared GPU check: on a machine with CUDA, run the CUDA-parametrised tests, the main
# example (compiled, 1e6 particles) and the GPU benchmarks, then print a summary. Logs and the
# benchmark tables go to $OUT (the device tool's return folder) or /tmp/pyhvp-gpu-check. Uses the
# machine's own torch (no install, no network). Every step has a time limit; all of them together
# stay under 10 minutes (the device tool's limit per command).
#   bash scripts/gpu-check.sh
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

step tests-cuda 180 python3 -m pytest tests -q -p no:cacheprovider -k cuda
step example 60 python3 examples/particles_hvp.py 1e6 --compiled
# the CPU-only benchmarks (compile policy, torch.distributed with gloo) are left out
for bench in hvp diagonal laplacian sub_hessian; do
  step "bench_$bench" 60 python3 "benchmarks/bench_$bench.py" cuda
done
cp benchmarks/results/*-cuda.* "$logs/" 2>/dev/null

echo "=== summary"
printf '%s\n' "${status[@]}" | tee "$logs/summary.log"
grep -h -E "passed|failed" "$logs/tests-cuda.log" | tail -1
