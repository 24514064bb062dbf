"""One rank's part of a checkpoint, written and read with torch.distributed.checkpoint (DCP).

A checkpoint's state dict is flat and keyed by the whole model's names, whatever the split:
    "<parameter name>"                  the parameter, e.g. "layers.3.mlp.up.weight"
    "optim.<parameter name>.<key>"      its AdamW state: step, exp_avg, exp_avg_sq
    "rng.<stream>" (".cuda")            the RNG state of the rank that feeds <stream> (`rng_stream`)
The values come from torch.distributed.checkpoint.state_dict (`get_model_state_dict`,
`get_optimizer_state_dict`: FQN-keyed, FSDP2 shards as DTensors) and go back through
`set_model_state_dict` and `set_optimizer_state_dict`; only the flattening into the keys above is
done here. Every rank saves what it holds; DCP deduplicates the copies that replicas (and MSAR's tied convs on
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
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

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


# strict=False: a rank's model holds the whole model's modules, most of them on the meta device and
# in no shard of this rank, so a rank's state is always partial.
_OPTIONS = StateDictOptions(strict=False)


def _model_state(model: torch.nn.Module, params: dict[str, torch.nn.Parameter]) -> dict[str, torch.Tensor]:
    """The rank's parameters as `get_model_state_dict` gives them (DTensor shards under FSDP2, views
    of the live storage), restricted to `params` (the rest of the model is on the meta device)."""
    whole = get_model_state_dict(model, options=_OPTIONS)
    return {name: whole[name] for name in params}


def shard_state(model: torch.nn.Module, params: dict[str, torch.nn.Parameter], optimizer: torch.optim.Optimizer,
                stream: str) -> dict:
    """What a rank saves: its parameters (`params`, whole-model names of `model`), their optimizer
    state and the RNG states of its `stream`, from torch's state_dict helpers, flattened into the
    layout above."""
    state: dict[str, torch.Tensor] = _model_state(model, params)
    # Before any step the optimizer holds no state; get_optimizer_state_dict would make some (a step
    # at lr 0 that counts), changing the run: nothing to save then.
    nested = get_optimizer_state_dict(model, optimizer, options=_OPTIONS)["state"] if optimizer.state else {}
    for name in params:
        for key, value in nested.get(name, {}).items():
            state[f"optim.{name}.{key}"] = value.detach() if torch.is_tensor(value) else torch.tensor(value)
    cpu_key, cuda_key = rng_keys(stream)
    state[cpu_key] = torch.get_rng_state()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state[cuda_key] = torch.cuda.get_rng_state()
    return state


def save_shard(step_dir: str | Path, state: dict, *, distributed: bool) -> None:
    """Write `state` into the checkpoint folder `step_dir`. `distributed`: every rank of the default
    process group calls this together (DCP's collective save); otherwise this process writes alone.
    `sync_files=True` (DCP's default, spelled out because crash-consistent saves rely on it): DCP
    fsyncs each file it writes, this rank's `.distcp` and the coordinator's `.metadata`, before the
    save returns, so a rank reports its shard done only once it is on disk."""
    with warnings.catch_warnings():
        # Without a process group DCP warns that it assumes one process: that is the intent here.
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(state, storage_writer=FileSystemWriter(str(step_dir), sync_files=True), no_dist=not distributed)


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


def load_shard(step_dir: str | Path, model: torch.nn.Module, params: dict[str, torch.nn.Parameter],
               optimizer: torch.optim.Optimizer, stream: str, *, distributed: bool) -> str | None:
    """Load this rank's parameters (`params`, whole-model names of `model`), their optimizer state and,
    if the checkpoint has one for `stream`, its RNG state. DCP reads into the targets torch's
    state_dict helpers lay out (a DTensor shard reads just this rank's rows) and the helpers set them.
    Returns None when it restored the RNG state, otherwise a sentence saying that it kept the seeded
    one and why. `distributed` as for `save_shard`."""
    saved = checkpoint_tensors(step_dir)
    missing = sorted(set(params) - set(saved))
    if missing:
        raise ValueError(f"checkpoint {step_dir} has no values for parameters {missing[:5]}: it was written for "
                         "another model; resume with the model config it was saved with")
    for name, p in params.items():
        if tuple(saved[name].size) != tuple(p.shape):
            raise ValueError(f"checkpoint parameter {name} has shape {tuple(saved[name].size)}, the model "
                             f"{tuple(p.shape)}: resume with the model config it was saved with")
    model_state = _model_state(model, params)
    # The targets of the moments: the optimizer's own state, laid out like each parameter (made by a
    # step at lr 0 if there is none yet; what the checkpoint lacks is dropped by the set below).
    live = get_optimizer_state_dict(model, optimizer, options=_OPTIONS)
    state: dict[str, torch.Tensor] = dict(model_state)
    optim_keys: dict[str, tuple[str, str]] = {}
    for name in params:
        for field, target in live["state"].get(name, {}).items():
            key = f"optim.{name}.{field}"
            if key in saved and torch.is_tensor(target):
                optim_keys[key] = (name, field)
                state[key] = target
    rng = [key for key in rng_keys(stream) if key in saved]
    for key in rng:
        state[key] = torch.empty(saved[key].size, dtype=saved[key].properties.dtype)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, storage_reader=SafeReader(str(step_dir)), no_dist=not distributed)
    set_model_state_dict(model, {name: state[name] for name in model_state}, options=_OPTIONS)
    loaded: dict[str, dict[str, torch.Tensor]] = {}
    for key, (name, field) in optim_keys.items():
        loaded.setdefault(name, {})[field] = state[key]
    set_optimizer_state_dict(model, optimizer, {"state": loaded, "param_groups": live["param_groups"]},
                             options=_OPTIONS)
    cpu_key, cuda_key = rng_keys(stream)
    if cuda_key in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state(state[cuda_key])
    if cpu_key in rng:
        torch.set_rng_state(state[cpu_key])
        return None
    held = sorted(key[len("rng."):] for key in saved if key.startswith("rng.") and not key.endswith(".cuda"))
    return (f"checkpoint {step_dir} has no RNG state for stream {stream} (it holds {', '.join(held) or 'none'}: "
            "saved at another split); this rank keeps the RNG state its seed gave it")
