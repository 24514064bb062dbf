"""`attnres-pp bench inference` end to end on a tiny model with the in-process pipeline (no rank
processes): the JSON keys of the contract, the result files, and the markdown table."""

from __future__ import annotations

import functools
import json

import pytest

import attnres_pp.bench.inference as inference
from attnres_pp.cli import build_parser, main


@pytest.fixture
def tiny(monkeypatch):
    monkeypatch.setattr(inference, "MODEL", {"vocab_size": 32, "n_layers": 4, "d_model": 16, "n_heads": 2,
                                             "seq_len": 16})
    monkeypatch.setattr(inference, "PROMPT_TOKENS", 8)
    monkeypatch.setattr(inference, "NEW_TOKENS", 4)
    monkeypatch.setattr(inference, "PREFILL_CHUNK", 3)
    monkeypatch.setattr(inference, "PIPELINE", {"stages": 2, "virtual": 2, "launcher": "inprocess"})
    # One profile per variant, not the best of three: the op counts asserted below are exact in any
    # attempt (the attempts only pick the quickest timing), and each profile costs about a CPU-second.
    monkeypatch.setattr(inference, "profile_decode_step",
                        functools.partial(inference.profile_decode_step, attempts=1))


def test_bench_inference_parses():
    args = build_parser().parse_args(["bench", "inference", "--quick", "--json"])
    assert (args.name, args.quick, args.json) == ("inference", True, True)


def test_bench_inference_quick_writes_ratios_and_files(tiny, tmp_path, capsys):
    assert main(["bench", "inference", "--quick", "--json", "--out", str(tmp_path)]) == 0
    payload = json.loads(capsys.readouterr().out)
    assert payload["prefill_ratio"] > 0 and payload["decode_ratio"] > 0
    for setting in ("single_process", "pipelined"):
        result = payload[setting]
        assert set(result["variants"]) == {"standard", "block"}
        assert len(result["variants"]["block"]["decode_s_all"]) == payload["rounds"]
        assert result["variants"]["standard"]["prefill_tokens_per_s"] > 0
    assert payload["prefill_ratio"] == payload["pipelined"]["prefill_ratio"]
    assert payload["profile_decode_step"]["totals"]["block"]["ops_per_token"] > \
        payload["profile_decode_step"]["totals"]["standard"]["ops_per_token"]
    assert payload["command"] == "attnres-pp bench inference --quick --out " + str(tmp_path)
    stems = {p.name.rsplit(".", 1)[0] for p in tmp_path.iterdir() if p.name.startswith("inference_quick_")}
    assert len(stems) == 1
    markdown = (tmp_path / f"{stems.pop()}.md").read_text()
    assert "ratio Block / standard" in markdown and "Command: `attnres-pp bench inference --quick" in markdown
