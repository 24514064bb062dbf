"""Writes OUT_DIR/gpu_check.json for scripts/gpu_check.sh from what its checks left in OUT_DIR: the
check rows (rows.txt), every variant's bf16 step time (variant_*/summary.json), the kernel
benchmark's JSON (bench_kernels.json) and, pulled out of it, the fused MSAR stream kernel's rows
(time, GB/s, fraction of the copy bandwidth, and its speed-up over the torch twin and over
torch.compile of the twin), and what one GPU cannot check.

    python scripts/gpu_check_summary.py OUT_DIR GPU_NAME
"""

from __future__ import annotations

import json
import pathlib
import sys

NOT_CHECKED = [
    "NCCL point-to-point between ranks: it needs two GPUs; the pipelined runs here use the in-process loopback "
    "transport under NCCL's ordering rules, not BatchedDistTransport",
    "gloo between two rank processes sharing this one GPU (CUDA tensors staged through the host): the local "
    "launcher gives each rank its own GPU or none",
]
STREAM_KEYS = ("name", "mode", "n_sources", "n_tokens", "width_d", "n_queries", "seq_len", "kernel_sizes", "ms",
               "gbps", "frac_copy_bw", "max_abs_err_vs_torch")


def check_rows(text: str) -> list[dict]:
    """`| check | result | seconds | last line |` rows (the last line's own '|' were made '/')."""
    rows = []
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        rows.append({"check": cells[0], "result": cells[1], "seconds": int(cells[2]), "last_line": cells[3]})
    return rows


def stream_kernel_rows(bench: dict | None) -> list[dict]:
    """The fused stream kernel's Triton rows, each with the twin's and the compiled twin's time over it."""
    if bench is None:
        return []
    rows = [r for r in bench["rows"] if r["op"] == "phase1_streams"]
    out = []
    for row in (r for r in rows if r["impl"] == "triton"):
        others = {r["impl"]: r for r in rows if r["name"] == row["name"] and r["mode"] == row["mode"]}
        out.append({**{k: row.get(k) for k in STREAM_KEYS},
                    "speedup_vs_torch": others.get("torch", {}).get("speedup_of_triton"),
                    "speedup_vs_torch_compile": others.get("torch.compile", {}).get("speedup_of_triton")})
    return out


def summary(out: pathlib.Path, gpu: str) -> dict:
    rows = check_rows((out / "rows.txt").read_text())
    variants = {}
    for path in sorted(out.glob("variant_*/summary.json")):
        data = json.loads(path.read_text())
        variants[path.parent.name[len("variant_"):]] = {"step_time_s": data.get("step_time_s"),
                                                        "final_loss": data["losses"][-1]}
    kernels = out / "bench_kernels.json"
    bench = json.loads(kernels.read_text()) if kernels.exists() else None
    return {"gpu": gpu, "checks": rows, "all_passed": all(r["result"] == "pass" for r in rows),
            "variant_step_time_bf16": variants, "bench_kernels": bench,
            "msar_streams_kernel": {"tests": next((r for r in rows if r["check"] == "msar_streams_kernel"), None),
                                    "bandwidth": stream_kernel_rows(bench)},
            "not_checked": NOT_CHECKED}


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("error: usage: scripts/gpu_check_summary.py OUT_DIR GPU_NAME", file=sys.stderr)
        return 2
    out = pathlib.Path(argv[0])
    (out / "gpu_check.json").write_text(json.dumps(summary(out, argv[1]), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
