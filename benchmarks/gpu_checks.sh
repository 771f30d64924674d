#!/usr/bin/env bash
# Every GPU check of the project in one run (the device machine has torch but no flwr/Ray):
# the CUDA tests, bench_client.py (eager and compiled), bench_simulation.py at full size, and
# the pre-fused-step bench_client.py (commit 20529be, unpacked under .gpu/old) on the same card.
# Usage: OUT=/some/dir bash benchmarks/gpu_checks.sh   (writes one JSON/log file per check)
set -u
OUT=${OUT:-/tmp/gpu-out}; mkdir -p "$OUT"
if ! python3 -c "import flwr" 2>/dev/null && ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONUNBUFFERED=1
( nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; python3 -c "import torch, flwr; print('torch', torch.__version__, 'flwr', flwr.__version__)" ) > "$OUT/env.txt" 2>&1
run() { local name=$1 limit=$2; shift 2; local t0=$SECONDS
  timeout "$limit" "$@" > "$OUT/$name.out" 2> "$OUT/$name.err"; local rc=$?
  echo "$name rc=$rc $((SECONDS - t0))s" | tee -a "$OUT/summary.txt"; tail -n 1 "$OUT/$name.out"; }
run cuda_tests 120 python3 -m pytest -q -p no:cacheprovider -x tests/spectral/test_cuda.py tests/spectral/test_spectral_device.py
run bench_client_eager 80 python3 benchmarks/bench_client.py --device cuda --quick --steps 20 --repeats 10 --warmup 5
run bench_simulation 120 python3 benchmarks/bench_simulation.py --device cuda --rounds 3
run bench_client_compile 120 python3 benchmarks/bench_client.py --device cuda --quick --compile --ratios 0.1 --steps 20 --repeats 10 --warmup 5
( cd .gpu/old 2>/dev/null && run bench_client_old 60 python3 benchmarks/bench_client.py --device cuda --ratios 0.1 1.0 --steps 10 --repeats 5 )
exit 0
