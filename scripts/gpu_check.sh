#!/usr/bin/env bash
# The GPU check (DESIGN rule 7), ready for a lent CUDA GPU: in under 8 minutes on one GPU it runs
#   1. the kernel tests on CUDA (tests/kernels: Triton vs the torch backend, fp32 and bf16),
#   2. benchmarks/bench_kernels.py --quick,
#   3. single-process training on CUDA, --kernels triton vs --kernels torch, 20 bf16 steps
#      (losses must agree within 1e-3 relative),
#   4. a P = 1, V = 2 in-process pipelined run on CUDA (both chunks on one GPU, bf16, NCCL rules),
#   5. a D = 2 x P = 2 in-process run on CUDA (four rank workers on one GPU, bf16, NCCL rules,
#      gradient averaging over the replicas, pipelined evaluation at the end),
# and writes OUT_DIR/summary.md (one row per check) next to each check's log.
#
#     scripts/gpu_check.sh OUT_DIR
#
# Without a CUDA device it says so and exits 3 without running anything. Exit 1 if a check failed.
set -uo pipefail
OUT=${1:?usage: scripts/gpu_check.sh OUT_DIR}
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
if ! "$PYTHON" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  echo "gpu_check: no CUDA device is visible (torch.cuda.is_available() is False): nothing was run" >&2
  exit 3
fi
unset TRITON_INTERPRET ATTNRES_PP_FORCE_CPU
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
GPU=$("$PYTHON" -c "import torch; print(torch.cuda.get_device_name(0))")
TRAIN=(-m attnres_pp.cli train --device cuda --dtype bf16 --steps 20 --eval-every 0 --quiet)
ROWS=()
FAILED=0

check() {  # check NAME SECONDS COMMAND...: run with a time limit, log, and add a summary row
  local name=$1 limit=$2
  shift 2
  local start=$SECONDS
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  local status=pass
  if [ "$rc" -eq 124 ]; then status="timeout (${limit} s)"; elif [ "$rc" -ne 0 ]; then status="fail (exit $rc)"; fi
  [ "$status" = pass ] || FAILED=1
  ROWS+=("| $name | $status | $((SECONDS - start)) | $(tail -n 1 "$OUT/$name.log" | tr '|' '/' | cut -c1-100) |")
  echo "gpu_check: $name: $status"
}

check kernel_tests 200 "$PYTHON" -m pytest -p no:benchmark -q tests/kernels
check bench_kernels_quick 120 "$PYTHON" benchmarks/bench_kernels.py --quick
check train_triton 60 "$PYTHON" "${TRAIN[@]}" --launcher local --kernels triton --out "$OUT/train_triton"
check train_torch 60 "$PYTHON" "${TRAIN[@]}" --launcher local --kernels torch --out "$OUT/train_torch"
check triton_vs_torch_loss 20 "$PYTHON" - "$OUT/train_triton/summary.json" "$OUT/train_torch/summary.json" <<'PY'
import json, sys
triton, torch_ = (json.load(open(path))["losses"] for path in sys.argv[1:3])
worst = max(abs(a - b) / abs(b) for a, b in zip(triton, torch_, strict=True))
print(f"20 bf16 steps, max relative loss difference triton vs torch: {worst:.2e} (limit 1e-3)")
sys.exit(0 if len(triton) == 20 and worst <= 1e-3 else 1)
PY
check pipelined_p1_v2 60 "$PYTHON" "${TRAIN[@]}" --launcher inprocess --stages 1 --virtual 2 --p2p-semantics nccl \
  --steps 5 --out "$OUT/pipelined_p1_v2"
check data_parallel_d2_p2 90 "$PYTHON" "${TRAIN[@]}" --launcher inprocess --data-parallel 2 --stages 2 \
  --p2p-semantics nccl --batch-size 8 --microbatches 2 --steps 5 --out "$OUT/data_parallel_d2_p2"

{
  echo "# GPU check, $(date -u +%Y-%m-%dT%H:%MZ)"
  echo
  echo "GPU: $GPU; torch $("$PYTHON" -c 'import torch; print(torch.__version__)'), triton $("$PYTHON" -c 'import triton; print(triton.__version__)'); commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
  echo
  echo "| check | result | seconds | last log line |"
  echo "|---|---|---:|---|"
  printf '%s\n' "${ROWS[@]}"
} >"$OUT/summary.md"
cat "$OUT/summary.md"
exit "$FAILED"
