"""Flag values as the bytes the user typed: argv that is not UTF-8 reaches Python as surrogates."""

from __future__ import annotations

import os

import pytest

from attnres_pp.generate.prompts import argv_bytes, stop_strings


def test_argv_bytes_that_are_not_utf8_are_the_bytes_given():
    typed = b"caf\xe9 \xff"  # Latin-1 text from a terminal: not UTF-8
    as_python_sees_it = os.fsdecode(typed)  # what sys.argv holds (surrogateescape)
    assert "\udce9" in as_python_sees_it
    assert argv_bytes("--prompt", as_python_sees_it) == typed
    assert argv_bytes("--prompt", "caf\u00e9") == "caf\u00e9".encode()  # UTF-8 text stays UTF-8
    assert stop_strings([os.fsdecode(b"\xfe")]) == (b"\xfe",)


def test_a_surrogate_no_byte_maps_to_names_the_flag():
    with pytest.raises(ValueError, match=r"^--stop holds '\\ud800' at character 2"):
        argv_bytes("--stop", "ab\ud800")
