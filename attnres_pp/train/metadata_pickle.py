"""Reading a checkpoint's `.metadata` without running code from it, in bounded time and memory.

DCP writes `.metadata` with plain pickle, and pickle is a program: GLOBAL / STACK_GLOBAL name any
callable (protocol 4 even walks dotted names: module `torch.distributed.checkpoint.filesystem`,
name `os.system`), and REDUCE, NEWOBJ, INST, OBJ and BUILD call what they were given. So this
unpickler admits exactly the (module, name) pairs below, what DCP's metadata is made of, and
nothing else:

- refuses every name with a dot in it (no attribute walks) and every pair not on the list;
- lets REDUCE call only the admitted factories, each with exactly the arguments it takes
  (`torch.Size`: one tuple of at most MAX_DIMS non-negative ints; the layout decoder: one short
  string; the memory-format enum: one int; the path classes: short strings);
- lets NEWOBJ construct only the admitted dataclasses, with no arguments, and does BUILD itself:
  once per object this file constructed, setting only that dataclass's own fields (TensorProperties'
  tuple state goes through the class's own `__setstate__`, never one an instance was given), so no
  earlier opcode can plant a `__setstate__` or `extend` that a later one calls;
- lets APPEND(S) fill only lists and SETITEM(S) only dicts, with keys that hash in bounded time
  (str, int, a built MetadataIndex: hashing a deeply nested tuple overflows the C stack);
- refuses INST, OBJ, NEWOBJ_EX, the extension registry (EXT*), persistent ids, out-of-band buffers
  (NEXT_BUFFER, READONLY_BUFFER), BYTEARRAY8 (it allocates the length it names before reading) and
  sets, none of which DCP's metadata uses.

Bounded by construction: the file must be a regular file of at most MAX_METADATA_BYTES (checked on
the open descriptor before reading, so a FIFO cannot hang it); a first pass over the opcodes
(`pickletools.genops`, reading from the in-memory bytes) refuses any length operand reaching past the
end of the file and more than MAX_OPCODES opcodes, and each opcode makes O(1) new objects, so the
unpickling's memory is O(MAX_OPCODES). The unpickler's loop is iterative; nothing here recurses on
the file's nesting, and a RecursionError or MemoryError anywhere becomes a refusal. Messages name
objects by their type only, truncated: formatting an attacker's object could itself never end.

Any refusal is a `CheckpointRefused` (a ValueError, so the CLIs print one `error:` line and exit 2).
What the tree then holds (field types, sizes, chunks, storage entries) is `checkpoint_check`'s job.
"""

from __future__ import annotations

import io
import os
import pickle
import pickletools
import stat
from pathlib import Path

import torch
from torch.distributed.checkpoint.metadata import _MEM_FORMAT_ENCODING
from torch.distributed.checkpoint.metadata import MetadataIndex as _MetadataIndex
from torch.distributed.checkpoint.metadata import TensorProperties as _TensorProperties

# A model of 10^4 tensors in 10^3 shards has ~10^7 chunk records of ~100 bytes: far under this.
MAX_METADATA_BYTES = 64 << 20
# Each opcode makes at most a few objects of < 100 bytes: this caps the unpickling near 400 MiB even
# for a file at the size cap (DCP's metadata needs ~0.6 opcodes per byte: 18 kB -> 10k opcodes).
MAX_OPCODES = 4 << 20
MAX_DIMS = 64
MAX_TEXT = 4096
_MAX_DIM_VALUE = 1 << 62

# The classes DCP's metadata instantiates (NEWOBJ, then BUILD with their fields).
_DCP_METADATA = "torch.distributed.checkpoint.metadata"
_CLASSES = frozenset({
    (_DCP_METADATA, "Metadata"),
    (_DCP_METADATA, "TensorStorageMetadata"),
    (_DCP_METADATA, "BytesStorageMetadata"),
    (_DCP_METADATA, "TensorProperties"),
    (_DCP_METADATA, "ChunkStorageMetadata"),
    (_DCP_METADATA, "MetadataIndex"),
    (_DCP_METADATA, "StorageMeta"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
})
# The callables it REDUCEs, each with plain data: a tuple of ints, a layout's name, an enum value, a path.
_FACTORIES = frozenset({
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    (_DCP_METADATA, "_MEM_FORMAT_ENCODING"),
    ("pathlib", "PosixPath"),
    ("pathlib", "WindowsPath"),
})
# Element types a tensor may have: pickled as module-level constants, never called.
_DTYPES = frozenset(("torch", name) for name in (
    "float64", "float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2", "complex64", "complex128",
    "int64", "int32", "int16", "int8", "uint8", "bool"))
ADMITTED = _CLASSES | _FACTORIES | _DTYPES

_REFUSED_OPCODES = frozenset({"INST", "OBJ", "NEWOBJ_EX", "EXT1", "EXT2", "EXT4", "PERSID", "BINPERSID",
                              "BYTEARRAY8", "NEXT_BUFFER", "READONLY_BUFFER", "EMPTY_SET", "ADDITEMS",
                              "FROZENSET"})


class CheckpointRefused(ValueError):
    """A checkpoint file that this program did not write, or that is damaged: loading it stops here."""


def brief(text: str, limit: int = 160) -> str:
    """`text` on one line and at most `limit` characters: what a refusal may quote of a file."""
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[:limit] + "..."


def refusal(source: str, why: str) -> CheckpointRefused:
    return CheckpointRefused(f"{source}: {brief(why, 300)}; refusing to load it (a checkpoint of this program "
                             "never holds that: the file was not written by attnres-pp, or was altered)")


def _type_name(obj) -> str:
    return brief(type(obj).__qualname__, 60)


class _GuardedUnpickler(pickle._Unpickler):
    """pickle's pure-Python unpickler with find_class limited to ADMITTED and the calling and filling
    opcodes limited as the module docstring says."""

    def __init__(self, handle, source: str) -> None:
        super().__init__(handle)
        self._source = source
        self._callables: dict[int, tuple[str, str]] = {}  # id(object) -> (module, name), from find_class
        self._held = []  # keeps what find_class handed out alive, so an id is never reused
        self._unbuilt: dict[int, object] = {}  # id -> instance NEWOBJ made and BUILD has not filled yet
        self._built: set[int] = set()  # ids of filled MetadataIndex objects (hashable dict keys)
        self._keep = []  # keeps built instances alive for the same reason
        dispatch = dict(pickle._Unpickler.dispatch)
        dispatch[pickle.REDUCE[0]] = _guard(pickle._Unpickler.load_reduce, self._check_reduce)
        dispatch[pickle.NEWOBJ[0]] = _guard(pickle._Unpickler.load_newobj, self._check_newobj, self._after_newobj)
        dispatch[pickle.BUILD[0]] = lambda _self: self._build()
        dispatch[pickle.APPEND[0]] = _guard(pickle._Unpickler.load_append, lambda: self._check_target(-2, list))
        dispatch[pickle.APPENDS[0]] = _guard(pickle._Unpickler.load_appends, self._check_appends)
        dispatch[pickle.SETITEM[0]] = _guard(pickle._Unpickler.load_setitem, self._check_setitem)
        dispatch[pickle.SETITEMS[0]] = _guard(pickle._Unpickler.load_setitems, self._check_setitems)
        self.dispatch = dispatch

    def _refuse(self, why: str) -> CheckpointRefused:
        return refusal(self._source, why)

    def find_class(self, module: str, name: str):
        if "." in name:
            raise self._refuse(f"names the attribute path {brief(module, 80)}:{brief(name, 80)}")
        if (module, name) not in ADMITTED:
            raise self._refuse(f"refers to {brief(module, 80)}.{brief(name, 80)}")
        found = super().find_class(module, name)
        self._callables[id(found)] = (module, name)
        self._held.append(found)
        return found

    def _describe(self, obj) -> str:
        admitted = self._callables.get(id(obj))
        return ".".join(admitted) if admitted else f"an object of type {_type_name(obj)}"

    def _check_reduce(self) -> None:
        func, args = self.stack[-2], self.stack[-1]
        target = self._callables.get(id(func))
        if target not in _FACTORIES:
            raise self._refuse(f"calls {self._describe(func)} (REDUCE)")
        if not (type(args) is tuple and _FACTORY_ARGS[target[1]](args)):
            raise self._refuse(f"calls {'.'.join(target)} with arguments it does not take")

    def _check_newobj(self) -> None:
        cls, args = self.stack[-2], self.stack[-1]
        if self._callables.get(id(cls)) not in _CLASSES:
            raise self._refuse(f"constructs {self._describe(cls)} (NEWOBJ)")
        if args != () or type(args) is not tuple:
            raise self._refuse(f"constructs {self._describe(cls)} with arguments (DCP's classes take none)")

    def _after_newobj(self) -> None:
        instance = self.stack[-1]
        self._unbuilt[id(instance)] = instance

    def _build(self) -> None:
        """BUILD done here: `state` fills in the fields of an instance this file constructed, once."""
        state, instance = self.stack[-1], self.stack[-2]
        if self._unbuilt.pop(id(instance), None) is not instance:
            raise self._refuse(f"fills in an object of type {_type_name(instance)} that is not a new DCP "
                               "metadata object (BUILD)")
        cls = type(instance)
        if cls is _TensorProperties:
            if not (type(state) is tuple and len(state) == 5 and type(state[0]) is torch.dtype
                    and type(state[1]) is torch.layout and type(state[2]) is bool
                    and type(state[3]) is _MEM_FORMAT_ENCODING and type(state[4]) is bool):
                raise self._refuse("fills in TensorProperties with a state that is not (dtype, layout, "
                                   "requires_grad, memory format, pin_memory)")
            cls.__setstate__(instance, state)  # the class's own, with checked values
        else:
            fields = _FIELDS[cls]
            if type(state) is not dict or not all(type(key) is str and key in fields for key in state):
                raise self._refuse(f"fills in {cls.__qualname__} with something other than its fields "
                                   f"({', '.join(sorted(fields))})")
            if cls is _MetadataIndex and not _index_fields(state):
                raise self._refuse("fills in MetadataIndex with fields of the wrong types")
            for key, value in state.items():
                object.__setattr__(instance, key, value)  # frozen dataclasses too, as pickle's BUILD does
            if cls is _MetadataIndex:
                self._built.add(id(instance))
                self._keep.append(instance)
        self.stack.pop()

    def _check_target(self, position: int, kind: type) -> None:
        if type(self.stack[position]) is not kind:
            raise self._refuse(f"adds items to an object of type {_type_name(self.stack[position])}")

    def _mark_target(self):
        """The object APPENDS / SETITEMS fill: the one below their MARK."""
        if not self.metastack or not self.metastack[-1]:
            raise self._refuse("adds items without a target")
        return self.metastack[-1][-1]

    def _check_appends(self) -> None:
        if type(self._mark_target()) is not list:
            raise self._refuse(f"adds items to an object of type {_type_name(self._mark_target())}")

    def _check_setitem(self) -> None:
        self._check_target(-3, dict)
        self._check_key(self.stack[-2])

    def _check_setitems(self) -> None:
        if type(self._mark_target()) is not dict:
            raise self._refuse(f"sets items on an object of type {_type_name(self._mark_target())}")
        for key in self.stack[0::2]:
            self._check_key(key)

    def _check_key(self, key) -> None:
        if not (type(key) in (str, int) or (type(key) is _MetadataIndex and id(key) in self._built)):
            raise self._refuse(f"uses a dict key of type {_type_name(key)}")


def _guard(load, check, after=None):
    def guarded(self) -> None:
        check()
        load(self)
        if after is not None:
            after()
    return guarded


def _short_text(value) -> bool:
    return type(value) is str and len(value) <= MAX_TEXT


def _size_args(args: tuple) -> bool:
    return (len(args) == 1 and type(args[0]) is tuple and len(args[0]) <= MAX_DIMS
            and all(type(d) is int and 0 <= d < _MAX_DIM_VALUE for d in args[0]))


_FACTORY_ARGS = {
    "Size": _size_args,
    "_get_layout": lambda args: len(args) == 1 and _short_text(args[0]) and len(args[0]) <= 64,
    "_MEM_FORMAT_ENCODING": lambda args: len(args) == 1 and type(args[0]) is int and 0 <= args[0] < 16,
    "PosixPath": lambda args: len(args) <= MAX_DIMS and all(_short_text(a) for a in args),
    "WindowsPath": lambda args: len(args) <= MAX_DIMS and all(_short_text(a) for a in args),
}


def _index_fields(state: dict) -> bool:
    """MetadataIndex is a dict key, hashed over its fields: they must be small before it is used."""
    offset = state.get("offset")
    index = state.get("index")
    return (_short_text(state.get("fqn")) and (offset is None or type(offset) is torch.Size)
            and (index is None or type(index) is int))


def _dcp_classes():
    import dataclasses

    from torch.distributed.checkpoint import filesystem, metadata

    classes = [getattr(metadata if module == _DCP_METADATA else filesystem, name) for module, name in _CLASSES]
    return {cls: frozenset(f.name for f in dataclasses.fields(cls)) for cls in classes}


_FIELDS = _dcp_classes()


def read_regular_file(path: Path, limit: int, source: str) -> bytes:
    """The bytes of `path`, refused unless it is a regular file of at most `limit` bytes. Opened
    non-blocking and checked on the descriptor, so a FIFO or device in its place is refused, not read."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as error:
        raise CheckpointRefused(f"{source} cannot be opened ({brief(error.strerror or error)})") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise refusal(source, "is not a regular file")
        if info.st_size > limit:
            raise refusal(source, f"has {info.st_size} bytes, more than the {limit} this version reads")
        with os.fdopen(fd, "rb", closefd=False) as handle:
            data = handle.read(info.st_size + 1)  # the size it has (one more byte shows it grew), not the cap
    finally:
        os.close(fd)
    if len(data) > limit:
        raise refusal(source, f"grew past {limit} bytes while being read")
    return data


def _scan(data: bytes, source: str) -> None:
    """Refuse, before unpickling, any refused opcode, any length operand reaching past the end of the
    file (genops reads each from the bytes in memory and fails on a short read) and too many opcodes."""
    count = 0
    for opcode, arg, position in pickletools.genops(io.BytesIO(data)):
        count += 1
        if opcode.name in _REFUSED_OPCODES:
            raise refusal(source, f"uses the pickle opcode {opcode.name}")
        if opcode.name == "FRAME" and arg > len(data) - position:
            raise CheckpointRefused(f"{source} is truncated or damaged (a frame of {arg} bytes runs past its end); "
                                    "load an earlier checkpoint, or retrain")
        if count > MAX_OPCODES:
            raise refusal(source, f"has more than {MAX_OPCODES} pickle opcodes")


def load_metadata(path: str | Path):
    """Unpickle the `.metadata` at `path` under the rules above. Returns DCP's `Metadata` (its tree not
    yet checked: see `checkpoint_check.check_metadata`); raises CheckpointRefused on anything else."""
    from torch.distributed.checkpoint.metadata import Metadata

    path = Path(path)
    data = read_regular_file(path, MAX_METADATA_BYTES, str(path))
    try:
        _scan(data, str(path))
        metadata = _GuardedUnpickler(io.BytesIO(data), str(path)).load()
    except CheckpointRefused:
        raise
    except (RecursionError, MemoryError) as error:
        raise refusal(str(path), f"is nested or sized beyond what this program writes ({type(error).__name__})") \
            from None
    except Exception as error:  # noqa: BLE001 - a malformed pickle fails in many ways, each one refusal
        raise CheckpointRefused(f"{path} is truncated or damaged ({type(error).__name__}: {_error_text(error)}); "
                                "load an earlier checkpoint, or retrain") from None
    if type(metadata) is not Metadata:
        raise CheckpointRefused(f"{path} does not hold checkpoint metadata (it unpickles to "
                                f"{_type_name(metadata)})")
    return metadata


def _error_text(error: BaseException) -> str:
    try:
        return brief(str(error))
    except Exception:  # noqa: BLE001 - str() of a huge int in the message, for one
        return "(message not shown)"
