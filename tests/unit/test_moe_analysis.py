"""An MoE run's expert loads as `attnres-pp analyze` and TensorBoard show them: on one tiny real run
(aux-loss balancing, so every MoE figure is there), the figure's panels hold exactly the numbers of
summary.json and metrics.jsonl, the JSON carries them, and the TensorBoard events equal them."""

from __future__ import annotations

import json

import numpy as np
import pytest

from attnres_pp.analysis.experts import expert_loads, experts_figure
from attnres_pp.cli import main
from tests.run_helpers import metrics, summary

BATCH, SEQ, TOP_K, EXPERTS = 4, 16, 2, 4
TINY_MOE = ["--layers", "3", "--d-model", "16", "--heads", "2", "--seq-len", str(SEQ), "--batch-size", str(BATCH),
            "--steps", "3", "--quiet", "--lr", "0.02", "--residual", "attnres", "--blocks", "3",
            "--moe-experts", str(EXPERTS), "--moe-top-k", str(TOP_K), "--moe-shared-experts", "1", "--moe-d-ff", "8",
            "--moe-dense-layers", "1", "--moe-balance", "aux_loss"]


@pytest.fixture(scope="module")
def moe_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe")
    run, tb_dir = root / "run", root / "tb"
    tensorboard = ["--tensorboard", str(tb_dir)] if _has_tensorboard() else []
    assert main(["train", "--launcher", "local", *TINY_MOE, "--out", str(run), *tensorboard]) == 0
    return run, tb_dir


def _has_tensorboard() -> bool:
    try:
        import tensorboard  # noqa: F401
    except ModuleNotFoundError:
        return False
    return True


def test_analyze_puts_the_runs_expert_loads_beside_the_depth_routing(moe_run, capsys, tmp_path):
    run, _tb = moe_run
    out = tmp_path / "analysis"
    assert main(["analyze", str(run), "--out", str(out), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    loads, records = summary(run)["moe_expert_loads"], metrics(run)
    experts = result["experts"]
    assert experts["layers"] == [1, 2]  # layer 0 keeps its dense MLP
    assert experts["last_step_tokens_per_expert"] == [loads["1"], loads["2"]]
    for tokens in experts["last_step_tokens_per_expert"]:
        assert len(tokens) == EXPERTS and sum(tokens) == BATCH * SEQ * TOP_K  # dropless: every choice counted
    for layer in ("1", "2"):
        assert experts["max_over_mean"][layer] == [r[f"moe_load_max_over_mean/{layer}"] for r in records]
        ratio = max(loads[layer]) / (sum(loads[layer]) / EXPERTS)
        assert experts["last_step_max_over_mean"][int(layer) - 1] == pytest.approx(ratio)
        assert ratio == pytest.approx(records[-1][f"moe_load_max_over_mean/{layer}"])
    assert experts["aux_loss"] == [r["moe_aux_loss"] for r in records] and all(a > 0 for a in experts["aux_loss"])
    assert "experts.png" in [p.rsplit("/", 1)[-1] for p in result["pngs"]]
    assert (out / "experts.png").stat().st_size > 1000


def test_expert_figure_draws_the_runs_numbers(moe_run):
    run, _tb = moe_run
    loads, records = summary(run)["moe_expert_loads"], metrics(run)
    data = expert_loads(run)
    sites = [{"site": 0, "kind": "attn", "layer": 0, "sources": ["b0"], "weights": [1.0]},
             {"site": 1, "kind": "mlp", "layer": 0, "sources": ["b0", "p1"], "weights": [0.25, 0.75]}]
    fig = experts_figure(data, sites, "test")
    routing_ax, load_ax, steps_ax = fig.axes[:3]
    np.testing.assert_allclose(routing_ax.images[0].get_array().filled(np.nan), [[1.0, np.nan], [0.25, 0.75]])
    want_LE = np.array([loads["1"], loads["2"]], dtype=float)
    np.testing.assert_allclose(load_ax.images[0].get_array(), want_LE / want_LE.mean(axis=1, keepdims=True))
    for line, layer in zip(steps_ax.get_lines()[:2], ("1", "2"), strict=True):
        np.testing.assert_array_equal(line.get_xdata(), [r["step"] for r in records])
        np.testing.assert_array_equal(line.get_ydata(), [r[f"moe_load_max_over_mean/{layer}"] for r in records])
    aux_line = next(ax for ax in fig.axes if ax.get_ylabel().startswith("aux loss")).get_lines()[0]
    np.testing.assert_array_equal(aux_line.get_ydata(), [r["moe_aux_loss"] for r in records])


def test_a_dense_run_has_no_expert_loads(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 0, "loss": 5.0}) + "\n")
    assert expert_loads(tmp_path) is None
    with pytest.raises(ValueError, match="has no metrics.jsonl"):
        expert_loads(tmp_path / "missing")


def test_tensorboard_carries_the_moe_scalars(moe_run):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run, tb_dir = moe_run
    events = EventAccumulator(str(tb_dir), size_guidance={"scalars": 0})
    events.Reload()
    records, loads = metrics(run), summary(run)["moe_expert_loads"]

    def series(tag: str) -> list[float]:
        return [e.value for e in events.Scalars(tag)]

    for layer in ("1", "2"):
        assert series(f"moe/load_max_over_mean_layer_{layer}") == pytest.approx(
            [r[f"moe_load_max_over_mean/{layer}"] for r in records], rel=1e-6)
        # The last step's tokens per expert are summary.json's; every step counts each token K times.
        assert [series(f"moe/tokens_layer_{layer}_expert_{e}")[-1] for e in range(EXPERTS)] == loads[layer]
        for step in range(len(records)):
            assert sum(series(f"moe/tokens_layer_{layer}_expert_{e}")[step] for e in range(EXPERTS)) == \
                BATCH * SEQ * TOP_K
    assert series("moe/load_max_over_mean") == pytest.approx([r["moe_load_max_over_mean"] for r in records], rel=1e-6)
    assert series("moe/aux_loss") == pytest.approx([r["moe_aux_loss"] for r in records], rel=1e-6)
    assert not [tag for tag in events.Tags()["scalars"] if tag.startswith("misc/moe")]
