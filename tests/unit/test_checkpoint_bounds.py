"""Loading a checkpoint is bounded by construction: the attacks that got past the name-admitting
unpickler (a hang, a memory blow-up, a read outside the folder, a BUILD that plants a method, a field
of the wrong type, a `.metadata` read twice) are each refused with one CheckpointRefused line, fast,
by the loader and by `train --resume`, `generate --resume` and `analyze`."""

from __future__ import annotations

import os
import pickle
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from attnres_pp.cli import main
from attnres_pp.train.checkpoint import latest_checkpoint
from attnres_pp.train.metadata_pickle import CheckpointRefused, load_metadata
from attnres_pp.train.shards import SafeReader, read_parameters
from tests.cli_batch import Run, run_cli_batch
from tests.pickle_gadgets import stack_global, text

# One worker runs the module (--dist loadgroup): its trained runs and its one CLI child are built once.
pytestmark = pytest.mark.xdist_group("checkpoint-bounds")

TINY = ["--layers", "2", "--d-model", "16", "--heads", "2", "--seq-len", "8", "--batch-size", "2",
        "--microbatches", "1", "--eval-every", "0", "--quiet"]




def _program(body: bytes, proto: int = 4) -> bytes:
    return b"\x80" + bytes([proto]) + body + b"."


def _size_of(arg: bytes) -> bytes:
    """torch.Size(arg) through REDUCE: `arg` is one pickled value, put in a 1-tuple."""
    return _program(stack_global("torch", "Size") + arg + b"\x85R")


# 40 levels of DUP TUPLE2: a tuple whose tree has 2^40 leaves, 80 bytes of pickle.
DUP_BOMB = _size_of(b")" + b"2\x86" * 40)
SELF_LIST = _size_of(b"]\x94h\x00a")  # EMPTY_LIST MEMOIZE BINGET 0 APPEND: a list holding itself
DEEP_TUPLES = _size_of(b")" + b"\x85" * 100_000)
BYTEARRAY8 = b"\x80\x05\x96" + (2 ** 31).to_bytes(8, "little") + b"."  # 12 bytes that ask for 2 GiB
_NEW_METADATA = stack_global("torch.distributed.checkpoint.metadata", "Metadata") + b")\x81"  # NEWOBJ
PLANTED_SETSTATE = _program(_NEW_METADATA + b"}" + text("__setstate__") + stack_global("torch", "Size") + b"sb")
PLANTED_EXTEND = _program(_NEW_METADATA + b"}" + text("extend") + stack_global("torch", "Size") + b"sb")
BUILT_TWICE = _program(_NEW_METADATA + b"}b}b")
HASHED_DEEP_KEY = _program(b"}" + b")" + b"\x85" * 100_000 + b"Ns")  # {deep tuple: None}

HOSTILE_METADATA = {"DUP TUPLE2 x40 under torch.Size": DUP_BOMB, "a list holding itself": SELF_LIST,
                    "100k nested TUPLE1": DEEP_TUPLES, "BYTEARRAY8 of 2 GiB": BYTEARRAY8,
                    "BUILD plants __setstate__": PLANTED_SETSTATE, "BUILD plants extend": PLANTED_EXTEND,
                    "BUILD twice": BUILT_TWICE, "a deeply nested dict key": HASHED_DEEP_KEY}


class _Deadline:
    """Fail (not hang) if the block takes longer than `seconds`."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def __enter__(self):
        def expired(*_):
            raise TimeoutError(f"took longer than {self.seconds} s")
        self.previous = signal.signal(signal.SIGALRM, expired)
        signal.setitimer(signal.ITIMER_REAL, self.seconds)

    def __exit__(self, *_):
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, self.previous)


def _one_line(error: BaseException) -> str:
    text = str(error)
    assert "\n" not in text and len(text) < 1000, text[:2000]
    return text


@pytest.mark.parametrize("name", sorted(HOSTILE_METADATA))
def test_each_hostile_metadata_is_refused_fast(tmp_path, name):
    path = tmp_path / ".metadata"
    path.write_bytes(HOSTILE_METADATA[name])
    started = time.monotonic()
    with _Deadline(5), pytest.raises(CheckpointRefused) as refused:
        load_metadata(path)
    assert time.monotonic() - started < 2
    _one_line(refused.value)


@pytest.mark.subprocess
def test_the_memory_and_hash_gadgets_do_harm_under_plain_pickle(tmp_path):
    """BYTEARRAY8 allocates what it names (MemoryError under a 1 GiB address-space limit); hashing a
    deeply nested key overflows the C stack (the process dies of a signal)."""
    program = ("import pickle, resource, sys; resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30)); "
               "pickle.loads(sys.stdin.buffer.read())")
    done = subprocess.run([sys.executable, "-c", program], input=BYTEARRAY8, capture_output=True, timeout=60)
    assert done.returncode != 0 and b"MemoryError" in done.stderr, done.stderr[-500:]
    done = subprocess.run([sys.executable, "-c", "import pickle, sys; pickle.loads(sys.stdin.buffer.read())"],
                          input=_program(b"}" + b")" + b"\x85" * 1_000_000 + b"Ns"), capture_output=True, timeout=60)
    assert done.returncode < 0, done.returncode  # killed by SIGSEGV


def test_a_metadata_fifo_is_refused_not_read(tmp_path):
    os.mkfifo(tmp_path / ".metadata")
    with _Deadline(5), pytest.raises(CheckpointRefused, match="not a regular file"):
        load_metadata(tmp_path / ".metadata")


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("bounds") / "run"
    assert main(["train", *TINY, "--launcher", "local", "--steps", "1", "--out", str(run)]) == 0
    return run


def _copy(trained_run: Path, tmp_path: Path, name: str = "hostile") -> tuple[Path, Path]:
    run = tmp_path / name
    shutil.copytree(trained_run, run)
    return run, latest_checkpoint(run)


def _rewrite(step: Path, change) -> None:
    """Load the real metadata, let `change` alter it, and pickle it back as DCP does."""
    metadata = load_metadata(step / ".metadata")
    change(metadata)
    (step / ".metadata").write_bytes(pickle.dumps(metadata))


def _stride_zero(step: Path) -> None:
    """embed.tok.weight said to have 2^28 elements, its shard a stride-0 expand of one element
    (weights_only=True loads it); before, generate allocated 1 GiB from the metadata's size."""
    import io

    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex
    buffer = io.BytesIO()
    torch.save(torch.zeros(1).expand(2 ** 28), buffer)
    assert torch.load(io.BytesIO(buffer.getvalue()), weights_only=True).shape == (2 ** 28,)
    (step / "__1_0.distcp").write_bytes(buffer.getvalue())

    def change(md):
        key = "embed.tok.weight"
        md.state_dict_metadata[key].size = torch.Size([2 ** 28])
        md.state_dict_metadata[key].chunks = [ChunkStorageMetadata(offsets=torch.Size([0]),
                                                                   sizes=torch.Size([2 ** 28]))]
        for index in [i for i in md.storage_data if i.fqn == key]:
            del md.storage_data[index]
        md.storage_data[MetadataIndex(key, torch.Size([0]), 0)] = _StorageInfo("__1_0.distcp", 0,
                                                                                len(buffer.getvalue()))
    _rewrite(step, change)


def _paths(target):
    def change(md):
        for info in md.storage_data.values():
            info.relative_path = target
    return change


def _field(name, value):
    def change(md):
        setattr(md, name, value)
    return change


def _leaves_2_40():
    tree = ()
    for _ in range(40):
        tree = (tree, tree)
    return tree


def _bomb_size(md):
    next(iter(md.state_dict_metadata.values())).size = _leaves_2_40()  # pickles to a few hundred bytes


def _bytes_entry(md):
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata
    md.state_dict_metadata["extra"] = BytesStorageMetadata()


def _rng_size(md):
    key = next(k for k in md.state_dict_metadata if k.startswith("rng."))
    md.state_dict_metadata[key].size = torch.Size([2 ** 28])
    md.state_dict_metadata[key].chunks[0].sizes = torch.Size([2 ** 28])


def _short_shard(step: Path) -> None:
    shard = step / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:-100])


@pytest.mark.parametrize("attack", ["stride-0 expand", "../ path", "absolute path", "FIFO shard", "decoy shard name",
                                    "state_dict_metadata=5", "2^40-leaf size", "byte entry", "truncated shard"])
def test_each_hostile_checkpoint_is_refused_before_reading(trained_run, tmp_path, attack):
    run, step = _copy(trained_run, tmp_path)
    _, decoy = _copy(trained_run, tmp_path, "other")  # a checkpoint beside it, never to be read
    fifo = step / "__7_0.distcp"
    {"stride-0 expand": _stride_zero,
     "../ path": lambda s: _rewrite(s, _paths(f"../../../other/checkpoints/{decoy.name}/__0_0.distcp")),
     "absolute path": lambda s: _rewrite(s, _paths(str(decoy / "__0_0.distcp"))),
     "FIFO shard": lambda s: (os.mkfifo(fifo), _rewrite(s, _paths(fifo.name))),
     "decoy shard name": lambda s: ((s / "__3_0.distcp").symlink_to(decoy / "__0_0.distcp"),
                                    _rewrite(s, _paths("__3_0.distcp"))),
     "state_dict_metadata=5": lambda s: _rewrite(s, _field("state_dict_metadata", 5)),
     "2^40-leaf size": lambda s: _rewrite(s, _bomb_size),
     "byte entry": lambda s: _rewrite(s, _bytes_entry),
     "truncated shard": _short_shard}[attack](step)
    read = []
    original = SafeReader.read_data
    SafeReader.read_data = lambda self, plan, planner: read.append(1) or original(self, plan, planner)
    try:
        with _Deadline(5), pytest.raises(CheckpointRefused) as refused:
            read_parameters(step)
    finally:
        SafeReader.read_data = original
    _one_line(refused.value)
    assert not read, "a shard was read before the checkpoint was refused"


def test_an_rng_state_of_another_size_is_refused_before_it_is_allocated(tmp_path):
    from attnres_pp.model import ModelConfig, Transformer
    from attnres_pp.train.config import TrainConfig
    from attnres_pp.train.optim import build_optimizer
    from attnres_pp.train.shards import load_shard, save_shard, shard_state

    model = Transformer(ModelConfig(n_layers=2, d_model=16, n_heads=2, seq_len=8), backend="torch", seed=0)
    optimizer = build_optimizer(model, TrainConfig())
    params = dict(model.named_parameters())
    save_shard(tmp_path / "step_1", shard_state(model, params, optimizer, "dp0.layers0:2"), distributed=False)
    _rewrite(tmp_path / "step_1", _rng_size)
    with pytest.raises(CheckpointRefused) as refused:
        load_shard(tmp_path / "step_1", model, params, optimizer, "dp0.layers0:2", distributed=False)
    assert "rng." in _one_line(refused.value)


def test_the_metadata_is_read_once_and_never_by_plain_pickle(trained_run, monkeypatch):
    import torch.distributed.checkpoint.filesystem as filesystem

    import attnres_pp.train.shards as shards

    calls = []
    monkeypatch.setattr(shards, "load_metadata", lambda path: calls.append(path) or load_metadata(path))
    monkeypatch.setattr(filesystem.FileSystemReader, "read_metadata",
                        lambda *a, **k: pytest.fail("DCP read .metadata itself"))
    params = read_parameters(latest_checkpoint(trained_run))
    assert params and len(calls) == 1


def test_a_swap_after_the_check_is_not_read(trained_run, tmp_path):
    run, step = _copy(trained_run, tmp_path)
    reader = SafeReader(step)
    reader.read_metadata()
    (step / ".metadata").write_bytes(DUP_BOMB)
    assert reader.read_metadata().state_dict_metadata  # the checked object, not the new file


CLI_COMMANDS = ["train", "train (damaged shard)", "generate", "analyze"]


def _hostile_cli_argv(trained_run: Path, folder: Path, command: str) -> list[str]:
    """A copy of the trained run in `folder`, damaged for `command`, and the argv that loads it."""
    run, step = _copy(trained_run, folder)
    if command == "train":
        (step / ".metadata").write_bytes(DUP_BOMB)
        return ["train", "--resume", str(run), "--steps", "2", "--launcher", "local", "--quiet"]
    if command == "train (damaged shard)":  # refused in the engine's load, after the driver's check
        shard = step / "__0_0.distcp"
        shard.write_bytes(bytes(400) + shard.read_bytes()[400:])
        return ["train", "--resume", str(run), "--steps", "2", "--launcher", "local", "--quiet"]
    if command == "generate":
        _stride_zero(step)
        return ["generate", "--resume", str(run), "--prompt", "def ", "--max-new-tokens", "2"]
    _rewrite(step, _paths("../../../other/__0_0.distcp"))
    return ["analyze", str(run), "--out", str(folder / "analysis")]


@pytest.fixture(scope="module")
def cli_refusals(trained_run, tmp_path_factory) -> dict[str, Run]:
    """Each CLI command of CLI_COMMANDS on its own damaged copy, all in one fresh interpreter
    (`tests.cli_batch`): each run's exit code and stderr as a process of its own would give them."""
    argvs = [_hostile_cli_argv(trained_run, tmp_path_factory.mktemp("cli"), command) for command in CLI_COMMANDS]
    return dict(zip(CLI_COMMANDS, run_cli_batch(argvs, timeout_s=960, OMP_NUM_THREADS="1"), strict=True))


# The four runs share the first test's set-up: 240 s each, as when each test ran its own.
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("command", CLI_COMMANDS)
@pytest.mark.subprocess
def test_each_cli_refuses_with_one_error_line(cli_refusals, command):
    done = cli_refusals[command]
    assert done.returncode == 2, done.stderr[-3000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), done.stderr[-3000:]
    assert "Traceback" not in done.stderr


@pytest.fixture(scope="module")
def other_run(tmp_path_factory) -> Path:
    """A checkpoint of the same model with other weights (another seed): the decoy of a swap."""
    run = tmp_path_factory.mktemp("bounds_other") / "run"
    assert main(["train", *TINY, "--launcher", "local", "--steps", "1", "--seed", "1", "--out", str(run)]) == 0
    return latest_checkpoint(run)


def _swap_in(kind: str, shard: Path, decoy: Path) -> None:
    """Replace `shard` after the check and before DCP opens it."""
    shard.unlink()
    if kind == "symlink to another checkpoint's shard":
        shard.symlink_to(decoy)
    elif kind == "FIFO":
        os.mkfifo(shard)
    else:  # another file of the same size: the decoy's bytes, copied in
        shutil.copyfile(decoy, shard)


def _load_with_swap(step: Path, decoy_step: Path, kind: str, *, stock_files: bool = False) -> dict:
    from attnres_pp.train import shards

    original = SafeReader.read_data

    def swap_then_read(self, plan, planner):
        _swap_in(kind, step / "__0_0.distcp", decoy_step / "__0_0.distcp")
        if stock_files:  # DCP's own file access, as before the loader pinned what it checked
            from torch.distributed.checkpoint.filesystem import FileSystem
            self.fs = FileSystem()
        return original(self, plan, planner)

    SafeReader.read_data = swap_then_read
    try:
        with _Deadline(5):
            return shards.read_parameters(step)
    finally:
        SafeReader.read_data = original


@pytest.mark.parametrize("kind", ["symlink to another checkpoint's shard", "FIFO", "same-size copy"])
def test_a_shard_swapped_between_the_check_and_the_read_is_refused(trained_run, other_run, tmp_path, kind):
    _, step = _copy(trained_run, tmp_path)
    with pytest.raises(CheckpointRefused, match="__0_0.distcp") as refused:
        _load_with_swap(step, other_run, kind)
    _one_line(refused.value)


def test_without_the_pinned_open_a_swapped_shard_loads_another_checkpoints_weights(trained_run, other_run, tmp_path):
    """The harm the pinned open prevents: DCP's own file access follows the swapped-in symlink and
    hands back the other checkpoint's tensors as if they were this one's."""
    _, step = _copy(trained_run, tmp_path)
    want_own = read_parameters(step)
    decoy = read_parameters(other_run)
    got = _load_with_swap(step, other_run, "symlink to another checkpoint's shard", stock_files=True)
    name = next(k for k in got if not torch.equal(want_own[k], decoy[k]))
    assert torch.equal(got[name], decoy[name]) and not torch.equal(got[name], want_own[name])


def _inflation_bomb(like: torch.Tensor, claimed: int = 2**28) -> bytes:
    """torch.save(like) with its data record deflated and claiming `claimed` bytes of zeros: about
    1/1000 of that on disk. torch.save writes every record stored; this one is hand-made."""
    import io
    import zipfile

    saved = io.BytesIO()
    torch.save(like.clone(), saved)
    source = zipfile.ZipFile(io.BytesIO(saved.getvalue()))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as bomb:
        for record in source.infolist():
            if record.filename.endswith("/data/0"):
                bomb.writestr(record.filename, bytes(claimed), compress_type=zipfile.ZIP_DEFLATED)
            else:
                bomb.writestr(record, source.read(record.filename))
    return out.getvalue()


def _peak_growth_of_loading(path: Path, timeout_s: float = 60.0) -> int:
    """torch.load of `path` in a fork of this process (torch imported already; a fork's peak resident
    memory starts at its resident memory at the fork): how far its peak rose above that."""
    import io
    import resource
    import select

    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        grew = -1
        try:
            bomb = path.read_bytes()
            resident = int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")  # now
            try:
                torch.load(io.BytesIO(bomb), weights_only=True)
            except Exception:  # noqa: BLE001 - the size check fails after the inflation
                pass
            grew = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - resident
        finally:
            os.write(write_end, str(grew).encode())
            os._exit(0)
    os.close(write_end)
    ready = select.select([read_end], [], [], timeout_s)[0]
    if not ready:
        os.kill(pid, signal.SIGKILL)
    answer = os.read(read_end, 64) if ready else b""
    os.waitpid(pid, 0)
    os.close(read_end)
    assert ready, f"loading the bomb ran past {timeout_s} s"
    return int(answer)


@pytest.mark.subprocess
def test_without_the_archive_check_a_compressed_record_allocates_what_it_claims(tmp_path):
    """The harm: torch.load inflates a 256 KB record toward the 256 MiB it claims before it finds the
    size wrong (in a process of its own, a fork, whose peak memory grows by at least half of that)."""
    path = tmp_path / "bomb"
    path.write_bytes(_inflation_bomb(torch.zeros(4)))
    assert path.stat().st_size < 2**19
    grew = _peak_growth_of_loading(path)
    assert grew >= 2**27


def test_a_shard_entry_that_is_an_inflation_bomb_is_refused_before_it_is_inflated(trained_run, tmp_path):
    """One tensor's storage entry is pointed at a bomb appended to the shard: refused, in one line,
    from the archive's directory alone (the bomb's data is never read)."""
    from attnres_pp.train.metadata_pickle import load_metadata as load

    _, step = _copy(trained_run, tmp_path)
    shard = step / "__0_0.distcp"
    metadata = load(step / ".metadata")
    index, info = next((i, s) for i, s in metadata.storage_data.items() if s.relative_path == shard.name)
    tensor = metadata.state_dict_metadata[index.fqn]
    bomb = _inflation_bomb(torch.zeros(tuple(tensor.size), dtype=tensor.properties.dtype))
    info.offset, info.length = shard.stat().st_size, len(bomb)
    with shard.open("ab") as f:
        f.write(bomb)
    (step / ".metadata").write_bytes(pickle.dumps(metadata))
    with _Deadline(5), pytest.raises(CheckpointRefused, match="holds a compressed record") as refused:
        read_parameters(step)
    _one_line(refused.value)


@pytest.mark.parametrize("path", ["relative", "absolute"])
def test_without_the_folder_check_a_storage_path_loads_another_checkpoints_weights(trained_run, other_run, tmp_path,
                                                                                    path):
    """The harm of a storage path that leaves the folder, under DCP's own reader: the tensors come
    from the other checkpoint, and nothing says so."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    _, step = _copy(trained_run, tmp_path)
    decoy = other_run / "__0_0.distcp"
    target = str(decoy) if path == "absolute" else os.path.relpath(decoy, step)
    _rewrite(step, _paths(target))
    own, theirs = read_parameters(trained_run / "checkpoints" / step.name), read_parameters(other_run)
    state = {name: torch.empty_like(tensor) for name, tensor in own.items()}
    dcp.load(state, storage_reader=FileSystemReader(str(step)), no_dist=True)
    name = next(k for k in own if not torch.equal(own[k], theirs[k]))
    assert torch.equal(state[name], theirs[name]) and not torch.equal(state[name], own[name])
    with pytest.raises(CheckpointRefused, match="resolves outside its folder|not a shard file name"):
        read_parameters(step)
