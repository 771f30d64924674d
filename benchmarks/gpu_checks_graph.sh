#!/usr/bin/env bash
# Second GPU run: the whole-step CUDA graph (TrainConfig.cuda_graph) against eager, in
# bench_client.py and bench_simulation.py, and its CUDA test. Same conventions as gpu_checks.sh.
set -u
OUT=${OUT:-/tmp/gpu-out}; mkdir -p "$OUT"
if ! python3 -c "import flwr" 2>/dev/null && ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONUNBUFFERED=1
run() { local name=$1 limit=$2; shift 2; local t0=$SECONDS
  timeout "$limit" "$@" > "$OUT/$name.out" 2> "$OUT/$name.err"; local rc=$?
  echo "$name rc=$rc $((SECONDS - t0))s" | tee -a "$OUT/summary.txt"; tail -n 1 "$OUT/$name.out"; }
run cuda_tests 60 python3 -m pytest -q -p no:cacheprovider tests/spectral/test_cuda.py tests/spectral/test_spectral_device.py -k "graph or matches_cpu or never_waits or rebuild or resolve"
run bench_client_graph 90 python3 benchmarks/bench_client.py --device cuda --quick --cuda-graph --steps 20 --repeats 10 --warmup 5
run bench_simulation_graph 90 python3 benchmarks/bench_simulation.py --device cuda --rounds 3 --cuda-graph
exit 0
