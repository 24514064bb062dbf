"""The flags several `attnres-pp simulate` commands share: the argparse types of their counts and
rates (built on `attnres_pp.cli_flags`, so a bad value reads as every command's), the model's
shape flags of `comm` and `schedule` and the ModelConfig those flags describe (`memory` and `plan` take
train's own, `model_flags`)."""

from __future__ import annotations

import argparse
import dataclasses

from attnres_pp.cli_flags import number_type
from attnres_pp.model.config import KEY_MODES, MLPS, POSITIONS, RESIDUALS, ModelConfig
from attnres_pp.simulator.comm import DTYPE_BYTES

# argparse types of the counts: argparse names the flag in its refusal.
positive_int = number_type(int, bound="> 0")
non_negative_int = number_type(int, bound=">= 0")
D_FF_HELP = "MLP width (0 = the recipe's default: SwiGLU 64 x ceil(8 d / 3 / 64), GELU 4 d)"


def real(*, positive: bool, example: str):
    """argparse type: a finite number > 0 (`positive`) or >= 0; nan and inf would make every figure nan."""
    return number_type(float, bound="> 0" if positive else ">= 0", example=example)


def model_flags(parser: argparse.ArgumentParser, *, required: bool) -> None:
    """--layers, --block-size / --blocks, --residual and the widths of the model a command prices."""
    parser.add_argument("--layers", type=positive_int, required=required, default=None, help="transformer layers")
    parser.add_argument("--block-size", type=positive_int, default=None,
                        help="sublayers per block (1 = Full AttnRes)" + ("; this or --blocks is required" if required
                                                                         else ""))
    parser.add_argument("--blocks", type=positive_int, default=None,
                        help="number of blocks N instead of --block-size (block i ends after sublayer ceil(L i / N))")
    parser.add_argument("--residual", choices=RESIDUALS, default="attnres")
    parser.add_argument("--key-mode", choices=KEY_MODES, default="projected")
    parser.add_argument("--key-rank", type=positive_int, default=8, help="r of low-rank keys (lr_attnres)")
    parser.add_argument("--d-model", type=positive_int, default=4096)
    parser.add_argument("--d-ff", type=non_negative_int, default=0, help=D_FF_HELP)
    parser.add_argument("--heads", type=positive_int, default=None,
                        help="attention heads (read by --kv-heads, which must divide them, and by "
                             "--tensor-parallel: T must divide them; default unchecked)")
    add_recipe_flags(parser)
    parser.add_argument("--seq-len", type=positive_int, default=4096)
    parser.add_argument("--vocab-size", type=positive_int, default=32000)
    parser.add_argument("--tokens", type=positive_int, default=4096, help="tokens per microbatch")
    parser.add_argument("--dtype", choices=sorted(DTYPE_BYTES), default="bf16")


def add_recipe_flags(parser: argparse.ArgumentParser, *, kv_heads: bool = True) -> None:
    """The layer recipe (docs/spec.md section 11) as train's flags name it (`model_flags`): what it
    changes here is the FLOPs and the parameters of a layer (`simulator.layer_recipe`). `kv_heads`:
    also --kv-heads (a command whose number table declares it passes False)."""
    parser.add_argument("--positions", choices=POSITIONS, default="rope",
                        help="rope (rotary, default: no position table) or learned (a position table)")
    parser.add_argument("--mlp", choices=MLPS, default="swiglu",
                        help="swiglu (default: gate, up and down d x d_ff matrices) or gelu (up and down)")
    if kv_heads:
        parser.add_argument("--kv-heads", type=non_negative_int, default=0,
                            help="key/value heads, dividing --heads (0, default: as many as --heads)")
    parser.add_argument("--qk-norm", action="store_true", help="a per-head RMSNorm on q and k (default off)")
    parser.add_argument("--tie-embeddings", action="store_true",
                        help="the LM head reads the token embedding's matrix (default off)")


def recipe_fields(args: argparse.Namespace) -> dict:
    """ModelConfig's recipe fields of `add_recipe_flags`; ValueError if --kv-heads comes without --heads."""
    if args.kv_heads and getattr(args, "heads", 0) is None:
        raise ValueError(f"--kv-heads {args.kv_heads} needs --heads (the query heads it divides, which set the head "
                         "dimension)")
    return {"positions": args.positions, "mlp": args.mlp, "n_kv_heads": args.kv_heads, "qk_norm": args.qk_norm,
            "tie_embeddings": args.tie_embeddings}


def model_config(args: argparse.Namespace) -> ModelConfig:
    """The ModelConfig of `model_flags`; ValueError unless exactly one of --block-size and --blocks is given."""
    if (args.block_size is None) == (args.blocks is None):
        raise ValueError("give exactly one of --block-size S and --blocks N to place the blocks")
    # Heads change FLOPs and bytes only through grouped kv heads (--kv-heads, which needs them), and
    # one head divides every width; given, they are kept for --tensor-parallel's check too.
    recipe = recipe_fields(args)
    heads = getattr(args, "heads", None) or 1
    return ModelConfig(vocab_size=args.vocab_size, n_layers=args.layers, d_model=args.d_model, n_heads=heads,
                       d_ff=args.d_ff, seq_len=args.seq_len, residual=args.residual,
                       block_size=args.block_size or 1, blocks=args.blocks or 0, key_mode=args.key_mode,
                       key_rank=args.key_rank, **recipe)


def add_attention_kernel_flag(parser: argparse.ArgumentParser, *, default: str) -> None:
    """--attention-kernel: which saved tensors the activation term prices for attention."""
    from attnres_pp.simulator.memory import ATTENTION_KERNELS

    parser.add_argument("--attention-kernel", choices=ATTENTION_KERNELS, default=default,
                        help=f"flash (default {default}; what torch's fused kernels save, CPU and CUDA: the "
                             "fitted units) or math (SDPBackend.MATH: its fp32 H x T x T probabilities, derived)")


def add_tensor_parallel_flags(parser: argparse.ArgumentParser, *, link: bool = True, ranks: bool = False,
                              search: bool = False) -> None:
    """--tensor-parallel T, --sequence-parallel / --no-sequence-parallel (docs/spec.md section 10) and,
    with `link`, the intra-node link that prices the tp collectives and the node size that bounds T;
    with `ranks`, --ranks (checked to equal T x P x D). `search`: T left out is searched (simulate plan)."""
    from attnres_pp.simulator.tensor_parallel import INTRA_NODE_GBPS, INTRA_NODE_LATENCY_US, TP_SIZES

    parser.add_argument("--tensor-parallel", type=positive_int, default=None if search else 1, metavar="T",
                        help="T, tensor-parallel ranks per chunk, tp innermost in the (dp, pp, tp) mesh "
                             + (f"(default: search {', '.join(map(str, TP_SIZES))} within a node)" if search
                                else "(default 1)") + "; bytes as the tp runtime counts them, time derived")
    parser.add_argument("--sequence-parallel", action=argparse.BooleanOptionalAction, default=None,
                        help="shard the activations between layers along the sequence over tp (default on when "
                             "T > 1)")
    if link:
        parser.add_argument("--intra-node-gbps", type=real(positive=True, example="3600"), default=INTRA_NODE_GBPS,
                            help=f"link inside a node for the tp collectives, Gb/s per direction (default "
                                 f"{INTRA_NODE_GBPS:g} = 450 GB/s, NVLink 4 on H100 / H200)")
        parser.add_argument("--gpus-per-node", type=positive_int, default=8, help="GPUs per node (default 8)")
    parser.add_argument("--intra-node-latency-us", type=real(positive=False, example="2"),
                        default=INTRA_NODE_LATENCY_US,
                        help=f"latency of one ring step of a tp collective (default {INTRA_NODE_LATENCY_US:g})")
    if ranks:
        parser.add_argument("--ranks", type=positive_int, default=None,
                            help="all ranks, if given checked to equal T x P x D")


def tensor_parallel_from(args: argparse.Namespace, cfg: ModelConfig, *, tokens: int | None = None,
                         n_stages: int = 1, data_parallel: int = 1, gpus_per_node: int | None = None):
    """The TensorParallel the flags give, checked against the model, the node and the ranks (ValueError
    naming the rule broken)."""
    from attnres_pp.simulator.tensor_parallel import TensorParallel, check_tensor_parallel

    tp = TensorParallel(args.tensor_parallel, args.sequence_parallel)
    if getattr(args, "heads", 0) is None and tp.size > 1:  # simulate comm / schedule without --heads
        cfg = dataclasses.replace(cfg, n_heads=tp.size)
    node = gpus_per_node if gpus_per_node is not None else getattr(args, "gpus_per_node", None)
    check_tensor_parallel(cfg, tp, gpus_per_node=node, tokens=tokens, ranks=getattr(args, "ranks", None),
                          n_stages=n_stages, data_parallel=data_parallel)
    return tp
