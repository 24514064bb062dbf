"""The documents of `attnres-pp prepare`'s inputs, streamed one at a time in a fixed order.

An input is a text file (one document), a `.jsonl` file (one document per line, the `text_key`
field), a `.parquet` file (one document per row of the string column `text_key`, read a batch of
rows at a time; a null row is an empty document; needs pyarrow) or a
folder, read recursively for the files whose name matches `glob` (sorted by path, so that the
order, and so the split, does not depend on the file system). Empty documents are skipped.

Every problem is an `InputError` naming the file (and the line or byte offset): the command turns
it into its one `error:` line before anything is written.
"""

from __future__ import annotations

import errno
import itertools
import json
import os
import re
import stat
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

_SURROGATE = re.compile("[\ud800-\udfff]")


class InputError(ValueError):
    """An input that cannot be read as documents; the message names the file."""


@dataclass(frozen=True)
class Source:
    path: Path
    kind: str  # "text", "jsonl" or "parquet"


def _kind(path: Path) -> str:
    suffix = path.suffix.lower()
    return {".jsonl": "jsonl", ".parquet": "parquet"}.get(suffix, "text")


def find_sources(inputs: list[str], glob: str, warn=None) -> list[Source]:
    """The files of `inputs` in reading order; InputError for a missing path, an empty folder, no
    matching file at all, or an input that is no regular file (named for what it is: a FIFO, a
    symlink loop, ...). Inside a folder such a path is skipped with `warn(line)` (default: a
    `warning:` line on stderr) rather than read: a FIFO would wait for a writer forever."""
    warn = warn or (lambda line: print(line, file=sys.stderr, flush=True))
    sources: list[Source] = []
    for raw in inputs:
        path = Path(raw)
        what = _not_a_file(path)
        if what == "a folder":
            found = []
            for match in sorted(path.rglob(glob)):
                inner = _not_a_file(match)
                if inner is None:
                    found.append(match)
                elif inner != "a folder":  # a folder matching the glob is walked by rglob itself
                    warn(f"warning: --input {raw}: skipped {match}: it is {inner}, not a regular file")
            if not found:
                raise InputError(f"--input {raw}: the folder has no file matching --glob {glob!r}")
            sources += [Source(p, _kind(p)) for p in found]
        elif what is None:
            sources.append(Source(path, _kind(path)))
        elif what == _MISSING:
            raise InputError(f"--input {raw} does not exist")
        else:
            raise InputError(f"--input {raw} is {what}, not a regular file or folder: give a file or a folder")
    if any(s.kind == "parquet" for s in sources):
        _pyarrow_parquet()  # before any reading: one missing library refuses the whole command
    return sources


_MISSING = "missing"


def _not_a_file(path: Path) -> str | None:
    """None for a regular file (or a symlink to one), else what `path` is, for a message."""
    try:
        mode = path.stat().st_mode
    except OSError as error:
        if error.errno == errno.ELOOP:
            return "a symlink loop"
        if error.errno == errno.ENOENT:
            return "a symlink to nothing" if path.is_symlink() else _MISSING
        return f"unreadable ({error.strerror})"
    if stat.S_ISREG(mode):
        return None
    kinds = {stat.S_ISDIR: "a folder", stat.S_ISFIFO: "a FIFO (named pipe)", stat.S_ISSOCK: "a socket",
             stat.S_ISCHR: "a character device", stat.S_ISBLK: "a block device"}
    return next((name for test, name in kinds.items() if test(mode)), "not a regular file")


PYARROW_HINT = "pip install pyarrow (or pip install 'attnres-pp[data]')"
# Rows handed over at a time: pyarrow reads the file a row group at a time, so memory stays at a
# row group's column chunk and one batch of Python strings, whatever the file's size.
PARQUET_BATCH_ROWS = 1024


def _pyarrow_parquet():
    try:
        import pyarrow.parquet
    except ImportError:
        raise InputError(f"a .parquet input needs pyarrow: {PYARROW_HINT}") from None
    return pyarrow.parquet


def _decode(data: bytes, errors: str, where: str, offset: int = 0) -> str:
    try:
        return data.decode("utf-8", errors=errors)
    except UnicodeDecodeError as error:
        raise InputError(f"{where} is not UTF-8 at byte offset {offset + error.start} "
                         "(--errors replace substitutes U+FFFD)") from None


def _checked(text: str, errors: str, where: str) -> str:
    """`text` that encodes to UTF-8: a JSON string may hold a lone surrogate ("\\ud800"), no character."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        if errors == "strict":
            raise InputError(f"{where} holds a lone surrogate, no UTF-8 character "
                             "(--errors replace substitutes U+FFFD)") from None
        return _SURROGATE.sub("\ufffd", text)
    return text


def _open_regular(path: Path):
    """`path` opened for reading in binary, only if it is (still) a regular file: opened without
    blocking and checked on the descriptor, so a FIFO swapped in after `find_sources` is refused,
    not waited on. InputError naming the file for what cannot be read."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as error:
        raise InputError(f"{path} cannot be read: {error.strerror}") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise InputError(f"{path} is no longer a regular file: give a file or a folder")
    return os.fdopen(fd, "rb")


def _reading(path: Path, read):
    """`read()` with a read error (EIO, a file gone on a network mount) as one InputError line."""
    try:
        return read()
    except OSError as error:
        raise InputError(f"{path} cannot be read: {error.strerror or error}") from None


def _text_documents(path: Path, errors: str) -> Iterator[str]:
    with _open_regular(path) as file:
        data = _reading(path, file.read)
    yield _decode(data, errors, str(path))


def _jsonl_documents(path: Path, key: str, errors: str) -> Iterator[str]:
    offset = 0
    with _open_regular(path) as file:
        lines = iter(file)
        for number in itertools.count(1):
            raw = _reading(path, lambda: next(lines, None))
            if raw is None:
                return
            where = f"{path} line {number}"
            line = _decode(raw, errors, str(path), offset)
            offset += len(raw)
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise InputError(f"{where} is not JSON: {error.msg}") from None
            except RecursionError:  # json's C parser recurses per level: 100,000 brackets overflow it
                raise InputError(f"{where} is nested too deeply to be a record (give one object per line "
                                 f"with a {key!r} string)") from None
            if not isinstance(record, dict) or key not in record:
                raise InputError(f"{where} has no {key!r} field (--text-key names it)")
            text = record[key]
            if not isinstance(text, str):
                raise InputError(f"{where}: the {key!r} field is {type(text).__name__}, not a string")
            yield _checked(text, errors, where)


def _is_text(arrow_type) -> bool:
    import pyarrow as pa

    if pa.types.is_dictionary(arrow_type):
        arrow_type = arrow_type.value_type
    return (pa.types.is_string(arrow_type) or pa.types.is_large_string(arrow_type)
            or getattr(pa.types, "is_string_view", lambda t: False)(arrow_type))


def _column_texts(column, errors: str, path: Path, row: int) -> list[str | None]:
    """A batch's strings; a parquet string column may hold bytes that are not UTF-8 (pyarrow does
    not check them on reading): refused naming the row, or decoded with U+FFFD (`--errors replace`)."""
    try:
        return column.to_pylist()
    except UnicodeDecodeError:
        import pyarrow as pa

        if pa.types.is_dictionary(column.type):
            column = column.dictionary_decode()
        raw = column.cast(pa.large_binary()).to_pylist()
        return [None if data is None else _decode(data, errors, f"{path} row {row + i + 1}")
                for i, data in enumerate(raw)]


def _parquet_documents(path: Path, key: str, errors: str) -> Iterator[str]:
    """The `key` column's rows, in file order, a batch of rows at a time (never the whole file); a
    null row is an empty document (skipped)."""
    parquet = _pyarrow_parquet()
    try:
        file = parquet.ParquetFile(path)
    except Exception as error:  # noqa: BLE001 - pyarrow raises its own exception types
        raise InputError(f"{path} is not a parquet file pyarrow reads: {error}") from None
    try:
        schema = file.schema_arrow
        if key not in schema.names:
            raise InputError(f"{path} has no column {key!r} (--text-key names it; its columns: "
                             f"{', '.join(schema.names) or 'none'})")
        column_type = schema.field(key).type
        if not _is_text(column_type):
            raise InputError(f"{path}: the column {key!r} is {column_type}, not a string column")
        row = 0
        batches = file.iter_batches(batch_size=PARQUET_BATCH_ROWS, columns=[key], use_threads=False)
        while True:
            try:
                batch = next(batches, None)
            except Exception as error:  # noqa: BLE001 - a damaged row group, a bad page
                raise InputError(f"{path} after row {row}: pyarrow cannot read it: {error}") from None
            if batch is None:
                return
            texts = _column_texts(batch.column(0), errors, path, row)
            for text in texts:
                row += 1
                if text is not None:
                    yield _checked(text, errors, f"{path} row {row}")
    finally:
        file.close()


def documents(sources: list[Source], text_key: str, errors: str) -> Iterator[str]:
    """Every non-empty document of `sources`, in order."""
    for source in sources:
        if source.kind == "jsonl":
            stream = _jsonl_documents(source.path, text_key, errors)
        elif source.kind == "parquet":
            stream = _parquet_documents(source.path, text_key, errors)
        else:
            stream = _text_documents(source.path, errors)
        for text in stream:
            if text:
                yield text
