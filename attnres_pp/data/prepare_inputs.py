"""The documents of `attnres-pp prepare`'s inputs, streamed one at a time in a fixed order.

An input is a text file (one document), a `.jsonl` file (one document per line, the `text_key`
field), a `.parquet` file (one document per row of the `text_key` column; needs pyarrow) or a
folder, read recursively for the files whose name matches `glob` (sorted by path, so that the
order, and so the split, does not depend on the file system). Empty documents are skipped.

Every problem is an `InputError` naming the file (and the line or byte offset): the command turns
it into its one `error:` line before anything is written.
"""

from __future__ import annotations

import json
import re
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


def find_sources(inputs: list[str], glob: str) -> list[Source]:
    """The files of `inputs` in reading order; InputError for a missing path, an empty folder or no
    matching file at all."""
    sources: list[Source] = []
    for raw in inputs:
        path = Path(raw)
        if path.is_dir():
            found = sorted(p for p in path.rglob(glob) if p.is_file())
            if not found:
                raise InputError(f"--input {raw}: the folder has no file matching --glob {glob!r}")
            sources += [Source(p, _kind(p)) for p in found]
        elif path.is_file():
            sources.append(Source(path, _kind(path)))
        else:
            raise InputError(f"--input {raw} does not exist")
    if any(s.kind == "parquet" for s in sources):
        _pyarrow_parquet()  # before any reading: one missing library refuses the whole command
    return sources


def _pyarrow_parquet():
    try:
        import pyarrow.parquet
    except ImportError:
        raise InputError("a .parquet input needs pyarrow: pip install pyarrow") from None
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


def _text_documents(path: Path, errors: str) -> Iterator[str]:
    yield _decode(path.read_bytes(), errors, str(path))


def _jsonl_documents(path: Path, key: str, errors: str) -> Iterator[str]:
    offset = 0
    with path.open("rb") as lines:
        for number, raw in enumerate(lines, 1):
            where = f"{path} line {number}"
            line = _decode(raw, errors, str(path), offset)
            offset += len(raw)
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise InputError(f"{where} is not JSON: {error.msg}") from None
            if not isinstance(record, dict) or key not in record:
                raise InputError(f"{where} has no {key!r} field (--text-key names it)")
            text = record[key]
            if not isinstance(text, str):
                raise InputError(f"{where}: the {key!r} field is {type(text).__name__}, not a string")
            yield _checked(text, errors, where)


def _parquet_documents(path: Path, key: str, errors: str) -> Iterator[str]:
    parquet = _pyarrow_parquet()
    try:
        table = parquet.ParquetFile(path)
    except Exception as error:  # noqa: BLE001 - pyarrow raises its own exception types
        raise InputError(f"{path} is not a parquet file pyarrow reads: {error}") from None
    if key not in table.schema_arrow.names:
        raise InputError(f"{path} has no column {key!r} (--text-key names it)")
    row = 0
    for batch in table.iter_batches(columns=[key], batch_size=1024):
        for text in batch.column(0).to_pylist():
            row += 1
            if not isinstance(text, str):
                raise InputError(f"{path} row {row}: the {key!r} column is {type(text).__name__}, not a string")
            yield _checked(text, errors, f"{path} row {row}")


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
