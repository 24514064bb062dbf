"""One rank's part of a checkpoint, written and read with torch.distributed.checkpoint (DCP).

A checkpoint's state dict is flat and keyed by the whole model's names, whatever the split:
    "<parameter name>"                  the parameter, e.g. "layers.3.mlp.up.weight"
    "optim.<parameter name>.<key>"      its AdamW state: step, exp_avg, exp_avg_sq
    "rng.<stream>" (".cuda")            the RNG state of the rank that feeds <stream> (`rng_stream`)
Every rank saves what it holds; DCP deduplicates the copies that replicas (and MSAR's tied convs on
every rank) hold, so each key is written once, by one rank, into that rank's own file. A rank loads
exactly the keys of the parameters it holds, so a checkpoint loads into any launcher and any split
(stages, virtual stages, data parallelism, layer counts): DCP reads each tensor from whichever
file has it. Only a changed model cannot load (names or shapes differ; the error says so).
A rank's RNG state belongs to what it holds, not to its global rank: the stream is named by the
rank's data-parallel replica and the layers of its chunks (`dp1.layers0:2,4:6`). A resume at
another split restores the state of every stream that exists in both splits (same replica, same
layers); a rank whose stream the checkpoint lacks keeps the state its seed gave it, and says so.

Loading never unpickles arbitrary objects: tensors are read with torch.load(weights_only=True) by
DCP itself, and the `.metadata` file, which DCP reads with plain pickle, is read here through
`metadata_pickle`, which admits an exact list of DCP's metadata classes, torch's dtypes and sizes,
and refuses every other name, every dotted name and every call to anything else.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from attnres_pp.train.metadata_pickle import load_metadata


def rng_stream(dp_rank: int, layer_ranges: list[range]) -> str:
    """The RNG stream of a rank: its replica and the layers it holds, consecutive chunks' layers
    merged (`dp0.layers0:4` for the whole model in one process or one rank of P = 1)."""
    runs: list[list[int]] = []
    for layers in sorted(layer_ranges, key=lambda r: r.start):
        if runs and runs[-1][1] == layers.start:
            runs[-1][1] = layers.stop
        else:
            runs.append([layers.start, layers.stop])
    return f"dp{dp_rank}.layers" + ",".join(f"{start}:{stop}" for start, stop in runs)


def rng_keys(stream: str) -> tuple[str, str]:
    return f"rng.{stream}", f"rng.{stream}.cuda"


def shard_state(params: dict[str, torch.nn.Parameter], optimizer: torch.optim.Optimizer, stream: str) -> dict:
    """What a rank saves: its parameters, their optimizer state and the RNG states of its `stream`."""
    state: dict[str, torch.Tensor] = {name: p.detach() for name, p in params.items()}
    for name, p in params.items():
        for key, value in optimizer.state.get(p, {}).items():
            state[f"optim.{name}.{key}"] = value.detach() if torch.is_tensor(value) else torch.tensor(value)
    cpu_key, cuda_key = rng_keys(stream)
    state[cpu_key] = torch.get_rng_state()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state[cuda_key] = torch.cuda.get_rng_state()
    return state


def save_shard(step_dir: str | Path, state: dict, *, distributed: bool) -> None:
    """Write `state` into the checkpoint folder `step_dir`. `distributed`: every rank of the default
    process group calls this together (DCP's collective save); otherwise this process writes alone."""
    with warnings.catch_warnings():
        # Without a process group DCP warns that it assumes one process: that is the intent here.
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(state, checkpoint_id=str(step_dir), no_dist=not distributed)


class SafeReader(FileSystemReader):
    """DCP's file reader, with the metadata read by `metadata_pickle.load_metadata` (exact names, no
    calls but the admitted ones) instead of plain pickle."""

    def read_metadata(self, *args, **kwargs) -> Metadata:
        path = Path(self.path) / ".metadata"
        if not path.is_file():
            raise ValueError(f"checkpoint {self.path} has no .metadata: it is not a checkpoint of this format")
        metadata = load_metadata(path)
        if getattr(metadata, "storage_meta", None) is not None:
            metadata.storage_meta.load_id = self.load_id
        return metadata


def checkpoint_tensors(step_dir: str | Path) -> dict[str, TensorStorageMetadata]:
    """Every tensor a checkpoint holds: key -> its metadata (size, dtype)."""
    return {key: md for key, md in SafeReader(str(step_dir)).read_metadata().state_dict_metadata.items()
            if isinstance(md, TensorStorageMetadata)}


def read_parameters(step_dir: str | Path) -> dict[str, torch.Tensor]:
    """Every parameter of a checkpoint by whole-model name, read in this process (for a consumer
    that needs the whole model, such as `attnres-pp generate`); no optimizer or RNG state."""
    saved = checkpoint_tensors(step_dir)
    state = {key: torch.empty(md.size, dtype=md.properties.dtype) for key, md in saved.items()
             if not key.startswith(("optim.", "rng."))}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, storage_reader=SafeReader(str(step_dir)), no_dist=True)
    return state


def load_shard(step_dir: str | Path, params: dict[str, torch.nn.Parameter], optimizer: torch.optim.Optimizer,
               stream: str, *, distributed: bool) -> str | None:
    """Load this rank's parameters (in place), their optimizer state and, if the checkpoint has one
    for `stream`, its RNG state. Returns None when it restored the RNG state, otherwise a sentence
    saying that it kept the seeded one and why. `distributed` as for `save_shard`."""
    saved = checkpoint_tensors(step_dir)
    missing = sorted(set(params) - set(saved))
    if missing:
        raise ValueError(f"checkpoint {step_dir} has no values for parameters {missing[:5]}: it was written for "
                         "another model; resume with the model config it was saved with")
    for name, p in params.items():
        if tuple(saved[name].size) != tuple(p.shape):
            raise ValueError(f"checkpoint parameter {name} has shape {tuple(saved[name].size)}, the model "
                             f"{tuple(p.shape)}: resume with the model config it was saved with")
    state: dict[str, torch.Tensor] = {name: p.detach() for name, p in params.items()}
    optim_keys = {}
    for name in params:
        prefix = f"optim.{name}."
        for key in (k for k in saved if k.startswith(prefix) and "." not in k[len(prefix):]):
            optim_keys[key] = (name, key[len(prefix):])
            state[key] = _optim_target(params[name], saved[key])
    rng = [key for key in rng_keys(stream) if key in saved]
    for key in rng:
        state[key] = torch.empty(saved[key].size, dtype=saved[key].properties.dtype)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, storage_reader=SafeReader(str(step_dir)), no_dist=not distributed)
    _set_optimizer_state(optimizer, params, optim_keys, state)
    cpu_key, cuda_key = rng_keys(stream)
    if cuda_key in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state(state[cuda_key])
    if cpu_key in rng:
        torch.set_rng_state(state[cpu_key])
        return None
    held = sorted(key[len("rng."):] for key in saved if key.startswith("rng.") and not key.endswith(".cuda"))
    return (f"checkpoint {step_dir} has no RNG state for stream {stream} (it holds {', '.join(held) or 'none'}: "
            "saved at another split); this rank keeps the RNG state its seed gave it")


def _optim_target(param: torch.nn.Parameter, md: TensorStorageMetadata) -> torch.Tensor:
    """Where an optimizer tensor loads: a moment of an FSDP2 shard (a DTensor) loads as a DTensor laid
    out like it, so DCP reads just this rank's rows; anything else as a whole tensor."""
    if hasattr(param, "to_local") and tuple(md.size) == tuple(param.shape):
        return torch.zeros_like(param.detach(), dtype=md.properties.dtype)
    return torch.empty(md.size, dtype=md.properties.dtype)


def _set_optimizer_state(optimizer: torch.optim.Optimizer, params: dict[str, torch.nn.Parameter],
                         optim_keys: dict[str, tuple[str, str]], state: dict[str, torch.Tensor]) -> None:
    by_name: dict[str, dict] = {}
    for key, (name, field) in optim_keys.items():
        by_name.setdefault(name, {})[field] = state[key]
    # state_dict() numbers parameters in param_group order; rebuild that numbering from names.
    name_of = {id(p): name for name, p in params.items()}
    ordered = [name_of[id(p)] for group in optimizer.param_groups for p in group["params"]]
    current = optimizer.state_dict()
    numbered = {index: by_name[name] for index, name in enumerate(ordered) if name in by_name}
    # load_state_dict casts the moments to each parameter's device and dtype.
    optimizer.load_state_dict({"state": numbered, "param_groups": current["param_groups"]})
