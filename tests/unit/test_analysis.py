"""`attnres-pp analyze` and `attnres-pp plot` end to end on tiny runs: a checkpoint written by a
pipelined run loads in one process (its held-out loss equals the run's own evaluation), the JSON
has one row per reading site whose weights sum to 1, the PNGs are written; bad input is one line."""

from __future__ import annotations

import json

import pytest

from attnres_pp.analysis.plot_cli import describe_model, run_curves
from attnres_pp.cli import main

TINY = ["--layers", "2", "--d-model", "16", "--heads", "2", "--seq-len", "16", "--batch-size", "4",
        "--microbatches", "2", "--steps", "4", "--eval-every", "2", "--checkpoint-every", "2", "--quiet",
        "--lr", "0.02"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    block, standard = root / "block", root / "standard"
    assert main(["train", "--launcher", "inprocess", "--stages", "2", *TINY, "--residual", "msar", "--blocks", "3",
                 "--out", str(block)]) == 0
    assert main(["train", "--launcher", "local", *TINY, "--residual", "standard", "--out", str(standard)]) == 0
    return block, standard


def test_analyze_a_pipelined_checkpoint_in_one_process(runs, capsys, tmp_path):
    block, standard = runs
    out = tmp_path / "analysis"
    assert main(["analyze", str(block), "--checkpoint", "step_2", "--batches", "4", "--baseline", str(standard),
                 "--out", str(out), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result == json.loads((out / "routing.json").read_text())
    # The run evaluated the same 4 held-out batches after step 2 with the weights step_2 holds.
    run_val = next(json.loads(line) for line in (block / "metrics.jsonl").read_text().splitlines()
                   if json.loads(line)["step"] == 1)["val_loss"]
    assert result["val_loss"] == pytest.approx(run_val, rel=1e-5)
    assert result["checkpoint"] == "step_2" and result["block_ends"] == [2, 3, 4]
    sites = result["sites"]
    assert [s["site"] for s in sites] == list(range(5))
    for site in sites:
        assert len(site["weights"]) == 4  # MSAR: one list per stream
        for stream in site["weights"]:
            assert len(stream) == len(site["sources"]) and sum(stream) == pytest.approx(1.0, abs=1e-6)  # fp32 lse1
        assert len(site["gate_means"]) == 4 and site["entropy"] >= -1e-9 and 0 < site["top1_mass"] <= 1
    assert sites[1]["sources"] == ["b0", "p1"] and sites[3]["sources"] == ["b0", "b1", "b2"]
    assert len(result["baseline"]["sites"]) == 5 and "weights" not in result["baseline"]["sites"][0]
    names = sorted(p.rsplit("/", 1)[-1] for p in result["pngs"])
    assert names == ["dilution.png", "entropy.png", "gates.png", "heatmap.png"]
    assert all((out / n).stat().st_size > 1000 for n in names)


def test_analyze_defaults_to_the_newest_checkpoint_and_prints_a_table(runs, capsys):
    _block, standard = runs
    assert main(["analyze", str(standard)]) == 0
    printed = capsys.readouterr().out
    assert "step_4" in printed and (standard / "analysis" / "dilution.png").is_file()


@pytest.mark.parametrize("extra,message", [
    (["--checkpoint", "step_9"], "--checkpoint step_9: "),
    (["--checkpoint", "latest"], "--checkpoint 'latest' is invalid"),
    (["--batches", "0"], "--batches 0 is invalid"),
    (["--batches", "two"], "--batches 'two' is invalid"),
])
def test_analyze_bad_input_is_one_error_line(runs, capsys, extra, message):
    assert main(["analyze", str(runs[0]), *extra]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {message}") and err.count("\n") == 1


def test_analyze_a_run_without_checkpoints_says_how_to_get_one(tmp_path, capsys):
    assert main(["analyze", str(tmp_path)]) == 2
    assert "a run saves its last step" in capsys.readouterr().err


def test_plot_draws_several_runs(runs, tmp_path, capsys):
    out = tmp_path / "plots" / "runs.png"
    assert main(["plot", *map(str, runs), "--out", str(out)]) == 0
    assert out.stat().st_size > 1000
    curve = run_curves(runs[0])
    assert curve["tokens"] == [64, 128, 192, 256] and len(curve["val_loss"]) == 2
    assert curve["label"] == "block: msar N=3 blocks, 2 layers, d 16"
    assert describe_model({"residual": "standard", "n_layers": 2, "d_model": 16}) == "standard, 2 layers, d 16"
    assert main(["plot", str(tmp_path / "nothing")]) == 2
    assert "has no metrics.jsonl" in capsys.readouterr().err
