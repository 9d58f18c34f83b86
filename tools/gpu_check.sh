#!/bin/bash
# One prepared GPU session: install the wheels tools/gpu_wheels.sh fetched (when a folder is given), then
# `make test-gpu`'s tests, then `python -m seqpar.bench gpu` parts, writing everything under OUT as it goes.
#   tools/gpu_check.sh [WHEEL_DIR]      OUT=dir (default bench_results/gpu_check); knobs below, e.g.
#   PARTS=hybrid,train RUNS=q35_sp1_16k,q35_ring4_16k tools/gpu_check.sh .whl
# Each stage has its own time limit, so a slow stage leaves time and output for the next.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-bench_results/gpu_check}
mkdir -p "$OUT"
T0=$(date +%s)
SITE=/tmp/seqpar_gpu_site
if [ -n "${1:-}" ]; then
    # a failed install still leaves the checks that need none of it (the device time is spent either way)
    "$(dirname "$0")/gpu_install.sh" "$1" "$SITE" || echo "installing the wheels in $1 failed: going on without"
fi
export PYTHONPATH=$PWD/src:$SITE${PYTHONPATH:+:$PYTHONPATH}
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'cudnn',
torch.backends.cudnn.version(), 'transformers', transformers.__version__)"
  python3 -c "import importlib.metadata as m
for p in ('triton', 'flash-linear-attention', 'tilelang', 'causal-conv1d'):
    try: print(p, m.version(p))
    except m.PackageNotFoundError: print(p, 'not installed')"; } 2>&1 | tee "$OUT/env.txt"
echo "setup $(( $(date +%s) - T0 )) s"
timeout "${TEST_S:-200}" python3 -m pytest -q -p no:cacheprovider -o addopts="" --durations=15 \
    ${TESTS:-tests/test_gpu_attention.py tests/test_gpu_sp.py tests/test_gpu_kernel_choice.py} > "$OUT/test_gpu.log" 2>&1
echo "tests rc=$? at $(( $(date +%s) - T0 )) s"
grep -E "passed|failed|error" "$OUT/test_gpu.log" | tail -3
grep -E "^(FAILED|ERROR)" "$OUT/test_gpu.log" | head -20
timeout "${BENCH_S:-330}" python3 -m seqpar.bench gpu --parts "${PARTS:-sp,hybrid,train}" \
    ${RUNS:+--runs "$RUNS"} --timeout "${RUN_S:-200}" --out "$OUT/gpu.json" > "$OUT/bench.log" 2>&1
echo "bench rc=$? at $(( $(date +%s) - T0 )) s"
grep -E "FAILED|Error|sp world|hybrid|train |attention" "$OUT/bench.log" | cut -c1-400 | tail -30
