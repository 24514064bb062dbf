"""`--log-routing-every K` and `--tensorboard DIR`: routing scalars computed by the ranks that own the
sites equal the single process's; the TensorBoard events hold the numbers of metrics.jsonl."""

from __future__ import annotations

import pytest

from attnres_pp.cli import main
from tests.run_helpers import metrics

TINY = ["--layers", "4", "--d-model", "16", "--heads", "2", "--seq-len", "16", "--batch-size", "4",
        "--microbatches", "2", "--steps", "4", "--eval-every", "2", "--quiet", "--lr", "0.02"]


@pytest.mark.parametrize("model", [["--residual", "attnres", "--blocks", "3"], ["--residual", "msar", "--blocks", "5"]],
                         ids=["block", "msar"])
def test_pipelined_routing_scalars_equal_single_process(tmp_path, model):
    single, piped = tmp_path / "single", tmp_path / "piped"
    common = [*TINY, *model, "--log-routing-every", "2"]
    assert main(["train", "--launcher", "local", *common, "--out", str(single)]) == 0
    assert main(["train", "--launcher", "inprocess", "--stages", "2", "--virtual", "2", "--schedule",
                 "interleaved_1f1b", *common, "--out", str(piped)]) == 0
    want, got = metrics(single), metrics(piped)
    n_sites = 2 * 4 + 1
    for step in (1, 3):
        assert len(want[step]["routing_entropy"]) == len(got[step]["routing_embedding_weight"]) == n_sites
        assert got[step]["routing_entropy"] == pytest.approx(want[step]["routing_entropy"], rel=1e-4, abs=1e-6)
        assert got[step]["routing_embedding_weight"] == pytest.approx(want[step]["routing_embedding_weight"],
                                                                      rel=1e-4, abs=1e-6)
        assert want[step]["routing_embedding_weight"][0] == pytest.approx(1.0)  # site 0 reads the embedding only
    assert all("routing_entropy" not in want[step] for step in (0, 2))
    # The queries moved off zero: some site no longer reads a plain mean of its sources.
    assert any(abs(w - 1 / (j + 1)) > 1e-4 for j, w in enumerate(want[3]["routing_embedding_weight"][1:], 1))


def test_log_routing_every_is_refused_for_the_standard_residual(tmp_path, capsys):
    code = main(["train", "--launcher", "local", *TINY, "--residual", "standard", "--log-routing-every", "2",
                 "--out", str(tmp_path / "run")])
    assert code == 2
    assert capsys.readouterr().err.startswith("error: --log-routing-every needs a depth-attention residual")


def test_tensorboard_events_equal_metrics_jsonl(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from attnres_pp.train.tensorboard import scalar_items

    run, tb_dir = tmp_path / "run", tmp_path / "tb"
    assert main(["train", "--launcher", "inprocess", "--stages", "2", *TINY, "--residual", "attnres",
                 "--log-routing-every", "2", "--out", str(run), "--tensorboard", str(tb_dir)]) == 0
    events = EventAccumulator(str(tb_dir), size_guidance={"scalars": 0})
    events.Reload()
    tags = set(events.Tags()["scalars"])
    records = metrics(run)
    want = {}
    for record in records:
        for tag, value in scalar_items(record):
            want.setdefault(tag, {})[record["step"]] = value
    for must in ("train/loss", "val/loss", "train/lr", "perf/tokens_per_s", "train/grad_norm",
                 "pipeline/bubble_fraction", "routing/entropy_site_0", "memory/peak_rss_bytes_rank_1"):
        assert must in tags, must
    assert set(want) <= tags
    for tag, by_step in want.items():
        got = {e.step: e.value for e in events.Scalars(tag)}
        assert got.keys() == by_step.keys(), tag
        for step, value in by_step.items():
            assert got[step] == pytest.approx(value, rel=1e-6), (tag, step)  # events store float32
    assert len(events.Scalars("train/loss")) == 4 and len(events.Scalars("val/loss")) == 2


def test_tensorboard_into_a_file_is_one_error_line(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    code = main(["train", "--launcher", "local", *TINY, "--out", str(tmp_path / "run"), "--tensorboard", str(blocker)])
    assert code == 2 and capsys.readouterr().err.startswith("error: --tensorboard")
