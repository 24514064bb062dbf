#!/usr/bin/env bash
# The GPU check (docs/architecture.md rule 7), ready for a lent CUDA GPU: in under 8 minutes on one GPU it runs
#   1. the kernel tests on CUDA (tests/kernels: every Triton kernel vs its torch twin, outputs and
#      gradients, fp32 and bf16), the fused MSAR stream kernel's (test_triton_msar_streams.py: outputs
#      and the gradients of sources, taps and queries vs phase1_conv_streams_torch) as a row of its own,
#   2. `attnres-pp bench kernels --quick` (GB/s, % of the measured copy bandwidth, beside
#      torch.compile of the torch twin; phase 1, phase 2 and the fused stream kernel at the MSAR
#      paper's m = 4 streams), run as `python -m attnres_pp.cli` from this checkout (the GPU
#      machine has torch and Triton but neither Ray nor the package installed); its JSON is copied
#      to OUT_DIR/bench_kernels.json,
#   3. single-process training on CUDA, --kernels triton vs --kernels torch, 20 bf16 steps
#      (losses must agree within 1e-3 relative),
#   4. a single-process bf16 CUDA training run of every residual variant (20 steps, step time),
#   5. a P = 1, V = 2 and a P = 2, V = 1 in-process pipelined run on CUDA (the chunks on one GPU,
#      bf16, the loopback transport under NCCL's ordering rules),
#   6. a D = 2 x P = 2 in-process run on CUDA (four rank workers on one GPU, bf16, NCCL rules,
#      gradient averaging over the replicas, pipelined evaluation at the end),
# and writes OUT_DIR/summary.md (one row per check) and OUT_DIR/gpu_check.json (the rows, every
# variant's step time, the stream kernel's bandwidth rows, and what was not checked; written by
# scripts/gpu_check_summary.py) next to each check's log.
#
# Not checked on one GPU, and said so in gpu_check.json: NCCL point-to-point between ranks (it needs
# two GPUs), and gloo between two rank processes sharing this GPU (the local launcher gives every
# rank its own GPU or none; see attnres_pp/train/devices.py).
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
BUDGET_S=${GPU_CHECK_BUDGET_S:-450}  # leaves half a minute of the 8 for start-up and the summary

check() {  # check NAME SECONDS COMMAND...: run with a time limit, log, and add a summary row
  local name=$1 limit=$2
  shift 2
  if [ $((SECONDS + limit)) -gt "$BUDGET_S" ]; then  # the whole call stays under 8 minutes
    ROWS+=("| $name | skipped (8-minute budget) | 0 | not run: $((BUDGET_S - SECONDS)) s left, limit ${limit} s |")
    FAILED=1
    echo "gpu_check: $name: skipped (8-minute budget)"
    return
  fi
  local start=$SECONDS
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  local status=pass
  if [ "$rc" -eq 124 ]; then status="timeout (${limit} s)"; elif [ "$rc" -ne 0 ]; then status="fail (exit $rc)"; fi
  [ "$status" = pass ] || FAILED=1
  ROWS+=("| $name | $status | $((SECONDS - start)) | $(tail -n 1 "$OUT/$name.log" | tr '|' '/' | cut -c1-100) |")
  echo "gpu_check: $name: $status"
}

STREAM_TESTS=tests/kernels/test_triton_msar_streams.py
check kernel_tests 120 "$PYTHON" -m pytest -p no:benchmark -q tests/kernels --ignore="$STREAM_TESTS"
check msar_streams_kernel 60 "$PYTHON" -m pytest -p no:benchmark -q "$STREAM_TESTS"
check bench_kernels_quick 150 "$PYTHON" -m attnres_pp.cli bench kernels --quick --out "$OUT/bench_kernels"
check train_triton 60 "$PYTHON" "${TRAIN[@]}" --launcher local --kernels triton --out "$OUT/train_triton"
check train_torch 60 "$PYTHON" "${TRAIN[@]}" --launcher local --kernels torch --out "$OUT/train_torch"
check triton_vs_torch_loss 20 "$PYTHON" - "$OUT/train_triton/summary.json" "$OUT/train_torch/summary.json" <<'PY'
import json, sys
triton, torch_ = (json.load(open(path))["losses"] for path in sys.argv[1:3])
worst = max(abs(a - b) / abs(b) for a, b in zip(triton, torch_, strict=True))
print(f"20 bf16 steps, max relative loss difference triton vs torch: {worst:.2e} (limit 1e-3)")
sys.exit(0 if len(triton) == 20 and worst <= 1e-3 else 1)
PY
VARIANTS=("standard:--residual standard" "full_attnres:--residual attnres --block-size 1"
  "block_attnres:--residual attnres --block-size 2" "p_lr_attnres:--residual lr_attnres --key-mode projected"
  "s_lr_attnres:--residual lr_attnres --key-mode sliced" "msar:--residual msar --block-size 2")
for entry in "${VARIANTS[@]}"; do
  name=${entry%%:*}
  # shellcheck disable=SC2086  # the flags are words
  check "variant_$name" 30 "$PYTHON" "${TRAIN[@]}" --launcher local ${entry#*:} --out "$OUT/variant_$name"
done
check pipelined_p2_v1 60 "$PYTHON" "${TRAIN[@]}" --launcher inprocess --stages 2 --virtual 1 --p2p-semantics nccl \
  --steps 5 --out "$OUT/pipelined_p2_v1"
check pipelined_p1_v2 60 "$PYTHON" "${TRAIN[@]}" --launcher inprocess --stages 1 --virtual 2 --p2p-semantics nccl \
  --steps 5 --out "$OUT/pipelined_p1_v2"
check data_parallel_d2_p2 90 "$PYTHON" "${TRAIN[@]}" --launcher inprocess --data-parallel 2 --stages 2 \
  --p2p-semantics nccl --batch-size 8 --microbatches 2 --steps 5 --out "$OUT/data_parallel_d2_p2"

cp "$OUT"/bench_kernels/kernels_quick_*.json "$OUT/bench_kernels.json" 2>/dev/null || true
printf '%s\n' "${ROWS[@]}" >"$OUT/rows.txt"
"$PYTHON" scripts/gpu_check_summary.py "$OUT" "$GPU"
{
  echo "# GPU check, $(date -u +%Y-%m-%dT%H:%MZ)"
  echo
  echo "GPU: $GPU; torch $("$PYTHON" -c 'import torch; print(torch.__version__)'), triton $("$PYTHON" -c 'import triton; print(triton.__version__)'); commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
  echo
  echo "| check | result | seconds | last log line |"
  echo "|---|---|---:|---|"
  printf '%s\n' "${ROWS[@]}"
  echo
  echo "Not checked here: NCCL point-to-point (needs two GPUs); gloo between two rank processes on one GPU."
} >"$OUT/summary.md"
cat "$OUT/summary.md"
exit "$FAILED"
