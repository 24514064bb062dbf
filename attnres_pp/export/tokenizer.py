"""The run's tokenizer as a transformers tokenizer: its tokenizer.json as trained by `attnres-pp
prepare` (a byte-level BPE) and a tokenizer_config.json naming the fast tokenizer class and the
end-of-text token. A run on raw bytes has no tokenizer to write (ids are bytes 0-255)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from attnres_pp.data.tokenizer import END_OF_TEXT, TOKENIZER_FILE


def tokenizer_source(step_dir: Path) -> Path:
    """The run's copy of tokenizer.json, where `generate.prompts.run_tokenizer` found (and checked) it."""
    candidates = [step_dir.parent.parent / TOKENIZER_FILE, step_dir / TOKENIZER_FILE]
    return next(c for c in candidates if c.is_file())


def write_tokenizer(source: Path, out: Path, *, eot_id: int | None, seq_len: int) -> list[str]:
    shutil.copyfile(source, out / TOKENIZER_FILE)
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": seq_len,
              "eos_token": END_OF_TEXT if eot_id is not None else None, "bos_token": None, "unk_token": None,
              "pad_token": END_OF_TEXT if eot_id is not None else None, "add_prefix_space": False,
              "clean_up_tokenization_spaces": False}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return [TOKENIZER_FILE, "tokenizer_config.json"]
