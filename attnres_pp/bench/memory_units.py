"""Measure what a chunk saves for backward and fit the simulator's activation units
(`attnres_pp/simulator/memory_units.json`, read by `simulator.memory`).

`saved_bytes` runs one chunk's forward, as the runtime feeds it (received and cached sources as
fresh leaves that require grad), under `torch.autograd.graph.saved_tensors_hooks` and counts every
storage saved for backward once, parameters' own storages excluded (they are `param_bytes`; the
bf16 copies autocast makes of them are counted). `fit_units` least-squares fits, per variant and
dtype, the bytes to the shape features of `simulator.memory.activation_features` over a seeded
grid of tiny models, partitions and chunks (the in-sample set, listed in the JSON).

    python -m attnres_pp.bench.memory_units --out attnres_pp/simulator/memory_units.json
"""

from __future__ import annotations

import argparse
import json
import random
import sys

import torch

from attnres_pp.comm.partition import make_partition
from attnres_pp.comm.plan import plan_for_model
from attnres_pp.model.config import ModelConfig
from attnres_pp.pipeline.chunk import build_rank_model
from attnres_pp.simulator.memory import FEATURES, activation_features, units_key

VARIANTS = (("standard", "projected"), ("attnres", "projected"), ("lr_attnres", "projected"),
            ("lr_attnres", "sliced"), ("msar", "projected"))
COMMAND = "python -m attnres_pp.bench.memory_units --out attnres_pp/simulator/memory_units.json"


def saved_bytes(cfg: ModelConfig, partition, chunk_index: int, *, n_sequences: int, dtype: str,
                cache: bool = True, seed: int = 0) -> int:
    """Bytes of the distinct storages chunk `chunk_index`'s forward saves for backward (one microbatch)."""
    plan = plan_for_model(cfg, partition, cache)
    precision = "bf16" if dtype == "bf16" else "fp32"
    model, chunks = build_rank_model(cfg, partition, partition.rank_of(chunk_index), seed=seed, precision=precision)
    chunk, io = chunks[chunk_index], plan.chunks[chunk_index]
    act_dtype = torch.bfloat16 if dtype == "bf16" else torch.float32
    generator = torch.Generator().manual_seed(seed)

    def source(kind: str) -> torch.Tensor:
        width = cfg.d_model if kind == "residual" else cfg.source_width
        return torch.randn(n_sequences, cfg.seq_len, width, generator=generator).to(act_dtype).requires_grad_(True)

    inputs = {s: source(s.kind) for s in io.received + io.cache_reads}
    idx = torch.randint(0, cfg.vocab_size, (n_sequences, cfg.seq_len), generator=generator)
    targets = torch.randint(0, cfg.vocab_size, (n_sequences, cfg.seq_len), generator=generator)
    param_storages = {p.untyped_storage().data_ptr() for p in model.parameters() if not p.is_meta}
    storages: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in param_storages:
            storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        chunk(inputs, idx if chunk.is_first else None, targets if chunk.is_last else None)
    return sum(storages.values())


def random_case(rng: random.Random, residual: str, key_mode: str, *, scale: int = 1) -> dict:
    """A tiny model, partition and chunk drawn from `rng` (`scale` widens every size for held-out cases)."""
    d = rng.choice((16, 24, 32, 48)) * scale
    n_layers = rng.choice((2, 3, 4, 6))
    n_stages, n_virtual = rng.choice(((1, 1), (2, 1), (2, 2), (3, 1), (1, 2)))
    while n_stages * n_virtual > n_layers:
        n_stages, n_virtual = 1, 1
    cfg = ModelConfig(vocab_size=rng.choice((32, 48, 80)) * scale, n_layers=n_layers, d_model=d,
                      n_heads=rng.choice((1, 2, 4)), d_ff=rng.choice((0, 3 * d, 2 * d + 8)),
                      seq_len=rng.choice((8, 12, 16, 24)) * scale, residual=residual,
                      block_size=rng.randint(1, 2 * n_layers), key_mode=key_mode, key_rank=rng.choice((4, 8)))
    return {"cfg": cfg, "n_stages": n_stages, "n_virtual": n_virtual,
            "chunk": rng.randrange(n_stages * n_virtual), "n_sequences": rng.choice((1, 2, 3))}


def measure_case(case: dict, dtype: str) -> tuple[dict[str, float], int]:
    cfg = case["cfg"]
    partition = make_partition(cfg.n_layers, case["n_stages"], case["n_virtual"])
    tokens = case["n_sequences"] * cfg.seq_len
    features = activation_features(cfg, partition, case["chunk"], tokens=tokens, n_sequences=case["n_sequences"],
                                   dtype=dtype)
    return features, saved_bytes(cfg, partition, case["chunk"], n_sequences=case["n_sequences"], dtype=dtype)


def fit_units(*, n_cases: int = 60, seed: int = 0, progress=None) -> dict:
    """{"command", "features", "units": {variant/dtype: {"coefficients", "max_rel_error"}}, "in_sample"}."""
    torch.set_num_threads(1)
    units, in_sample = {}, []
    for residual, key_mode in VARIANTS:
        for dtype in ("fp32", "bf16"):
            rng = random.Random(f"{seed}/{residual}/{key_mode}/{dtype}")
            rows, targets = [], []
            for _ in range(n_cases):
                case = random_case(rng, residual, key_mode)
                features, measured = measure_case(case, dtype)
                rows.append([float(features[name]) for name in FEATURES])
                targets.append(float(measured))
                in_sample.append(_describe(case, dtype))
            a = torch.tensor(rows, dtype=torch.float64)
            b = torch.tensor(targets, dtype=torch.float64)
            # Columns scaled to unit norm so that the tiny constant features are not ignored.
            norms = a.norm(dim=0).clamp_min(1e-12)
            solution = torch.linalg.lstsq(a / norms, b.unsqueeze(1), driver="gelsd").solution.squeeze(1) / norms
            predicted = a @ solution
            key = units_key(case["cfg"], dtype)
            units[key] = {
                "coefficients": {name: round(float(v), 6) for name, v in zip(FEATURES, solution, strict=True)
                                 if abs(float(v)) > 1e-9},
                "max_rel_error": float(((predicted - b).abs() / b).max()),
            }
            if progress:
                progress(f"{key}: max in-sample error {units[key]['max_rel_error']:.2%}")
    return {"command": COMMAND, "torch": torch.__version__, "backend": "torch (CPU reference kernels)",
            "features": list(FEATURES), "units": units, "in_sample": in_sample}


def _describe(case: dict, dtype: str) -> str:
    cfg = case["cfg"]
    return (f"{cfg.residual}/{cfg.key_mode} {dtype} L={cfg.n_layers} d={cfg.d_model} H={cfg.n_heads} f={cfg.ff_dim} "
            f"T={cfg.seq_len} V={cfg.vocab_size} S={cfg.block_size} r={cfg.key_rank} P={case['n_stages']} "
            f"Vc={case['n_virtual']} chunk={case['chunk']} B={case['n_sequences']}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="fit the simulator's activation memory units")
    parser.add_argument("--out", required=True, help="the JSON to write (attnres_pp/simulator/memory_units.json)")
    parser.add_argument("--cases", type=int, default=60, help="tiny chunks measured per variant and dtype")
    args = parser.parse_args(argv)
    result = fit_units(n_cases=args.cases, progress=lambda line: print(line, file=sys.stderr))
    with open(args.out, "w") as handle:
        json.dump(result, handle, indent=1)
        handle.write("\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
