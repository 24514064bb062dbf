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
(stages, virtual stages, data parallelism, tensor parallelism, layer counts): DCP reads each tensor
from whichever file has it (the fused qkv weights of a tp run are stored whole: `train.tp_rank`).
Only a changed model cannot load (names or shapes differ; the error says so). A tied head's copy: `tied_keys`.
A rank's RNG state belongs to what it holds, not to its global rank: the stream is named by the
rank's data-parallel replica and the layers of its chunks (`dp1.layers0:2,4:6`). A resume at
another split restores the state of every stream that exists in both splits (same replica, same
layers); a rank whose stream the checkpoint lacks keeps the state its seed gave it, and says so.

Loading never unpickles arbitrary objects: tensors are read with torch.load(weights_only=True) by
DCP itself, and the `.metadata` file, which DCP reads with plain pickle, is read here through
`metadata_pickle`, which admits an exact list of DCP's metadata classes, torch's dtypes and sizes,
and refuses every other name, every dotted name and every call to anything else; then
`checkpoint_check` checks the tree and the shard files, and every target is allocated from the model,
never from the metadata's sizes (docs/checkpoints.md, "What loading guarantees").
"""

from __future__ import annotations

import contextlib
import io
import os
import stat
import warnings
import zipfile
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from attnres_pp.train.checkpoint_check import check_expected, check_metadata
from attnres_pp.train.metadata_pickle import CheckpointRefused, brief, load_metadata
from attnres_pp.train.tied_keys import stored, stored_key
from attnres_pp.train.tp_rank import whole_strided, whole_targets


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
    return whole_strided(stored(model, state))


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


# A tensor's archive, as torch.save writes it: data.pkl, data/0, version and a few format records.
MAX_ARCHIVE_RECORDS = 16


def check_stored_archive(stream, offset: int, length: int, what: str) -> None:
    """Refuse the torch.save archive at bytes [offset, offset + length) of `stream` unless every
    record is stored uncompressed with its size inside the range. torch.load inflates a deflated
    record to the size its header claims before checking anything (a 256 KB record of zeros became
    256 MiB), so a compressed record is a memory bomb; torch.save never compresses. Reads only the
    archive's directory, not its data."""
    try:
        with zipfile.ZipFile(_Slice(stream, offset, length)) as archive:
            records = archive.infolist()
    except (zipfile.BadZipFile, OSError, ValueError, EOFError) as error:
        raise CheckpointRefused(f"{what} is not a tensor archive ({brief(str(error))})") from None
    if len(records) > MAX_ARCHIVE_RECORDS:
        raise CheckpointRefused(f"{what} is an archive of {len(records)} records, not one tensor's")
    for record in records:
        if record.compress_type != zipfile.ZIP_STORED or record.file_size != record.compress_size:
            raise CheckpointRefused(f"{what} holds a compressed record ({brief(record.filename)}: "
                                    f"{record.compress_size} bytes claiming {record.file_size}); torch.save "
                                    "writes none, and inflating it would allocate what it claims")
        if record.file_size > length:
            raise CheckpointRefused(f"{what} has a record of {record.file_size} bytes in an archive of {length}")


class _Slice(io.RawIOBase):
    """Bytes [offset, offset + length) of a seekable binary stream, as a seekable file of its own."""

    def __init__(self, stream, offset: int, length: int) -> None:
        super().__init__()
        self._stream, self._start, self._length, self._at = stream, offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._at

    def seek(self, where: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._at, io.SEEK_END: self._length}[whence]
        self._at = min(max(base + where, 0), self._length)
        return self._at

    def readinto(self, buffer) -> int:
        n = min(len(buffer), self._length - self._at)
        if n <= 0:
            return 0
        self._stream.seek(self._start + self._at)
        data = self._stream.read(n)
        buffer[:len(data)] = data
        self._at += len(data)
        return len(data)


class SafeReader(FileSystemReader):
    """DCP's file reader for one checkpoint folder, which reads `.metadata` once, through
    `metadata_pickle.load_metadata` (exact names, no calls but the admitted ones, bounded time and
    memory) and `checkpoint_check.check_metadata` (types, sizes, chunks, shard files inside the folder),
    and hands DCP that checked object every time it asks: a file swapped after the check is never read.
    Byte entries never reach DCP's `torch.load(weights_only=False)`: the check refuses them, and
    `read_data` refuses a plan that asks for one."""

    def __init__(self, path: str | Path) -> None:
        super().__init__(str(path))
        self._checked: Metadata | None = None
        self.fs = _PinnedFiles(str(path))  # DCP opens every shard through this

    def read_metadata(self, *args, **kwargs) -> Metadata:
        if self._checked is None:
            folder = Path(self.path)
            path = folder / ".metadata"
            if not path.is_file():
                raise ValueError(f"checkpoint {self.path} has no .metadata: it is not a checkpoint of this format")
            metadata = load_metadata(path)
            self.fs.pinned = check_metadata(metadata, folder, str(path))
            self._checked = metadata
        if self._checked.storage_meta is not None:
            self._checked.storage_meta.load_id = self.load_id
        return self._checked

    def read_data(self, plan, planner):
        if any(item.type == LoadItemType.BYTE_IO for item in plan.items):
            raise CheckpointRefused(f"checkpoint {self.path}: the load asks for a byte entry, which this "
                                    "program never writes; refusing to unpickle it")
        for index in {item.storage_index for item in plan.items}:
            info = self.storage_data[index]
            with self.fs.create_stream(self.fs.concat_path(self.path, info.relative_path), "rb") as stream:
                check_stored_archive(stream, info.offset, info.length, f"checkpoint {self.path}: {index.fqn!r} "
                                     f"in {info.relative_path}")
        return super().read_data(plan, planner)


def _identity(info: os.stat_result) -> tuple[int, ...]:
    """What makes a file the one that was checked. The inode alone is not enough: a file created
    after the checked one was deleted may get its number back; its change time differs."""
    return info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns, info.st_ctime_ns


class _PinnedFiles(FileSystem):
    """DCP's file access for SafeReader: a shard is opened only as the very file the check
    examined. Opened without following a symlink and without blocking (a FIFO swapped in cannot
    hang the read), it must be a regular file with the checked device, inode, size and times; anything
    else, such as a shard replaced by a symlink or a FIFO between the check and the read, is
    CheckpointRefused."""

    def __init__(self, folder: str) -> None:
        super().__init__()
        self.folder = folder
        self.pinned: dict[str, os.stat_result] = {}  # shard name -> its stat at the check

    @contextlib.contextmanager
    def create_stream(self, path, mode: str):
        if mode != "rb":
            raise CheckpointRefused(f"checkpoint {self.folder}: the loader opens shards for reading only")
        name = os.path.basename(str(path))
        checked = self.pinned.get(name)
        if checked is None or os.path.dirname(os.path.abspath(path)) != os.path.abspath(self.folder):
            raise CheckpointRefused(f"checkpoint {self.folder}: the load asks for {name}, a file its checked "
                                    "metadata does not name")
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError as error:
            raise CheckpointRefused(f"checkpoint {self.folder}: shard {name} cannot be opened as the file that was "
                                    f"checked ({error.strerror}): it was replaced during the load") from None
        now = os.fstat(fd)
        if not stat.S_ISREG(now.st_mode) or _identity(now) != _identity(checked):
            os.close(fd)
            raise CheckpointRefused(f"checkpoint {self.folder}: shard {name} is not the file that was checked "
                                    "(replaced during the load); load it again once nothing writes the folder")
        os.set_blocking(fd, True)
        with os.fdopen(fd, "rb") as stream:
            yield stream


def checkpoint_tensors(step_dir: str | Path) -> dict[str, TensorStorageMetadata]:
    """Every tensor a checkpoint holds: key -> its metadata (size, dtype), checked (see SafeReader)."""
    return dict(SafeReader(step_dir).read_metadata().state_dict_metadata)


def _load(state: dict, reader: SafeReader, step_dir, *, distributed: bool) -> None:
    """dcp.load into `state` (targets allocated from the model, already checked against the metadata).
    What still fails inside DCP (a shard whose bytes are not a tensor of the size its entry says) is
    one CheckpointRefused: DCP wraps it in CheckpointException, whose text holds whole tracebacks."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            warnings.filterwarnings("ignore", category=UserWarning)
            dcp.load(state, storage_reader=reader, no_dist=not distributed)
    except CheckpointRefused:
        raise
    except (Exception, CheckpointException) as error:  # noqa: BLE001 - every failure of a checked file is one line
        refusal = next((e for e in _failed_ranks(error) if isinstance(e, CheckpointRefused)), None)
        if refusal is not None:  # the reader's own refusal, which DCP wrapped with tracebacks
            raise CheckpointRefused(str(refusal)) from None
        detail = next(iter(_failures(error)), "")
        raise CheckpointRefused(f"checkpoint {step_dir} cannot be read ({type(error).__name__}: {brief(detail)}); "
                                "load an earlier checkpoint, or retrain") from None


def rank_failures(error: BaseException) -> list[tuple[int, BaseException]]:
    """(rank, exception) for each rank a DCP CheckpointException says failed, by rank; DCP keeps
    each as (exception, traceback). Empty for any other error."""
    failures = getattr(error, "failures", None)
    if not isinstance(failures, dict):
        return []
    return [(rank, failure[0] if isinstance(failure, tuple) else failure)
            for rank, failure in sorted(failures.items())]


def _failed_ranks(error: BaseException) -> list[BaseException]:
    return [failure for _rank, failure in rank_failures(error)]


def _failures(error: BaseException):
    """The innermost messages of a DCP failure (CheckpointException keeps each rank's exception)."""
    for failure in _failed_ranks(error):
        yield from _failures(failure)
    try:
        lines = str(error).strip().splitlines()
    except Exception:  # noqa: BLE001
        lines = []
    yield lines[-1] if lines else ""


def model_tensors(step_dir: str | Path, *, tensor_count: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """The parameters (name -> shape, dtype) of the model that the checkpoint's meta.json config
    describes, built on the meta device (no memory). `tensor_count` (the checkpoint's tensors) bounds
    the layers the config may ask for, so a damaged config cannot make the build itself take long."""
    from attnres_pp.model import ModelConfig
    from attnres_pp.model.transformer import Transformer
    from attnres_pp.train.checkpoint_meta import read_meta

    try:
        cfg = ModelConfig.from_dict(read_meta(step_dir)["config"]["model"])
    except CheckpointRefused:
        raise
    except (KeyError, TypeError, ValueError, AttributeError) as error:
        raise CheckpointRefused(f"checkpoint {step_dir}: meta.json has no valid model config "
                                f"({type(error).__name__}: {brief(str(error))})") from None
    if cfg.n_layers > tensor_count or len(cfg.stream_kernels) > tensor_count:
        raise CheckpointRefused(f"checkpoint {step_dir}: meta.json describes a model of {cfg.n_layers} layers, "
                                f"more than the checkpoint's {tensor_count} tensors could hold")
    try:
        with torch.device("meta"):
            model = Transformer(cfg, backend="torch")
    except (TypeError, RuntimeError, OverflowError) as error:  # sizes past what a tensor can have (2^63 rows)
        raise CheckpointRefused(f"checkpoint {step_dir}: meta.json describes a model no tensor can hold "
                                f"({type(error).__name__}: {brief(str(error))})") from None
    return {name: (tuple(p.shape), p.dtype) for name, p in model.named_parameters()}


def read_parameters(step_dir: str | Path) -> dict[str, torch.Tensor]:
    """Every parameter of a checkpoint by whole-model name, read in this process (for a consumer
    that needs the whole model, such as `attnres-pp generate`); no optimizer or RNG state. The tensors
    are allocated from the model that meta.json's config describes, never from the metadata's sizes."""
    reader = SafeReader(step_dir)
    metadata = reader.read_metadata()
    expected = model_tensors(step_dir, tensor_count=len(metadata.state_dict_metadata))
    check_expected(metadata, expected, str(step_dir))
    state = {key: torch.empty(shape, dtype=dtype) for key, (shape, dtype) in expected.items()}
    _load(state, reader, step_dir, distributed=False)
    return state


def load_shard(step_dir: str | Path, model: torch.nn.Module, params: dict[str, torch.nn.Parameter],
               optimizer: torch.optim.Optimizer, stream: str, *, distributed: bool,
               layout_targets: Callable[[dict], Callable[[dict], dict]] | None = None) -> str | None:
    """Load this rank's parameters (`params`, whole-model names of `model`), their optimizer state and,
    if the checkpoint has one for `stream`, its RNG state. DCP reads into the targets torch's
    state_dict helpers lay out (a DTensor shard reads just this rank's rows) and the helpers set them.
    Returns None when it restored the RNG state, otherwise a sentence saying that it kept the seeded
    one and why. `distributed` as for `save_shard`; `layout_targets` as `whole_targets` (`expert_shards`)."""
    (cpu_key, cuda_key), reader = rng_keys(stream), SafeReader(step_dir)
    metadata = reader.read_metadata()
    saved = metadata.state_dict_metadata
    model_state = _model_state(model, params)
    # The targets of the moments: the optimizer's own state, laid out like each parameter (made by a
    # step at lr 0 if there is none yet; what the checkpoint lacks is dropped by the set below).
    live = get_optimizer_state_dict(model, optimizer, options=_OPTIONS)
    state: dict[str, torch.Tensor] = dict(model_state)
    optim_keys: dict[str, tuple[str, str]] = {}
    for name in params:
        for field, target in live["state"].get(name, {}).items():
            key = f"optim.{name}.{field}"
            if stored_key(model, key) in saved and torch.is_tensor(target):
                optim_keys[key] = (name, field)
                state[key] = target
    own_layout = layout_targets(state) if layout_targets is not None else (lambda loaded: loaded)
    shapes = {key: (tuple(state[key].shape), state[key].dtype) for key in [*params, *optim_keys]}
    check_expected(metadata, stored(model, shapes), str(step_dir))
    # The RNG states are allocated from this process's own (a CUDA one only where CUDA is here to set it).
    rng_targets = {cpu_key: torch.get_rng_state()}
    if torch.cuda.is_available():
        rng_targets[cuda_key] = torch.cuda.get_rng_state()
    rng = [key for key in rng_targets if key in saved]
    check_expected(metadata, {key: (tuple(rng_targets[key].shape), rng_targets[key].dtype) for key in rng},
                   str(step_dir))
    for key in rng:
        state[key] = torch.empty_like(rng_targets[key])
    restore, keyed = whole_targets(state), stored(model, state)
    _load(keyed, reader, step_dir, distributed=distributed)
    state = own_layout(restore({key: keyed[stored_key(model, key)] for key in state}))
    set_model_state_dict(model, {name: state[name] for name in model_state}, options=_OPTIONS)
    loaded: dict[str, dict[str, torch.Tensor]] = {}
    for key, (name, field) in optim_keys.items():
        loaded.setdefault(name, {})[field] = state[key]
    set_optimizer_state_dict(model, optimizer, {"state": loaded, "param_groups": live["param_groups"]},
                             options=_OPTIONS)
    if cuda_key in rng:
        torch.cuda.set_rng_state(state[cuda_key])
    if cpu_key in rng:
        torch.set_rng_state(state[cpu_key])
        return None
    held = sorted(key[len("rng."):] for key in saved if key.startswith("rng.") and not key.endswith(".cuda"))
    return (f"checkpoint {step_dir} has no RNG state for stream {stream} (it holds {', '.join(held) or 'none'}: "
            "saved at another split); this rank keeps the RNG state its seed gave it")
