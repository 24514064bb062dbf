"""TrainConfig (optimiser, schedule, data, evaluation) and RunConfig, the whole run:
model + train + pipeline, with TOML loading. Frozen and validated; TOML and CLI only fill them in."""

from __future__ import annotations

import dataclasses
import math
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from attnres_pp.comm.partition import make_partition, tied_copy_ranks
from attnres_pp.config_tables import from_table, to_table
from attnres_pp.launch.resolve import (
    DEVICES,
    DTYPES,
    FAULT_TOLERANCES,
    KERNELS,
    ResolvedRun,
    resolve_run,
    single_process,
)
from attnres_pp.model.config import ModelConfig
from attnres_pp.pipeline.config import AC_POLICIES as ACTIVATION_CHECKPOINTS
from attnres_pp.pipeline.config import PipelineConfig
from attnres_pp.schedule.schedules import SIZE_CHECKS, schedule_placement


def _fail(field_name: str, value, fix: str) -> None:
    raise ValueError(f"TrainConfig.{field_name}={value!r} is invalid: {fix}")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """How to train. `batch_size` is the global number of sequences per step; it is split into
    `microbatches` equal microbatches (gradient accumulation, or the pipeline's microbatches)."""

    # The defaults train the default tiny model in about 45 s on 2 CPU cores (configs/tiny.toml).
    steps: int = 500
    batch_size: int = 32
    microbatches: int = 2
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 30
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    eval_every: int = 100
    eval_batches: int = 4
    log_routing_every: int = 0  # k > 0: routing entropy and embedding weight per site every k steps
    seed: int = 0
    data: str = "builtin"
    threads: int = 1
    # Checkpoints kept in the run directory: the newest `keep_checkpoints` (0 keeps all), and always
    # the one written at a run's last step (`train.checkpoint.prune_checkpoints`).
    keep_checkpoints: int = 2
    # Where and how the model computes; "auto" is resolved by the launch layer (`launch.resolve`) once it
    # knows the device: cuda if every rank can have its own GPU, bf16 and the Triton kernels there,
    # else cpu, fp32 and the torch kernels. summary.json records the resolved values.
    device: str = "auto"
    dtype: str = "auto"
    kernels: str = "auto"
    compile: bool = False  # torch.compile each sublayer and its depth read (single-process runs)
    activation_checkpoint: str = "none"
    # Per-step fault tolerance across the D replicas (`train.fault_tolerance`, torchft): the
    # Lighthouse to join ("" starts one per job) and the replica groups a step needs to commit.
    fault_tolerance: str = "off"
    lighthouse: str = ""
    min_replicas: int = 1

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "microbatches", "eval_batches", "threads"):
            value = getattr(self, name)
            if not _is_int(value) or value < 1:
                _fail(name, value, "must be an integer >= 1")
        for name, hint in (("warmup_steps", ""), ("eval_every", " (0 = evaluate only at the end)"), ("seed", ""),
                           ("keep_checkpoints", " (the newest checkpoints kept; 0 keeps every one)"),
                           ("log_routing_every", " (0 = never)")):
            value = getattr(self, name)
            if not _is_int(value) or value < 0:
                _fail(name, value, "must be an integer >= 0" + hint)
        if self.batch_size % self.microbatches:
            _fail("batch_size", self.batch_size,
                  f"must be divisible by microbatches={self.microbatches}; "
                  f"use a multiple such as {self.microbatches * max(1, self.batch_size // self.microbatches)}")
        if not _is_real(self.lr) or self.lr <= 0:
            _fail("lr", self.lr, "must be a finite number > 0, e.g. 3e-3")
        if not _is_real(self.min_lr_ratio) or not 0 <= self.min_lr_ratio <= 1:
            _fail("min_lr_ratio", self.min_lr_ratio, "must be in [0, 1] (the cosine floor as a fraction of lr)")
        if not _is_real(self.weight_decay) or self.weight_decay < 0:
            _fail("weight_decay", self.weight_decay, "must be >= 0")
        for name in ("beta1", "beta2"):
            value = getattr(self, name)
            if not _is_real(value) or not 0 <= value < 1:
                _fail(name, value, "must be in [0, 1), e.g. 0.9 or 0.95")
        if not _is_real(self.grad_clip) or self.grad_clip < 0:
            _fail("grad_clip", self.grad_clip, "must be >= 0 (0 disables clipping)")
        for name, choices, hint in (
            ("device", DEVICES, "cuda: one GPU per rank (nccl); cpu: gloo; auto: cuda when every rank gets a GPU"),
            ("dtype", DTYPES, "bf16: autocast compute with fp32 master weights; auto: bf16 on cuda, fp32 on cpu"),
            ("kernels", KERNELS, "the depth-attention backend; auto: triton on cuda, torch on cpu"),
            ("activation_checkpoint", ACTIVATION_CHECKPOINTS,
             "full: recompute each layer in its backward; selective: keep the projections, recompute the rest"),
            ("fault_tolerance", FAULT_TOLERANCES,
             "replicas: the D pipelines are torchft replica groups, a lost one restarts alone"),
        ):
            if getattr(self, name) not in choices:
                _fail(name, getattr(self, name), f"choose one of {', '.join(choices)} ({hint})")
        if not _is_int(self.min_replicas) or self.min_replicas < 1:
            _fail("min_replicas", self.min_replicas, "must be an integer >= 1 (replica groups a step needs)")
        if not isinstance(self.lighthouse, str):
            _fail("lighthouse", self.lighthouse, "give the Lighthouse's URL, e.g. http://host:29510 ('' starts one)")
        if not isinstance(self.compile, bool):
            _fail("compile", self.compile, "must be true or false")
        if not isinstance(self.data, str) or not self.data:
            _fail("data", self.data, "use 'builtin', a path to a .txt or .bin file, or a data folder")

    @property
    def microbatch_size(self) -> int:
        return self.batch_size // self.microbatches

    def decided(self, run: ResolvedRun) -> TrainConfig:
        """This config with the device, dtype and kernels the launch layer decided (`launch.resolve`)."""
        return dataclasses.replace(self, device=run.device, dtype=run.dtype, kernels=run.kernels)

    @classmethod
    def from_dict(cls, values: dict) -> TrainConfig:
        return from_table(cls, values, table="train")

    def to_dict(self) -> dict:
        return to_table(self)


SECTIONS = ("model", "train", "pipeline")


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    """One run: what to train (`model`), how (`train`) and where (`pipeline`)."""

    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)

    def __post_init__(self) -> None:
        for name, kind in (("model", ModelConfig), ("train", TrainConfig), ("pipeline", PipelineConfig)):
            if not isinstance(getattr(self, name), kind):
                raise ValueError(f"RunConfig.{name} must be a {kind.__name__}, got {type(getattr(self, name))}")
        replicas, m = self.pipeline.data_parallel, self.train.microbatches
        if self.train.batch_size % (replicas * m):
            raise ValueError(
                f"TrainConfig.batch_size={self.train.batch_size} is invalid: the global batch is split over "
                f"data_parallel={replicas} replicas of microbatches={m} microbatches each, so it must be a "
                f"multiple of {replicas * m}, e.g. {replicas * m * max(1, self.train.batch_size // (replicas * m))}"
            )
        if self.train.compile and not single_process(self.pipeline):
            raise ValueError(
                "TrainConfig.compile=True is invalid for a pipelined run: --compile compiles the single-process "
                "model only (stages = virtual = data_parallel = 1, launcher local); pipeline chunks run eager, "
                "and a split-backward schedule's W could not be cut apart from I inside a compiled region's one "
                "backward node; drop --compile or train in one process"
            )
        check_sizes = SIZE_CHECKS.get(self.pipeline.schedule)
        if check_sizes is not None:  # one error line before any rank starts, not one per rank
            check_sizes(self.pipeline.stages, self.pipeline.virtual, m)
        self.model.check_tensor_split(self.pipeline.tensor_parallel, sequence_parallel=self.pipeline.sp)
        check_tied_copies(self.model, self.train, self.pipeline)
        check_fault_tolerance(self.train, self.pipeline)
        check_experts(self.model, self.pipeline, self.train)
        if self.pipeline.layer_counts is not None and sum(self.pipeline.layer_counts) != self.model.n_layers:
            raise ValueError(
                f"PipelineConfig.layer_counts={list(self.pipeline.layer_counts)} is invalid: the counts must "
                f"sum to ModelConfig.n_layers={self.model.n_layers}"
            )

    @property
    def microbatch_size(self) -> int:
        """Sequences per microbatch: the global batch over D replicas x m microbatches."""
        return self.train.batch_size // (self.pipeline.data_parallel * self.train.microbatches)

    @property
    def eval_microbatches(self) -> int:
        """Microbatches an evaluation batch is cut into: the training's m, but one when a lone rank holds
        the whole model (the one-process run): it has no pipeline to fill, so one pass over the batch
        costs least and gives the whole model's own mean loss."""
        return 1 if self.pipeline.is_single_process else self.train.microbatches

    @classmethod
    def from_dict(cls, values: dict) -> RunConfig:
        """Build from `{"model": {...}, "train": {...}, "pipeline": {...}}`; missing tables or keys
        take the defaults, unknown ones raise ValueError listing the known ones."""
        unknown = sorted(set(values) - set(SECTIONS))
        if unknown:
            raise ValueError(f"unknown config tables {unknown}; known tables: {list(SECTIONS)}")
        for name in SECTIONS:
            if not isinstance(values.get(name, {}), dict):
                raise ValueError(f"config [{name}] must be a table of keys, got {values[name]!r}")
        return cls(
            model=ModelConfig.from_dict(values.get("model", {})),
            train=TrainConfig.from_dict(values.get("train", {})),
            pipeline=PipelineConfig.from_dict(values.get("pipeline", {})),
        )

    def to_dict(self) -> dict:
        return {"model": self.model.to_dict(), "train": self.train.to_dict(), "pipeline": self.pipeline.to_dict()}

    @classmethod
    def from_toml(cls, path: str | Path, overrides: dict | None = None) -> RunConfig:
        """Load a TOML file with tables [model], [train], [pipeline]; `overrides` (same shape)
        wins over the file, the file wins over the defaults."""
        return cls.from_dict(merge_tables(read_toml(path), overrides or {}))


def resolve_training(run_cfg: RunConfig, *, gpus: int, where: str = "on this node") -> tuple[RunConfig, ResolvedRun]:
    """(`run_cfg` with train's device, dtype and kernels as the launch layer decides them against
    `gpus` GPUs `where` the ranks run, that decision): what the engine starts and summary.json records."""
    train = run_cfg.train
    run = resolve_run(run_cfg.pipeline, device=train.device, dtype=train.dtype, kernels=train.kernels, gpus=gpus,
                      where=where, fault_tolerance=train.fault_tolerance)
    return dataclasses.replace(run_cfg, train=train.decided(run)), run


def check_experts(cfg: ModelConfig, pipe: PipelineConfig, train: TrainConfig) -> None:
    """ValueError for an MoE or expert-parallel setting this run cannot use (docs/spec.md section 12):
    EP ranks share the E routed experts of a stage, E / EP each (`pipeline.expert_parallel`)."""
    ep = pipe.expert_parallel
    if cfg.moe and pipe.sp and cfg.moe_balance == "aux_loss":
        raise ValueError(f"--moe-balance aux_loss with --tensor-parallel {pipe.tensor_parallel} under sequence "
                         "parallelism is not supported: each tp rank would balance its own shard of the tokens, "
                         "not the microbatch's; use --no-sequence-parallel, or --moe-balance aux_free")
    if cfg.moe and pipe.sp and cfg.moe_seq_aux_coef > 0:
        raise ValueError(f"--moe-seq-aux-coef with --tensor-parallel {pipe.tensor_parallel} under sequence "
                         "parallelism is not supported: each tp rank holds a shard of every sequence, and the "
                         "loss is per whole sequence; use --no-sequence-parallel, or --moe-seq-aux-coef 0")
    if ep == 1:
        return
    if not cfg.moe:
        raise ValueError(f"--expert-parallel {ep} needs a mixture-of-experts model: give --moe-experts E "
                         "(a multiple of EP), or drop --expert-parallel")
    if cfg.moe_experts % ep:
        raise ValueError(f"--expert-parallel {ep} does not divide --moe-experts {cfg.moe_experts}: each EP rank "
                         "holds E / EP routed experts; choose EP dividing E")
    if train.fault_tolerance != "off":
        raise ValueError(f"--fault-tolerance {train.fault_tolerance} with --expert-parallel {ep} is not supported: "
                         "an expert-parallel group spans replicas, so a lost replica takes experts its peers "
                         "need; use --expert-parallel 1")


def check_tied_copies(model: ModelConfig, train: TrainConfig, pipe: PipelineConfig) -> None:
    """ValueError for tied embeddings whose two copies (the embedding on the first pipeline rank, the
    LM head on the last: `comm.partition.tied_copy_ranks`) a part of this run would not keep equal:
    replica groups (`train.ft_worker` syncs its own gradients, without the embedding group)."""
    if not model.tie_embeddings or pipe.stages == 1:
        return
    partition = make_partition(model.n_layers, pipe.stages, pipe.virtual, pipe.layer_counts,
                               placement=schedule_placement(pipe.schedule))
    if tied_copy_ranks(True, partition) and train.fault_tolerance != "off":
        raise ValueError("--tie-embeddings with --fault-tolerance replicas needs the embedding and the LM head on one "
                         "pipeline rank: use --stages 1 or a V-shaped schedule (zbv, dualpipev, v_half, v_min), or "
                         "drop one of the two flags")


def check_fault_tolerance(train: TrainConfig, pipe: PipelineConfig) -> None:
    """ValueError for a fault-tolerance setting this run cannot use: replica groups need D >= 2
    replicated pipelines (each of P x T ranks: P stages, each chunk shared by T tensor-parallel
    ranks) on the cpu, as local processes or Ray actors (under any placement at T = 1; a T > 1 run
    is held to what tensor parallelism runs under, `launch.resolve.check_tensor_parallel`)
    (`train.ft_replicas`)."""
    if train.fault_tolerance == "off":
        if train.lighthouse or train.min_replicas != 1:
            flag = "--lighthouse" if train.lighthouse else "--min-replicas"
            raise ValueError(f"{flag} is for --fault-tolerance replicas: add it, or drop {flag}")
        return
    d = pipe.data_parallel
    refusal = None
    if d < 2:
        refusal = (f"--data-parallel {d}: replica groups are the D pipelines, so a lost one needs another to go on; "
                   "give --data-parallel 2 or more")
    elif pipe.launcher == "inprocess":
        refusal = "--launcher inprocess (a replica group restarts as processes of its own): use --launcher local or ray"
    elif pipe.dp_shard != "replicate":
        refusal = (f"--dp-shard {pipe.dp_shard} (FSDP over the D replicas would shard each replica's state across "
                   "the replica groups, so a lost group takes shards that no live group holds and nothing could heal "
                   "it; sharding within a group, as HSDP does, would need a shard axis inside each group): "
                   "use --dp-shard replicate")
    elif train.device == "cuda":
        refusal = ("--device cuda (replica groups reduce over torchft's gloo process group so far): "
                   "use --device cpu")
    elif train.min_replicas > d:
        refusal = f"--min-replicas {train.min_replicas} above --data-parallel {d}: no step could ever commit"
    if refusal is not None:
        raise ValueError(f"--fault-tolerance replicas does not support {refusal}")


def read_toml(path: str | Path) -> dict:
    """The TOML file as a dict; ValueError (not a traceback) for a missing or malformed file."""
    path = Path(path)
    try:
        with path.open("rb") as handle:
            return tomllib.load(handle)
    except FileNotFoundError:
        raise ValueError(f"config file {str(path)!r} not found; check the --config path") from None
    except OSError as error:  # a directory, or a file this user may not read
        raise ValueError(f"config file {str(path)!r} cannot be read ({error.strerror}): give the path of a "
                         ".toml file to --config") from None
    except tomllib.TOMLDecodeError as error:
        raise ValueError(f"config file {str(path)!r} is not valid TOML: {error}") from None
    except UnicodeDecodeError as error:  # TOML is UTF-8; tomllib's own message names neither file nor fix
        raise ValueError(f"config file {str(path)!r} is not UTF-8 text (byte {error.object[error.start]:#04x} at "
                         f"offset {error.start}): save it as UTF-8") from None


def merge_tables(base: dict, overrides: dict) -> dict:
    """`base` with each table's keys replaced by those in `overrides` (one level deep)."""
    merged = {name: dict(table) if isinstance(table, dict) else table for name, table in base.items()}
    for name, table in overrides.items():
        if isinstance(table, dict) and isinstance(merged.get(name, {}), dict):
            merged[name] = {**merged.get(name, {}), **table}
        else:
            merged[name] = table
    return merged
