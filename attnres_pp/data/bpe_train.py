"""`attnres-pp prepare`'s second pass: training the byte-level BPE on the documents, bounded.

Two bounds keep hostile text from stalling or killing it:

- the vocabulary (`MAX_BPE_VOCAB`): the trainer allocates about 66 bytes per id before it reads
  anything (2^26 ids asked for 4.4 GB; 2^31 ended in a Rust allocation abort), and a tokenizer.json
  of more ids than 2^24 outgrows the 256 MiB a tokenizer file may hold (`tokenizer.MAX_TOKENIZER_BYTES`,
  at least ~16 bytes an id for its vocabulary entry and its merge);
- the words: the trainer's pre-tokenizer makes one word of a run without whitespace (or of
  whitespace), and its merges cost about the square of a word's length (a 100 KB run of letters: 8 s,
  1 MB: minutes). Runs longer than `MAX_TRAIN_RUN` characters are cut into pieces of that length,
  each handed to the trainer as a text of its own. Only the training sees the pieces; the encoding
  reads the documents whole, so the ids are the library's for the trained merges.

The trainer runs in a thread of its own while this one waits in short slices, so Ctrl-C stops the
command within a fraction of a second even while the library merges (it never returns to Python
then); the abandoned thread ends with the process."""

from __future__ import annotations

import re
import threading
from collections.abc import Iterable, Iterator

from attnres_pp.data.tokenizer import END_OF_TEXT, _tokenizers_module

MAX_BPE_VOCAB = 2**24
MAX_TRAIN_RUN = 256
# A run start (no character of its class before it) followed by more than MAX_TRAIN_RUN of its class:
# the lookbehinds make a failed attempt cost one step, so a scan stays linear in the text.
_LONG_RUN = re.compile(rf"(?<!\S)\S{{{MAX_TRAIN_RUN + 1},}}|(?<!\s)\s{{{MAX_TRAIN_RUN + 1},}}")
# How often the waiting thread looks up from the trainer (and so how soon Ctrl-C is honoured).
WAIT_SLICE_S = 0.1


def training_pieces(texts: Iterable[str]) -> Iterator[str]:
    """`texts` with every run of more than MAX_TRAIN_RUN non-white (or white) characters cut into
    pieces of at most MAX_TRAIN_RUN, each yielded on its own; the text around them as it is."""
    for text in texts:
        if len(text) <= MAX_TRAIN_RUN or _LONG_RUN.search(text) is None:
            yield text
            continue
        start = 0
        for run in _LONG_RUN.finditer(text):
            if run.start() > start:
                yield text[start:run.start()]
            for piece in range(run.start(), run.end(), MAX_TRAIN_RUN):
                yield text[piece:min(piece + MAX_TRAIN_RUN, run.end())]
            start = run.end()
        if start < len(text):
            yield text[start:]


def train_bpe(texts: Iterable[str], vocab_size: int, *, progress: bool = False) -> bytes:
    """The tokenizer.json of a byte-level BPE of `vocab_size` ids (END_OF_TEXT among them, at most
    MAX_BPE_VOCAB) trained on `texts` (long runs cut, `training_pieces`). It may have fewer ids than
    asked when the text has fewer pairs to merge. `progress`: the library's progress bars."""
    if vocab_size > MAX_BPE_VOCAB:
        raise ValueError(f"a BPE of {vocab_size} ids is above the {MAX_BPE_VOCAB:,} this trainer allows")
    tokenizers = _tokenizers_module()
    bpe = tokenizers.Tokenizer(tokenizers.models.BPE())
    bpe.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[END_OF_TEXT], show_progress=progress,
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
    _interruptible(lambda: bpe.train_from_iterator(training_pieces(texts), trainer=trainer))
    return bpe.to_str().encode("utf-8")


def _interruptible(work) -> None:
    """Run `work()` in a daemon thread, waiting in WAIT_SLICE_S slices so that a KeyboardInterrupt
    reaches this thread at once; the work's own exception is raised here."""
    failure: list[BaseException] = []

    def run() -> None:
        try:
            work()
        except BaseException as error:  # noqa: BLE001  (raised again on the waiting thread)
            failure.append(error)

    thread = threading.Thread(target=run, name="bpe-trainer", daemon=True)
    thread.start()
    while thread.is_alive():
        thread.join(WAIT_SLICE_S)
    if failure:
        raise failure[0]
