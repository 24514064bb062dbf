"""Build every Triton depth-attention kernel (MSAR's fused streams included) ahead of time for
Hopper (sm_90) and Ampere (sm_80) on a machine without a GPU, print registers / stack / local /
shared memory and occupancy per build, and exit 1 if any build spills (a stack frame or local
memory).

    python scripts/aot_kernels.py                      # paper-scale grid, sm_90 and sm_80
    python scripts/aot_kernels.py --grid small --arch 90 --json out.json
    python scripts/aot_kernels.py --list               # the builds the grid needs, nothing compiled

Each shape runs the real launchers on meta tensors (attnres_pp.kernels.aot), so every build has
exactly the tiles and warps those launchers pick. Launches that compile to the same binary (same
kernel, tiles, warps, dtypes and argument specialisation) are built once.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)  # before triton is imported: compiled kernels, not interpreted
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # what launches on the GPU use; silences a warning
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from attnres_pp.kernels import aot  # noqa: E402

UNAVAILABLE = 3  # exit status when this machine cannot compile (argparse errors exit 2)
T_PAPER = 16384
KEY_MODES = [("values", 0), ("projected", 64), ("sliced", 128)]


def grid(name: str) -> list[aot.Case]:
    """'full': S in {1, 4, 8, 16} (S = 1 is Full AttnRes), N = 8, T = 16384, d in {1024, 4096,
    7168}, three key modes (plus projected r = 1024 at d = 1024), fp32 and bf16, and MSAR's fused
    streams (m = 4, kappa = 4, 8, 12) over the same S, N, T, d and dtypes. 'small': one phase-1,
    one phase-2 and one streams shape in bf16 (the CI check)."""
    if name == "small":
        return [
            aot.Case("phase1", T_PAPER, 4096, "bf16", n_queries=8, n_sources=8),
            aot.Case("phase2", T_PAPER, 4096, "bf16"),
            aot.Case("streams", T_PAPER, 4096, "bf16", n_queries=8, n_sources=8),
        ]
    cases = []
    for dtype in ("fp32", "bf16"):
        for width_d in (1024, 4096, 7168):
            # At d = 1024 also keys as wide as the values from their own projection (r = d).
            key_modes = KEY_MODES + ([("projected", 1024)] if width_d == 1024 else [])
            for key_mode, rank in key_modes:
                for n_queries in (1, 4, 8, 16):
                    for n_sources in (8,):
                        cases.append(
                            aot.Case("phase1", T_PAPER, width_d, dtype, key_mode, rank, n_queries, n_sources)
                        )
                cases.append(aot.Case("phase2", T_PAPER, width_d, dtype, key_mode, rank))
            for n_queries in (1, 4, 8, 16):
                cases.append(aot.Case("streams", T_PAPER, width_d, dtype, n_queries=n_queries, n_sources=8))
    return cases


def unique_builds(cases, arches):
    """{build key: (first launch, [cases using it])}, in first-seen order."""
    builds = {}
    for case in cases:
        for launch in aot.launches(case):
            for arch in arches:
                key = aot.build_key(launch, arch)
                builds.setdefault(key, (launch, arch, []))[2].append(case.label())
    return builds


def _tiles(constexprs: dict) -> str:
    names = [k for k in constexprs if k.startswith("BLOCK_")]
    return " ".join(f"{k[6:]}={constexprs[k]}" for k in names)


def print_summary(rows) -> None:
    """One line per kernel and architecture: builds, spills, registers, worst stack, occupancy."""
    print("\n| kernel | sm | builds | spilling | registers (min-max) | max stack (B) | occupancy (min-max) |")
    print("|---|---|---:|---:|---|---:|---|")
    groups = {}
    for row in rows:
        groups.setdefault((row["kernel"], row["arch"]), []).append(row)
    for (kernel, arch), group in groups.items():
        regs = [r["registers"] for r in group]
        occ = [r["occupancy"] for r in group]
        print(
            f"| {kernel} | {arch} | {len(group)} | {sum(r['spills'] for r in group)} | {min(regs)}-{max(regs)} "
            f"| {max(r['stack'] for r in group)} | {min(occ):.2f}-{max(occ):.2f} |"
        )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--grid", choices=("full", "small"), default="full")
    parser.add_argument("--arch", type=int, nargs="+", choices=sorted(aot.SM_LIMITS), default=[90, 80])
    parser.add_argument("--json", type=Path, help="also write the builds as JSON here")
    parser.add_argument("--list", action="store_true", help="print the builds the grid needs and stop")
    parser.add_argument("--tile-elems", type=int, help="override the launchers' tile budget (to try a retune)")
    parser.add_argument("--ops", nargs="+", choices=("phase1", "phase2", "streams"),
                        help="only the cases of these ops (default: all)")
    args = parser.parse_args(argv)

    reason = aot.unavailable_reason()
    if reason:
        print(f"error: cannot build kernels ahead of time here: {reason}", file=sys.stderr)
        return UNAVAILABLE
    if args.tile_elems:
        from attnres_pp.kernels import triton_common

        triton_common.DEFAULT_TILE_ELEMS = args.tile_elems
    cases = [case for case in grid(args.grid) if args.ops is None or case.op in args.ops]
    builds = unique_builds(cases, args.arch)
    print(f"{len(builds)} builds for grid {args.grid!r}, arch {args.arch}", flush=True)
    if args.list:
        for launch, arch, users in builds.values():
            print(f"sm_{arch} {launch.kernel_name} ({len(users)} shapes, e.g. {users[0]})")
        return 0

    header = "| kernel | sm | dtype | tiles | warps | regs | stack | local | shared | occupancy | shapes | s |"
    print(header)
    print("|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    rows, spills = [], 0
    for launch, arch, users in builds.values():
        started = time.perf_counter()
        result = aot.build(launch, arch)
        seconds = time.perf_counter() - started
        occ = aot.occupancy(result.registers, result.shared, result.num_warps, arch)
        spills += result.spills
        mark = " SPILL" if result.spills else ""
        print(
            f"| {result.kernel_name}{mark} | {arch} | {launch.case.dtype} | {_tiles(result.constexprs)} "
            f"| {result.num_warps} | {result.registers} | {result.stack} | {result.local} | {result.shared} "
            f"| {occ:.2f} | {len(users)} | {seconds:.1f} |",
            flush=True,
        )
        rows.append(
            dict(
                kernel=result.kernel_name, arch=arch, dtype=launch.case.dtype, constexprs=result.constexprs,
                num_warps=result.num_warps, registers=result.registers, stack=result.stack, local=result.local,
                shared=result.shared, occupancy=occ, spills=result.spills, shapes=users, compile_s=seconds,
            )
        )  # fmt: skip
    print_summary(rows)
    if args.json:
        args.json.write_text(json.dumps(dict(grid=args.grid, arch=args.arch, builds=rows), indent=1))
    print(f"{len(rows)} builds, {spills} spill (stack frame or local memory)")
    if spills:
        print("error: some builds spill registers; shrink their tiles or warps", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
