"""Reading a checkpoint's `.metadata` without running code from it.

DCP writes `.metadata` with plain pickle, and pickle is a program: GLOBAL / STACK_GLOBAL name any
callable (protocol 4 even walks dotted names: module `torch.distributed.checkpoint.filesystem`,
name `os.system`), and REDUCE, NEWOBJ, INST, OBJ and BUILD call what they were given. So this
unpickler admits exactly the (module, name) pairs below, what DCP's metadata is made of, and
nothing else:

- refuses every name with a dot in it (no attribute walks) and every pair not on the list;
- lets REDUCE call only the admitted factories (`torch.Size`, the layout decoder, the memory-format
  enum, the path class), NEWOBJ construct only the admitted dataclasses, and BUILD fill in only an
  instance of one of them; INST, OBJ, NEWOBJ_EX, the extension registry (EXT*) and persistent ids
  are refused outright;
- turns a truncated or malformed file into an error that names it.

Any refusal is a `CheckpointRefused` (a ValueError, so the CLIs print one `error:` line and exit 2).
The pure-Python unpickler is used because its opcode table can be guarded; metadata is small.
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path

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


class CheckpointRefused(ValueError):
    """A checkpoint file that this program did not write, or that is damaged: loading it stops here."""


class _GuardedUnpickler(pickle._Unpickler):
    """pickle's pure-Python unpickler with find_class limited to ADMITTED and the calling opcodes
    limited to admitted targets (see the module docstring)."""

    def __init__(self, handle, source: str) -> None:
        super().__init__(handle)
        self._source = source
        self._callables = {}  # id(object) -> (module, name) for everything find_class handed out
        dispatch = dict(pickle._Unpickler.dispatch)
        for opcode in (pickle.INST, pickle.OBJ, pickle.NEWOBJ_EX, pickle.EXT1, pickle.EXT2, pickle.EXT4,
                       pickle.PERSID, pickle.BINPERSID):
            dispatch[opcode[0]] = self._refuse_opcode(opcode)
        dispatch[pickle.REDUCE[0]] = _guard(pickle._Unpickler.load_reduce, self._check_reduce)
        dispatch[pickle.NEWOBJ[0]] = _guard(pickle._Unpickler.load_newobj, self._check_newobj)
        dispatch[pickle.BUILD[0]] = _guard(pickle._Unpickler.load_build, self._check_build)
        self.dispatch = dispatch

    def _refuse(self, why: str) -> CheckpointRefused:
        return CheckpointRefused(f"{self._source}: {why}; refusing to load it (a checkpoint of this program "
                                 "never holds that: the file was not written by attnres-pp, or was altered)")

    def _refuse_opcode(self, opcode: bytes):
        name = {v: k for k, v in vars(pickle).items() if isinstance(v, bytes) and len(v) == 1}.get(opcode, "?")

        def refuse(_self) -> None:
            raise self._refuse(f"uses the pickle opcode {name}")
        return refuse

    def find_class(self, module: str, name: str):
        if "." in name:
            raise self._refuse(f"names the attribute path {module}:{name}")
        if (module, name) not in ADMITTED:
            raise self._refuse(f"refers to {module}.{name}")
        found = super().find_class(module, name)
        self._callables[id(found)] = (module, name)
        return found

    def _admitted_as(self, obj) -> tuple[str, str] | None:
        return self._callables.get(id(obj))

    def _check_reduce(self) -> None:
        func, args = self.stack[-2], self.stack[-1]
        if self._admitted_as(func) not in _FACTORIES:
            raise self._refuse(f"calls {_describe(func)} (REDUCE)")
        if not isinstance(args, tuple) or not all(_plain(a) for a in args):
            raise self._refuse(f"calls {_describe(func)} with arguments that are not plain data")

    def _check_newobj(self) -> None:
        cls = self.stack[-2]
        if self._admitted_as(cls) not in _CLASSES:
            raise self._refuse(f"constructs {_describe(cls)} (NEWOBJ)")

    def _check_build(self) -> None:
        instance = self.stack[-2]
        if (type(instance).__module__, type(instance).__qualname__) not in _CLASSES:
            raise self._refuse(f"fills in an object of type {type(instance).__qualname__} (BUILD)")


def _guard(load, check):
    def guarded(self) -> None:
        check()
        load(self)
    return guarded


def _plain(value) -> bool:
    """Plain data: what the admitted factories are called with (ints, strings, their tuples)."""
    if isinstance(value, (bool, int, float, str, bytes)) or value is None:
        return True
    return isinstance(value, (tuple, list)) and all(_plain(v) for v in value)


def _describe(obj) -> str:
    name = getattr(obj, "__qualname__", None)
    return f"{getattr(obj, '__module__', '?')}.{name}" if name else f"an object of type {type(obj).__qualname__}"


def load_metadata(path: str | Path):
    """Unpickle the `.metadata` at `path` under the rules above. Returns DCP's `Metadata`; raises
    CheckpointRefused on anything else (a refused name or opcode, a truncated or malformed file)."""
    from torch.distributed.checkpoint.metadata import Metadata

    path = Path(path)
    data = path.read_bytes()
    try:
        metadata = _GuardedUnpickler(io.BytesIO(data), str(path)).load()
    except CheckpointRefused:
        raise
    except (EOFError, pickle.UnpicklingError, IndexError, KeyError, TypeError, ValueError,
            AttributeError, UnicodeDecodeError) as error:
        raise CheckpointRefused(f"{path} is truncated or damaged ({type(error).__name__}: {error}); "
                                "load an earlier checkpoint, or retrain") from None
    if not isinstance(metadata, Metadata):
        raise CheckpointRefused(f"{path} does not hold checkpoint metadata (it unpickles to "
                                f"{type(metadata).__qualname__})")
    return metadata
