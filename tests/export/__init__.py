"""Tests of `attnres-pp export` and `train --init-from` against transformers itself.

Set before any test module imports transformers: local folders only (never the Hub), and the code of
remote-code folders copied into a folder of this process rather than the user's cache."""

import os
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_MODULES_CACHE", tempfile.mkdtemp(prefix="hf-modules-"))
