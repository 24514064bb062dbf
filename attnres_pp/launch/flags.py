"""The run's command-line flags, declared once for every command that launches ranks (`attnres-pp
train` and `generate`): one name, one help text and one field each. A command adds the flags it
takes by name (`add_run_flags`) with its own remark where the flag means more there, and reads the
given ones back (`run_values`); the model's flags are `model_flags`'.

Every flag is read as text and left None when not given, so the value comes from the layer below
(train's `--config` TOML or checkpoint, else the config's default), and a bad value is one `error:`
line naming the flag (`cli_flags.convert_flag`); the frozen configs check the ranges.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from attnres_pp.cli_flags import convert_flag
from attnres_pp.launch.resolve import DEVICES, DTYPES, FAULT_TOLERANCES, KERNELS
from attnres_pp.pipeline.config import AC_POLICIES as ACTIVATION_CHECKPOINTS
from attnres_pp.pipeline.config import (
    DP_SHARDS,
    LAUNCHERS,
    P2P_SEMANTICS,
    PLACEMENTS,
    RESHARD_AFTER_FORWARD,
    SCHEDULE_NAMES,
)


@dataclass(frozen=True)
class RunFlag:
    """`flag` fills `key` of the run config's `table` ("train" or "pipeline"), converted by `kind`."""

    flag: str
    table: str
    key: str
    kind: type
    help: str

    @property
    def dest(self) -> str:
        return self.flag[2:].replace("-", "_")


RUN_FLAGS = tuple(RunFlag(*entry) for entry in (
    ("--batch-size", "train", "batch_size", int, "global sequences per step"),
    ("--microbatches", "train", "microbatches", int, "microbatches per step (gradient accumulation)"),
    ("--steps", "train", "steps", int, "optimiser steps"),
    ("--lr", "train", "lr", float, "peak learning rate"),
    ("--warmup-steps", "train", "warmup_steps", int, "linear warmup steps"),
    ("--seed", "train", "seed", int, "seed for init and data"),
    ("--data", "train", "data", str, "'builtin' (stdlib source bytes), FILE.txt, FILE.bin "
     "(uint16 tokens) or a data folder of `attnres-pp prepare` (DIR with meta.json; sets --vocab-size)"),
    ("--eval-every", "train", "eval_every", int, "evaluate every k steps (0 = only at the end)"),
    ("--log-routing-every", "train", "log_routing_every", int,
     "every k steps add routing entropy and embedding weight per reading site to metrics.jsonl (0 = never)"),
    ("--threads", "train", "threads", int, "torch threads per process"),
    ("--keep-checkpoints", "train", "keep_checkpoints", int,
     "checkpoints kept: the newest K (default 2; 0 keeps all), and always the final one"),
    ("--device", "train", "device", str, f"{' | '.join(DEVICES)}: cuda gives every rank its own GPU (nccl), "
     "cpu uses gloo; auto picks cuda when every rank can have a GPU"),
    ("--dtype", "train", "dtype", str, f"{' | '.join(DTYPES)}: bf16 autocast over fp32 weights, with bf16 "
     "hops; auto: bf16 on cuda, fp32 on cpu"),
    ("--kernels", "train", "kernels", str, f"depth-attention backend: {' | '.join(KERNELS)} "
     "(auto: triton on cuda, torch on cpu)"),
    ("--activation-checkpoint", "train", "activation_checkpoint", str,
     f"{' | '.join(ACTIVATION_CHECKPOINTS)}: full recomputes each layer in its backward, selective keeps the "
     "projections and recomputes norms, softmax and depth-attention intermediates"),
    ("--stages", "pipeline", "stages", int, "pipeline stages P (ranks)"),
    ("--virtual", "pipeline", "virtual", int, "virtual stages V per rank"),
    ("--data-parallel", "pipeline", "data_parallel", int,
     "replicas D of the pipeline (D x P ranks; --batch-size stays the global batch)"),
    ("--schedule", "pipeline", "schedule", str, f"pipeline schedule: {' | '.join(SCHEDULE_NAMES)}"),
    ("--launcher", "pipeline", "launcher", str, f"how ranks start: {' | '.join(LAUNCHERS)} (local: one process "
     "per rank, or this process alone for one chunk)"),
    ("--timeout", "pipeline", "timeout_s", float, "pipeline timeout in seconds: every wait for a rank is bounded "
     "by it"),
    ("--placement", "pipeline", "placement", str,
     f"ray placement of the ranks: {' | '.join(PLACEMENTS)} (PACK or SPREAD for several nodes)"),
    ("--p2p-semantics", "pipeline", "p2p_semantics", str,
     f"point-to-point rules: {' | '.join(P2P_SEMANTICS)} (nccl: messages go out in the order proven under "
     "NCCL's in-order, rendezvous matching, enforced by the loopback under --launcher inprocess; auto: the "
     "process group's backend)"),
    ("--link-gbps", "pipeline", "link_gbps", float,
     "emulate a slow link between ranks on one host: its bandwidth in Gb/s (off by default)"),
    ("--link-latency-us", "pipeline", "link_latency_us", float, "the emulated link's latency in microseconds"),
    ("--dp-shard", "pipeline", "dp_shard", str,
     f"{' | '.join(DP_SHARDS)}: how the D replicas hold parameters, gradients and optimizer state"),
    ("--tensor-parallel", "pipeline", "tensor_parallel", int,
     "tensor-parallel ranks T per chunk, on one node (D x P x T ranks; default 1)"),
    ("--expert-parallel", "pipeline", "expert_parallel", int,
     "expert-parallel ranks EP per stage, taken along the data-parallel axis: each holds 1/EP of every MoE "
     "sublayer's routed experts, tokens reach them by all-to-all (EP divides D and --moe-experts; default 1)"),
    ("--fault-tolerance", "train", "fault_tolerance", str,
     f"{' | '.join(FAULT_TOLERANCES)}: replicas makes each of the D pipelines a torchft replica group that "
     "restarts alone and heals from a live one (needs the [ft] extra; docs/ray.md)"),
    ("--lighthouse", "train", "lighthouse", str,
     "--fault-tolerance replicas: the torchft Lighthouse URL to join (default: one started for the job)"),
    ("--min-replicas", "train", "min_replicas", int,
     "--fault-tolerance replicas: replica groups a step needs to commit (default 1; fewer wait, up to --timeout)"),
    ("--fsdp-reshard-after-forward", "pipeline", "fsdp_reshard_after_forward", str,
     f"{' | '.join(RESHARD_AFTER_FORWARD)} (--dp-shard fsdp only; default never)"),
))
_BY_FLAG = {entry.flag: entry for entry in RUN_FLAGS}


def run_flags(names: tuple[str, ...] | None = None) -> tuple[RunFlag, ...]:
    """The entries of RUN_FLAGS named (all of them for None), in the given order."""
    return RUN_FLAGS if names is None else tuple(_BY_FLAG[name] for name in names)


def add_run_flags(parser: argparse.ArgumentParser, names: tuple[str, ...] | None = None, *,
                  notes: dict[str, str] | None = None) -> None:
    """The flags `names` (all for None); `notes` appends a command's own remark to a flag's help."""
    notes = notes or {}
    for entry in run_flags(names):
        note = notes.get(entry.flag)
        # Parsed as strings and converted by `run_values`, so a bad value is one clear `error:` line.
        parser.add_argument(entry.flag, metavar=entry.key.upper(),
                            help=f"{entry.help}; {note}" if note else entry.help)


def run_values(args: argparse.Namespace, names: tuple[str, ...] | None = None) -> dict[str, dict]:
    """{table: {key: value}} of the flags `names` given on the command line; ValueError naming the flag."""
    values: dict[str, dict] = {}
    for entry in run_flags(names):
        raw = getattr(args, entry.dest, None)
        if raw is not None:
            values.setdefault(entry.table, {})[entry.key] = convert_flag(entry.flag, raw, entry.kind)
    return values
