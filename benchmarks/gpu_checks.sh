#!/usr/bin/env bash
# Every GPU check of the project in one run (the device machine has torch but no flwr/Ray):
# bench_engine.py's CIFAR-10 preset (batched vs sequential vs a bare loop); bench_batched_kernels.py;
# the CUDA tests; bench_simulation.py at full size, graphed with the step pool, the same with
# merge-terms, graphed with a step per client (its baseline), graphed with DataLoaders (the baseline of TensorBatches),
# compiled + graphed; bench_batches.py (data held on the GPU vs a DataLoader); bench_client.py with the whole-step
# CUDA graph, then compiled;
# and the pre-fused-step bench_client.py
# (commit 20529be, unpacked under .gpu/old; with OLD=1) on the same card, the before of
# before/after.
# Usage: OUT=/some/dir bash benchmarks/gpu_checks.sh
#        CHECKS="cuda_tests bench_batches" OUT=/some/dir bash benchmarks/gpu_checks.sh  (only those)
# Writes $OUT/summary.txt (one line per check: rc, seconds), $OUT/results.jsonl (each check's
# JSON, one line each) and $OUT/logs.tgz (every check's stdout/stderr), all refreshed after
# each check so that a run stopped at its time limit still returns what it finished.
set -u
OUT=${OUT:-/tmp/gpu-out}; mkdir -p "$OUT"; LOGS=$(mktemp -d)
if ! python3 -c "import flwr" 2>/dev/null && ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONUNBUFFERED=1 ROOT=$PWD
( nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; nproc
  python3 -c "import torch, flwr; print('torch', torch.__version__, 'flwr', flwr.__version__)" ) > "$LOGS/env.txt" 2>&1
cp "$LOGS/env.txt" "$OUT/env.txt"
run() { local name=$1 limit=$2; shift 2; local t0=$SECONDS
  if [ -n "${CHECKS:-}" ] && [[ " $CHECKS " != *" $name "* ]]; then return; fi
  timeout "$limit" "$@" > "$LOGS/$name.out" 2> "$LOGS/$name.err"; local rc=$?
  echo "$name rc=$rc $((SECONDS - t0))s" | tee -a "$OUT/summary.txt"
  python3 - "$name" "$LOGS/$name.out" >> "$OUT/results.jsonl" <<'PY'
import json, sys
name, text = sys.argv[1], open(sys.argv[2]).read()
start = text.rfind("\n{") + 1 if not text.startswith("{") else 0
try:
    print(json.dumps({"check": name, **json.loads(text[start:])}))
except ValueError:
    print(json.dumps({"check": name, "tail": text[-2000:]}))
PY
  tar czf "$OUT/logs.tgz" -C "$LOGS" . ; }
# most wanted first: a run stopped at its limit keeps what finished
# the in-process engine at the CIFAR-10 preset's shape: batched vs sequential vs a bare loop
# (the batched engine stays only if its round takes at most half the bare loop's)
run bench_engine_cifar10 300 python3 benchmarks/bench_engine.py --preset cifar10 --device cuda --repeats 3 --rounds 3 --cuda-graph --equality-examples 64
# why the batched engine wins or loses: kernels per step, batched against one client after another,
# and the CUDA time of the slowest operations of each
run bench_batched_kernels 120 python3 benchmarks/bench_batched_kernels.py --device cuda --profile --repeats 5
# (the CPU-only compiled pool test is deselected: Inductor's CPU build checks took over 50 s there;
# CI runs it)
run cuda_tests 200 python3 -m pytest -q -rf --tb=short -o log_level=WARNING -p no:cacheprovider \
  --deselect tests/client/train/fast/test_step_pool.py::test_pooled_compiled_step_trains_later_clients_like_eager \
  tests/client/train/fast/test_cuda.py tests/spectral/test_spectral_device.py tests/client/train/fast/test_step_pool.py tests/client/train/test_tensor_batches.py
run bench_simulation_graph 60 python3 benchmarks/bench_simulation.py --device cuda --rounds 3 --cuda-graph
run bench_simulation_graph_merged 60 python3 benchmarks/bench_simulation.py --device cuda --rounds 3 --cuda-graph --merge-terms
run bench_simulation_graph_fresh 60 python3 benchmarks/bench_simulation.py --device cuda --rounds 3 --cuda-graph --no-reuse-step
run bench_simulation_graph_loader 60 python3 benchmarks/bench_simulation.py --device cuda --rounds 3 --cuda-graph --data-loader
run bench_batches 60 python3 benchmarks/bench_batches.py --device cuda --train --repeats 5
run bench_simulation_compile_graph 90 python3 benchmarks/bench_simulation.py --device cuda --rounds 3 --cuda-graph --compile
run bench_receive 60 python3 benchmarks/bench_receive.py --repeats 5
run bench_client_eager_graph 80 python3 benchmarks/bench_client.py --device cuda --quick --cuda-graph --pad-terms --merge-terms --ratios 0.1 1.0 --steps 20 --repeats 10 --warmup 5 --kernels 12
run bench_client_compile 150 python3 benchmarks/bench_client.py --device cuda --quick --compile --cuda-graph --ratios 0.1 --steps 20 --repeats 10 --warmup 5
if [ -d .gpu/old ] && [ -n "${OLD:-}" ]; then cd .gpu/old
  run bench_client_old 50 python3 benchmarks/bench_client.py --device cuda --ratios 0.1 1.0 --steps 10 --repeats 5
  cd "$ROOT"; fi
exit 0
