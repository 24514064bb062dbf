"""The text <-> token-id map of a run: raw bytes (ids 0-255, no file) or a byte-level BPE trained by
`attnres-pp prepare` with the Hugging Face `tokenizers` library (the `data` extra) and stored as the
data folder's `tokenizer.json`.

A tokenizer is named by its `sha256` (of the file's bytes; "bytes" for raw bytes): a run records it,
and a resume or a generation with another tokenizer is refused. `tokenizers` is imported only when a
BPE file is loaded, so byte runs need no extra.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path

BYTES = "bytes"
TOKENIZER_FILE = "tokenizer.json"
# The document separator of a BPE vocabulary: a special token, never produced from text.
END_OF_TEXT = "<|endoftext|>"
# tokenizer.json is a few MB for the vocabularies uint32 ids allow; a file far larger is not one.
MAX_TOKENIZER_BYTES = 256 * 2**20


def _tokenizers_module():
    try:
        import tokenizers
    except ImportError:
        raise ValueError("a BPE tokenizer needs the Hugging Face `tokenizers` library: "
                         "pip install 'attnres-pp[data]' (or pip install tokenizers)") from None
    return tokenizers


@dataclass(frozen=True)
class Tokenizer:
    """`kind` "bytes" or "bpe"; `sha256` names it; `vocab_size` counts every id (specials too);
    `eot_id` the document separator (None for bytes: documents are joined by a newline byte)."""

    kind: str
    sha256: str
    vocab_size: int
    eot_id: int | None
    _bpe: object = field(default=None, repr=False, compare=False)

    @classmethod
    def raw_bytes(cls) -> Tokenizer:
        return cls(BYTES, BYTES, 256, None)

    @classmethod
    def from_json_bytes(cls, data: bytes, source: str = TOKENIZER_FILE) -> Tokenizer:
        """A BPE tokenizer from the contents of a tokenizer.json (parsed by `tokenizers`, which runs
        no code from it)."""
        if len(data) > MAX_TOKENIZER_BYTES:
            raise ValueError(f"{source} is {len(data):,} bytes, more than a tokenizer file holds "
                             f"({MAX_TOKENIZER_BYTES:,}): it is not one")
        tokenizers = _tokenizers_module()
        try:
            bpe = tokenizers.Tokenizer.from_str(data.decode("utf-8"))
        except Exception as error:  # noqa: BLE001 - the library raises its own exception types
            raise ValueError(f"{source} is not a tokenizer file the `tokenizers` library reads: "
                             f"{' '.join(str(error).split())[:200]}") from None
        eot_id = bpe.token_to_id(END_OF_TEXT)
        return cls("bpe", hashlib.sha256(data).hexdigest(), bpe.get_vocab_size(with_added_tokens=True), eot_id, bpe)

    @classmethod
    def load(cls, path: str | Path) -> Tokenizer:
        """From a tokenizer.json file, or from a data folder holding one (raw bytes if it has none)."""
        path = Path(path)
        if path.is_dir():
            path = path / TOKENIZER_FILE
            if not path.exists():
                return cls.raw_bytes()
        try:
            data = path.read_bytes()
        except OSError as error:
            raise ValueError(f"cannot read the tokenizer {path}: {error.strerror or error}") from None
        return cls.from_json_bytes(data, str(path))

    def encode(self, text: str) -> list[int]:
        if self._bpe is None:
            return list(text.encode("utf-8"))
        return self._bpe.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Many documents at once (the library encodes them on every core)."""
        if self._bpe is None:
            return [list(t.encode("utf-8")) for t in texts]
        return [e.ids for e in self._bpe.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: list[int]) -> str:
        """Text of `ids`; bytes that are not whole UTF-8 characters become U+FFFD."""
        if self._bpe is None:
            return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")
        return self._bpe.decode(list(ids), skip_special_tokens=False)
