"""`simulate memory` knows V-Half and V-Min (it reads the schedule's order as data): its prediction
holds to what an in-process run counts, and the counted activation peak falls against ZB-V's as the
activations held say (P = 3: 4 of ZB-V's 6 half-rank sets under either schedule)."""

from __future__ import annotations

import json

import pytest

from attnres_pp.cli import main

MODEL = ["--layers", "6", "--d-model", "32", "--heads", "2", "--seq-len", "32", "--vocab-size", "256",
         "--residual", "attnres", "--block-size", "3"]


def _layout(schedule: str) -> list[str]:
    return ["--schedule", schedule, "--stages", "3", "--virtual", "2", "--microbatches", "6", "--dtype", "fp32"]


def _counted_and_predicted(schedule: str, out, capsys) -> tuple[list[dict], list[dict]]:
    assert main(["train", "--steps", "1", "--launcher", "inprocess", "--device", "cpu", "--threads", "1", "--quiet",
                 "--batch-size", "6", "--cache", "on", "--eval-every", "0", "--out", str(out), *MODEL,
                 *_layout(schedule)]) == 0
    counted = json.loads((out / "summary.json").read_text())["memory_per_rank"]
    capsys.readouterr()
    assert main(["simulate", "memory", "--json", "--tokens", "32", *MODEL, *_layout(schedule)]) == 0
    return counted, json.loads(capsys.readouterr().out)["memory_per_rank"]


def test_predicted_against_a_run_and_below_zbv_s(tmp_path, capsys):
    peaks = {}
    for schedule in ("zbv", "v_half", "v_min"):
        counted, predicted = _counted_and_predicted(schedule, tmp_path / schedule, capsys)
        assert len(counted) == len(predicted) == 3
        for got, want in zip(counted, predicted, strict=True):
            for key in ("param_bytes", "grad_bytes", "optimizer_bytes", "cache_peak_bytes"):
                assert got[key] == want[key], (schedule, key)
            assert want["activation_peak_bytes"] == pytest.approx(got["activation_peak_bytes"], rel=0.05), schedule
        peaks[schedule] = max(r["activation_peak_bytes"] for r in counted)
    for schedule in ("v_half", "v_min"):
        assert peaks[schedule] <= (4 / 6 + 0.1) * peaks["zbv"], peaks
