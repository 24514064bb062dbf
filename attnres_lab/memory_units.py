"""Measure what a chunk saves for backward and fit the simulator's activation units
(`attnres_pp/simulator/memory_units.json`, read by `simulator.memory`).

`saved_bytes` runs one chunk's forward, as the runtime feeds it (received and cached sources as
fresh leaves that require grad), under `torch.autograd.graph.saved_tensors_hooks` and counts every
storage saved for backward once, parameters' own storages excluded (they are `param_bytes`; the
bf16 copies autocast makes of them are counted). `fit_units` least-squares fits, per variant and
dtype, the bytes to the shape features of `simulator.memory.activation_features` over a seeded
grid of tiny models, partitions and chunks (the in-sample set, listed in the JSON).

    attnres-lab fit-memory-units --out attnres_pp/simulator/memory_units.json
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
from attnres_pp.simulator.memory import (
    CHECKPOINT_FEATURES,
    CHECKPOINT_TARGETS,
    FEATURES,
    activation_features,
    checkpoint_features,
    units_key,
)

VARIANTS = (("standard", "projected"), ("attnres", "projected"), ("lr_attnres", "projected"),
            ("lr_attnres", "sliced"), ("msar", "projected"))
COMMAND = "attnres-lab fit-memory-units --out attnres_pp/simulator/memory_units.json"
# The units are fitted on the tiny grid of `random_case` (d_model <= 48, seq_len <= 24, vocab <= 80,
# <= 6 layers; the cases are listed in the JSON) and checked on configurations outside it:
OUT_OF_SAMPLE = ("tests/unit/test_sim_memory.py: another seed, every size doubled (d_model up to 96, seq_len up to "
                 "48); "
                 "attnres_lab.memory_predict CASES: whole pipelined steps of an 8-layer d_model 64, seq_len 32, "
                 "vocab 256 model (other schedules, V, m, D, fsdp, block sizes), against the runtime's count")


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


def checkpoint_bytes(cfg: ModelConfig, partition, chunk_index: int, *, n_sequences: int, dtype: str, policy: str,
                     cache: bool = True, seed: int = 0) -> dict[str, int]:
    """One microbatch of chunk `chunk_index` under activation checkpointing `policy`, as the runtime
    runs it (`PipelineChunk` with the policy, the rank's `ActivationMeter`, the B / I / W of
    `pipeline.split_backward` on the loss or the produced tensors it sends or caches), counted by the
    meter: {"saved": live after F, "transient": peak inside B above that, "input_transient": what the
    peak inside I exceeds both saved + transient and the store by, "input_kept": live after I, the
    W store (`pipeline.weight_store`: I frees the graph; 0, 0 for chunk 0, whose I has no inputs)}."""
    from attnres_pp.pipeline.memory_meter import ActivationMeter
    from attnres_pp.pipeline.split_backward import fused_backward
    from attnres_pp.pipeline.weight_store import drain_weight_store, stash_backward_input

    plan = plan_for_model(cfg, partition, cache)
    precision = "bf16" if dtype == "bf16" else "fp32"
    model, chunks = build_rank_model(cfg, partition, partition.rank_of(chunk_index), seed=seed, precision=precision,
                                     activation_checkpoint=policy)
    chunk, io = chunks[chunk_index], plan.chunks[chunk_index]
    act_dtype = torch.bfloat16 if dtype == "bf16" else torch.float32
    result = {}
    for split in (False, True):
        if split and chunk.is_first:
            result.update(input_transient=0, input_kept=0)
            break
        generator = torch.Generator().manual_seed(seed)
        inputs = {s: torch.randn(n_sequences, cfg.seq_len, cfg.d_model if s.kind == "residual" else cfg.source_width,
                                 generator=generator).to(act_dtype).requires_grad_(True)
                  for s in io.received + io.cache_reads}
        idx = torch.randint(0, cfg.vocab_size, (n_sequences, cfg.seq_len), generator=generator)
        meter = ActivationMeter()
        meter.set_excluded(p for c in chunks.values() for p in c.parameters())
        produced, loss = chunk(dict(inputs), idx if chunk.is_first else None, idx if chunk.is_last else None,
                               meter=meter)
        saved = meter.live_bytes
        if loss is not None:
            roots, grads = [loss], [torch.ones_like(loss)]
        else:
            roots = [t for s, t in produced.items() if (s in io.sent or s in io.cache_puts) and t.grad_fn is not None]
            grads = [torch.randn(t.shape, generator=generator).to(t.dtype) for t in roots]
        del produced, loss
        meter.reset_peak()
        if not split:
            fused_backward(roots, grads)
            result.update(saved=saved, transient=meter.peak_bytes - saved)
            del roots, grads
            continue
        leaves = [t for t in inputs.values() if t.requires_grad]
        store = stash_backward_input(roots, grads, leaves, None, chunk_index, meter)
        del roots, grads
        # I peaks early (as B: saved + transient), late (the whole store) or in between (the store
        # partly built beside a layer's depth-read gradients): `input_transient` is what the peak
        # exceeds the larger of the first two by, so each of the three is a linear form of its own.
        kept = meter.live_bytes
        result.update(input_transient=max(0, meter.peak_bytes - max(saved + result["transient"], kept)),
                      input_kept=kept)
        drain_weight_store(store)
        del store
    return result


def random_case(rng: random.Random, residual: str, key_mode: str, *, scale: int = 1) -> dict:
    """A tiny model, partition and chunk drawn from `rng` (`scale` widens every size for held-out
    cases), with a layer recipe drawn too (docs/spec.md section 11): rotary or learned positions,
    SwiGLU or GELU, grouped kv heads or not, QK-norm or not, and tied embeddings where the split
    keeps the embedding and the head on one rank."""
    d = rng.choice((16, 24, 32, 48)) * scale
    n_layers = rng.choice((2, 3, 4, 6))
    n_stages, n_virtual = rng.choice(((1, 1), (2, 1), (2, 2), (3, 1), (1, 2)))
    while n_stages * n_virtual > n_layers:
        n_stages, n_virtual = 1, 1
    n_heads = rng.choice((1, 2, 4))
    recipe = {"positions": rng.choice(("rope", "learned")), "mlp": rng.choice(("swiglu", "gelu")),
              "n_kv_heads": rng.choice([0] + [g for g in (1, 2) if n_heads % g == 0 and g < n_heads]),
              "qk_norm": rng.random() < 0.5, "tie_embeddings": n_stages == 1 and rng.random() < 0.5}
    cfg = ModelConfig(vocab_size=rng.choice((32, 48, 80)) * scale, n_layers=n_layers, d_model=d,
                      n_heads=n_heads, d_ff=rng.choice((0, 3 * d, 2 * d + 8)),
                      seq_len=rng.choice((8, 12, 16, 24)) * scale, residual=residual,
                      block_size=rng.randint(1, 2 * n_layers), key_mode=key_mode, key_rank=rng.choice((4, 8)),
                      **recipe)
    return {"cfg": cfg, "n_stages": n_stages, "n_virtual": n_virtual,
            "chunk": rng.randrange(n_stages * n_virtual), "n_sequences": rng.choice((1, 2, 3))}


def measure_case(case: dict, dtype: str) -> tuple[dict[str, float], int]:
    cfg = case["cfg"]
    partition = make_partition(cfg.n_layers, case["n_stages"], case["n_virtual"])
    tokens = case["n_sequences"] * cfg.seq_len
    features = activation_features(cfg, partition, case["chunk"], tokens=tokens, n_sequences=case["n_sequences"],
                                   dtype=dtype)
    return features, saved_bytes(cfg, partition, case["chunk"], n_sequences=case["n_sequences"], dtype=dtype)


def _lstsq(rows: list[list[float]], targets: list[float], scale: list[float] | None = None, *,
           relative: bool = False) -> tuple[torch.Tensor, float]:
    """(coefficients, max in-sample error) of the least-squares fit of targets to rows; the error of
    a case is relative to its `scale` (default: the target itself). `relative`: minimise the squared
    relative errors (each row weighted by 1 / target), the measure the units are held to, rather
    than the absolute ones, which let the largest chunks of the grid decide the fit."""
    a = torch.tensor(rows, dtype=torch.float64)
    b = torch.tensor(targets, dtype=torch.float64)
    weight = 1 / b.clamp_min(1.0) if relative else torch.ones_like(b)
    # Columns scaled to unit norm so that the tiny constant features are not ignored.
    norms = (a * weight[:, None]).norm(dim=0).clamp_min(1e-12)
    solution = torch.linalg.lstsq(a * weight[:, None] / norms, (b * weight).unsqueeze(1),
                                  driver="gelsd").solution.squeeze(1) / norms
    predicted = (a @ solution).clamp_min(0)
    reference = b if scale is None else torch.tensor(scale, dtype=torch.float64)
    return solution, float(((predicted - b).abs() / reference.clamp_min(1.0)).max())


def _coefficients(names, solution: torch.Tensor) -> dict[str, float]:
    return {name: round(float(v), 6) for name, v in zip(names, solution, strict=True) if abs(float(v)) > 1e-9}


def fit_units(*, n_cases: int = 80, n_checkpoint_cases: int = 200, seed: int = 0, progress=None) -> dict:
    """{"command", "features", "units": {variant/dtype: {"coefficients", "max_rel_error"}},
    "checkpoint_features", "checkpoint_units": {policy/variant/dtype: {"coefficients": {target: ...},
    "max_rel_error": {target: ...}}}, "in_sample", "out_of_sample"}."""
    torch.set_num_threads(1)
    units, checkpoint_units, in_sample = {}, {}, []
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
            solution, error = _lstsq(rows, targets, relative=True)
            key = units_key(case["cfg"], dtype)
            units[key] = {"coefficients": _coefficients(FEATURES, solution), "max_rel_error": error}
            if progress:
                progress(f"{key}: max in-sample error {error:.2%}")
            for policy in ("full", "selective"):
                checkpoint_units[f"{policy}/{key}"] = fit_checkpoint(
                    residual, key_mode, dtype, policy, n_cases=n_checkpoint_cases, seed=seed, in_sample=in_sample)
                if progress:
                    errors = checkpoint_units[f"{policy}/{key}"]["max_rel_error"]
                    progress(f"{policy}/{key}: max in-sample errors "
                             + ", ".join(f"{target} {e:.2%}" for target, e in errors.items()))
    return {"command": COMMAND, "torch": torch.__version__, "backend": "torch (CPU reference kernels)",
            "features": list(FEATURES), "units": units, "checkpoint_features": list(CHECKPOINT_FEATURES),
            "checkpoint_units": checkpoint_units, "in_sample": in_sample, "out_of_sample": OUT_OF_SAMPLE}


def fit_checkpoint(residual: str, key_mode: str, dtype: str, policy: str, *, n_cases: int, seed: int = 0,
                   in_sample: list | None = None) -> dict:
    """The units of one variant, dtype and checkpointing policy: one linear form per target of
    `checkpoint_bytes` (the I targets over the cases of chunks after the first only); max_rel_error
    per target relative to the case's saved + max(transient, input_kept)."""
    rng = random.Random(f"{seed}/{policy}/{residual}/{key_mode}/{dtype}")
    rows, measured = [], []
    for _ in range(n_cases):
        case = random_case(rng, residual, key_mode)
        cfg = case["cfg"]
        n_chunks = case["n_stages"] * case["n_virtual"]
        if n_chunks > 1 and rng.random() < 0.5:  # more chunks with inputs: the I targets are fitted on them
            case["chunk"] = rng.randrange(1, n_chunks)
        partition = make_partition(cfg.n_layers, case["n_stages"], case["n_virtual"])
        features = checkpoint_features(cfg, partition, case["chunk"], tokens=case["n_sequences"] * cfg.seq_len,
                                       n_sequences=case["n_sequences"], dtype=dtype)
        rows.append([float(features[name]) for name in CHECKPOINT_FEATURES])
        measured.append((case["chunk"], checkpoint_bytes(cfg, partition, case["chunk"],
                                                         n_sequences=case["n_sequences"], dtype=dtype, policy=policy)))
        if in_sample is not None:
            in_sample.append(f"{policy} " + _describe(case, dtype))
    coefficients, errors = {}, {}
    for target in CHECKPOINT_TARGETS:
        use = [i for i, (chunk, _m) in enumerate(measured) if chunk > 0 or not target.startswith("input")]
        # A B recomputes one layer at a time (the last first); F keeps, and I leaves in the W store,
        # something of every layer: each target gets only the columns of its own structure.
        # I's excess over B's peak and the store mixes the last layer's recomputation with the part
        # of the store built by then: both forms.
        prefixes = {"transient": ("out_", "last_"), "input_transient": ("out_", "all_", "last_")}
        names = [n for n in CHECKPOINT_FEATURES if n.startswith(prefixes.get(target, ("out_", "all_")))]
        columns = [CHECKPOINT_FEATURES.index(n) for n in names]
        # Errors relative to the most the chunk's microbatch holds (what the step's peak is made of):
        # a few bytes kept by a checkpointed forward are no error worth a percentage of their own.
        most = [float(measured[i][1]["saved"] + max(measured[i][1]["transient"], measured[i][1]["input_kept"]))
                for i in use]
        solution, errors[target] = _lstsq([[rows[i][j] for j in columns] for i in use],
                                          [float(measured[i][1][target]) for i in use], most)
        coefficients[target] = _coefficients(names, solution)
    return {"coefficients": coefficients, "max_rel_error": errors}


def _describe(case: dict, dtype: str) -> str:
    cfg = case["cfg"]
    return (f"{cfg.residual}/{cfg.key_mode} {dtype} L={cfg.n_layers} d={cfg.d_model} H={cfg.n_heads} f={cfg.ff_dim} "
            f"T={cfg.seq_len} V={cfg.vocab_size} S={cfg.block_size} r={cfg.key_rank} P={case['n_stages']} "
            f"Vc={case['n_virtual']} chunk={case['chunk']} B={case['n_sequences']} {cfg.positions} {cfg.mlp} "
            f"G={cfg.kv_heads}{' qk-norm' if cfg.qk_norm else ''}{' tied' if cfg.tie_embeddings else ''}")


def run_fit(args: argparse.Namespace) -> int:
    """`attnres-lab fit-memory-units`: fit the units and write them to --out."""
    if args.cases < 1 or args.checkpoint_cases < 1:
        print("error: --cases and --checkpoint-cases must be >= 1", file=sys.stderr)
        return 2
    result = fit_units(n_cases=args.cases, n_checkpoint_cases=args.checkpoint_cases,
                       progress=lambda line: print(line, file=sys.stderr))
    with open(args.out, "w") as handle:
        json.dump(result, handle, indent=1)
        handle.write("\n")
    print(f"wrote {args.out}")
    return 0
