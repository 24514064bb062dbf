"""The prompts of `attnres-pp generate`, from its flags to token ids, and new tokens back to text.

Exactly one source gives them:
- `--prompt TEXT`, repeatable: each one prompt, as UTF-8 bytes;
- `--prompt-file FILE`: the whole file's bytes are one prompt (newlines included);
- `--prompts-file FILE`: one prompt per line (the line's bytes, without its line ending), or, for a
  file named `*.jsonl`, one JSON object `{"prompt": "..."}` per line (UTF-8), for prompts that hold
  newlines. A blank line is a mistake in either form (it would be an empty prompt).
Tokens are bytes unless the run trained on a BPE data folder: then the prompt (UTF-8 text) is
encoded, and new tokens decoded, with the run's tokenizer (`run_tokenizer`: the copy of
tokenizer.json in the run directory, checked against the sha256 its checkpoint records). Every
mistake is a ValueError saying what to fix.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from attnres_pp.data.tokenizer import BYTES, TOKENIZER_FILE, Tokenizer

SOURCES = "--prompt TEXT (repeatable), --prompt-file FILE or --prompts-file FILE"


def read_prompts(args: argparse.Namespace) -> list[bytes]:
    """The prompts the flags give, in order; ValueError if none, several sources, or a bad file."""
    given = [flag for flag, value in (("--prompt", args.prompt), ("--prompt-file", args.prompt_file),
                                      ("--prompts-file", args.prompts_file)) if value is not None]
    if len(given) != 1:
        both = f" (got {' and '.join(given)})" if given else ""
        raise ValueError(f"give the prompt with exactly one of {SOURCES}{both}")
    if args.prompt is not None:
        return [argv_bytes("--prompt", text) for text in args.prompt]
    if args.prompt_file is not None:
        return [_read("--prompt-file", args.prompt_file)]
    return parse_prompts_file(args.prompts_file, _read("--prompts-file", args.prompts_file))


def argv_bytes(flag: str, text: str) -> bytes:
    """A flag's value as the bytes the user gave. Python decodes argv with surrogateescape, so bytes
    that are not UTF-8 (e.g. `--prompt $'\\xff'`) arrive as lone surrogates that `encode("utf-8")`
    refuses; `os.fsencode` gives those bytes back. A surrogate that no byte maps to is refused
    naming the flag."""
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError:
        pass
    try:
        return os.fsencode(text)
    except UnicodeEncodeError as error:
        raise ValueError(f"{flag} holds {text[error.start]!r} at character {error.start}, a lone surrogate that is "
                         f"no text: give {flag} as UTF-8 text or bytes") from None


def _read(flag: str, path: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as error:
        raise ValueError(f"{flag} {path}: cannot read it ({error.strerror})") from None


def parse_prompts_file(path: str, data: bytes) -> list[bytes]:
    """The prompts of a `--prompts-file`: one per line, or one JSON object per line for `*.jsonl`."""
    lines = data.split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()  # the final line ending ends a line; it does not start an empty one
    if not lines:
        raise ValueError(f"--prompts-file {path} holds no prompts: give one prompt per line")
    jsonl = path.endswith(".jsonl")
    prompts = []
    for number, line in enumerate(lines, start=1):
        line = line.removesuffix(b"\r")
        if not line.strip():
            raise ValueError(f"--prompts-file {path} line {number} is blank: every line is one prompt "
                             "(remove the blank line)")
        prompts.append(_json_prompt(path, number, line) if jsonl else line)
    return prompts


def _json_prompt(path: str, number: int, line: bytes) -> bytes:
    where = f"--prompts-file {path} line {number}"
    try:
        record = json.loads(line.decode("utf-8"))
    except UnicodeDecodeError:
        raise ValueError(f"{where} is not UTF-8: a .jsonl file is UTF-8 JSON, one object per line") from None
    except json.JSONDecodeError as error:
        raise ValueError(f"{where} is not JSON ({error.msg} at column {error.colno}): write one "
                         '{"prompt": "..."} object per line') from None
    if not isinstance(record, dict) or not isinstance(record.get("prompt"), str):
        raise ValueError(f'{where} is not an object with a "prompt" string: write one {{"prompt": "..."}} '
                         "object per line")
    return record["prompt"].encode("utf-8")


def prompt_tokens(prompt: bytes, vocab_size: int, which: str = "") -> list[int]:
    """The prompt's bytes as token ids; ValueError if it is empty or a byte is outside the vocabulary.
    `which` names the prompt in the message when there are several (e.g. "prompt 2: ")."""
    if not prompt:
        raise ValueError(f"{which}the prompt is empty: give at least one byte with {SOURCES}")
    for offset, byte in enumerate(prompt):
        if byte >= vocab_size:
            raise ValueError(f"{which}prompt byte {byte:#04x} at offset {offset} is outside the model's vocabulary "
                             f"of {vocab_size} tokens: use bytes below {vocab_size} (e.g. ASCII text)")
    return list(prompt)


def stop_strings(values: list[str] | None) -> tuple[bytes, ...]:
    """The `--stop S` strings as UTF-8 bytes; ValueError for an empty one."""
    if any(value == "" for value in values or ()):
        raise ValueError("--stop needs a non-empty string: the text that ends a sequence")
    return tuple(argv_bytes("--stop", value) for value in values or ())


def decode_text(tokens: list[int]) -> str:
    """Bytes to text (invalid UTF-8, or ids past 255 from a non-byte vocabulary, become U+FFFD)."""
    return b"".join(bytes([t]) if t < 256 else b"\xef\xbf\xbd" for t in tokens).decode("utf-8", errors="replace")


def run_tokenizer(step_dir: Path, meta: dict) -> Tokenizer:
    """The tokenizer of the run that wrote checkpoint `step_dir` (with meta.json `meta`): raw bytes
    unless its data position names a BPE tokenizer's sha256, which the run directory's copy of
    tokenizer.json must have (a checkpoint folder on its own is looked for beside it too)."""
    sha = meta.get("data_position", {}).get("tokenizer_sha256")
    if sha is None or sha == BYTES:
        return Tokenizer.raw_bytes()
    step_dir = Path(step_dir)
    candidates = [step_dir.parent.parent / TOKENIZER_FILE, step_dir / TOKENIZER_FILE]
    found = next((c for c in candidates if c.is_file()), None)
    if found is None:
        raise ValueError(f"checkpoint {step_dir} was trained with a BPE tokenizer (sha256 {sha[:12]}..) but there "
                         f"is no {candidates[0]}: copy its data folder's tokenizer.json there")
    tokenizer = Tokenizer.load(found)
    if tokenizer.sha256 != sha:
        raise ValueError(f"{found} has sha256 {tokenizer.sha256[:12]}.., not the {sha[:12]}.. the checkpoint was "
                         "trained with: put that run's tokenizer.json there")
    return tokenizer


def encode_prompt(prompt: bytes, tokenizer: Tokenizer, vocab_size: int, which: str = "") -> list[int]:
    """The prompt's token ids: its bytes for a byte run (`prompt_tokens`), its UTF-8 text encoded by a
    BPE `tokenizer`; ValueError if it is empty, not UTF-8 (BPE) or an id is outside the vocabulary."""
    if tokenizer.kind == BYTES:
        return prompt_tokens(prompt, vocab_size, which)
    if not prompt:
        raise ValueError(f"{which}the prompt is empty: give at least one character with {SOURCES}")
    try:
        text = prompt.decode("utf-8")
    except UnicodeDecodeError as error:
        raise ValueError(f"{which}the prompt is not UTF-8 (byte {prompt[error.start]:#04x} at offset {error.start}): "
                         "this run's tokenizer reads text; give the prompt as UTF-8") from None
    ids = tokenizer.encode(text)
    if not ids:
        raise ValueError(f"{which}the prompt encodes to no tokens: give some text with {SOURCES}")
    if max(ids) >= vocab_size:
        raise ValueError(f"{which}the prompt encodes to token {max(ids)}, outside the model's vocabulary of "
                         f"{vocab_size}: the run's tokenizer.json is not the model's")
    return ids


def text_stops(stops: tuple[bytes, ...], which: str = "--stop") -> tuple[str, ...]:
    """The stop strings as text, for a run whose tokens are not bytes (stops match its decoded text)."""
    try:
        return tuple(s.decode("utf-8") for s in stops)
    except UnicodeDecodeError:
        raise ValueError(f"{which} must be UTF-8 text for a run with a BPE tokenizer (it stops on the decoded "
                         "text)") from None
