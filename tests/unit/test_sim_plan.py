"""`attnres-pp simulate plan`: every row fits and rows come fastest first, an impossible request says
what is short, the README's Llama-3-8B- and 70B-shaped models on 64 and 512 x 80 GiB (T searched)
are planned in under 10 s of CPU time each; the fast stage 1 (`plan_price`) equals
`Planner.estimate` candidate by candidate and gives the rows the estimates give; every row's
command goes through `attnres-pp train`'s parser and the checks train makes before it starts a
rank, which accept it exactly when the row says `runnable`."""

from __future__ import annotations

import dataclasses
import json
import shlex

import pytest

from attnres_pp.cli import build_parser, main
from attnres_pp.model.config import ModelConfig
from attnres_pp.simulator.plan import GIB, Infeasible, Planner, PlanRequest, candidates, make_plan, plan
from attnres_pp.simulator.plan_price import price_all
from attnres_pp.simulator.tensor_parallel import TP_SIZES


def _small(**overrides) -> PlanRequest:
    cfg = ModelConfig(vocab_size=32000, n_layers=8, d_model=1024, n_heads=8, seq_len=2048, block_size=1)
    values = dict(model=cfg, global_batch=32, gpus=8, gpu_memory_gib=12.0, top=8)
    values.update(overrides)
    return PlanRequest(**values)


def test_rows_fit_and_are_fastest_first():
    request = _small()
    rows = plan(request)
    assert rows
    assert all(row["peak_memory_bytes"] <= request.gpu_memory_gib * GIB for row in rows)
    assert all(max(row["peak_memory_per_rank"]) == row["peak_memory_bytes"] for row in rows)
    times = [row["step_time_s"] for row in rows]
    assert times == sorted(times)
    for row in rows:
        config = row["config"]
        assert config["n_stages"] * config["data_parallel"] == request.gpus
        assert row["tokens_per_s_per_gpu"] == pytest.approx(32 * 2048 / row["step_time_s"] / 8)


def test_less_memory_forces_savings():
    roomy = plan(_small(gpu_memory_gib=200.0))[0]
    tight_request = _small(gpu_memory_gib=6.0)
    tight = plan(tight_request)[0]
    assert tight["peak_memory_bytes"] <= 6.0 * GIB < roomy["peak_memory_bytes"]
    assert tight["step_time_s"] >= roomy["step_time_s"]


def test_top_command_parses_with_train():
    row = plan(_small())[0]
    argv = shlex.split(row["command"])
    assert argv[:2] == ["attnres-pp", "train"]
    args, unknown = build_parser(argv[1:]).parse_known_args(argv[1:])
    assert not [a for a in unknown if a.startswith("--")]  # every flag the plan prints is one of `train`'s
    assert args.command == "train"


def test_infeasible_says_what_is_short():
    short = r"needs [\d.]+ GiB per rank at best \(.*\), over the 0.5 GiB given: add GPUs$"
    with pytest.raises(Infeasible, match=short):
        plan(_small(gpu_memory_gib=0.5))
    with pytest.raises(Infeasible, match=r"add GPUs or enable fsdp \(it needs D > 1\)$"):
        plan(_small(gpus=1, global_batch=1, gpu_memory_gib=1.0))


def test_cli_json_and_errors(capsys):
    argv = ["simulate", "plan", "--layers", "8", "--d-model", "1024", "--heads", "8", "--seq-len", "2048",
            "--vocab-size", "32000", "--global-batch", "32", "--gpus", "8", "--gpu-memory-gib", "12", "--top", "3",
            "--json"]
    assert main(argv) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert 1 <= len(rows) <= 3
    assert {"config", "step_time_s", "peak_memory_bytes", "command"} <= set(rows[0])
    assert main(argv[:-1] + ["--gpu-memory-gib", "0.5"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "error: needs" in err
    assert main(argv[:12] + argv[14:]) == 2  # --global-batch missing
    assert "--global-batch is required" in capsys.readouterr().err


LLAMA_3_8B = ["--layers", "32", "--d-model", "4096", "--heads", "32", "--kv-heads", "8", "--d-ff", "14336",
              "--vocab-size", "128256", "--rope-theta", "500000", "--seq-len", "8192"]
LLAMA_3_70B = ["--layers", "80", "--d-model", "8192", "--heads", "64", "--kv-heads", "8", "--d-ff", "28672",
               "--vocab-size", "128256", "--rope-theta", "500000", "--seq-len", "8192"]


@pytest.mark.parametrize("model,cluster", [
    (LLAMA_3_8B, ["--global-batch", "512", "--gpus", "64", "--gpu-memory-gib", "80"]),
    (LLAMA_3_70B, ["--global-batch", "1024", "--gpus", "512", "--gpu-memory-gib", "80"]),
])
def test_plans_the_readmes_llama_shaped_models(model, cluster, capsys):
    """The README's commands, T searched (their speed is measured in docs/simulator.md, not
    asserted here); the train command they print builds the model the plan priced."""
    assert main(["simulate", "plan", *model, *cluster]) == 0
    out = capsys.readouterr().out
    command = next(line for line in out.splitlines() if line.strip().startswith("attnres-pp train"))
    recipe = " ".join(model[model.index("--d-ff"):model.index("--d-ff") + 2] + ["--rope-theta", "500000"]
                      + model[model.index("--kv-heads"):model.index("--kv-heads") + 2])
    assert recipe in command and f"--layers {model[1]}" in command


def test_pruning_keeps_the_exact_optimum():
    """Against every candidate simulated exactly: the planner's top row is the fastest that fits.
    Two GPUs: 972 candidates (the planner simulates at most 32), 132 over the memory limit; the
    stage-1 prices it ranks by equal the estimate on every candidate at 4 to 8 GPUs (below)."""
    request = _small(gpus=2, global_batch=16)
    planner = Planner(request)
    exact = [planner.evaluate(c) for c in candidates(request)]
    fitting = [row for row in exact if row["peak_memory_bytes"] <= request.gpu_memory_gib * GIB]
    assert len(fitting) < len(exact)  # the memory limit binds here
    best = min(row["step_time_s"] for row in fitting)
    assert plan(request)[0]["step_time_s"] == pytest.approx(best)


# ---- the fast stage 1 against Planner.estimate ----

def _requests() -> list[PlanRequest]:
    """Variants, uneven splits (7 layers), T searched on one node and across nodes, fsdp and tight memory."""
    def model(**fields) -> ModelConfig:
        return ModelConfig(**({"vocab_size": 32000, "n_layers": 8, "d_model": 512, "n_heads": 8, "seq_len": 256,
                               "block_size": 4} | fields))

    return [
        PlanRequest(model=model(), global_batch=16, gpus=8, gpu_memory_gib=2.0, tensor_parallel_sizes=TP_SIZES),
        PlanRequest(model=model(n_layers=7, residual="msar"), global_batch=12, gpus=4, gpu_memory_gib=1.0),
        PlanRequest(model=model(residual="lr_attnres", key_norm_gain=True), global_batch=8, gpus=4,
                    gpu_memory_gib=0.5, tensor_parallel_sizes=(1, 2), gpus_per_node=2),
        PlanRequest(model=model(residual="standard", n_layers=6), global_batch=24, gpus=6, gpu_memory_gib=3.0,
                    dtype="fp32", attention_kernel="math"),
    ]


@pytest.mark.parametrize("index", range(4))
def test_fast_prices_equal_the_estimate_for_every_candidate(index):
    request = _requests()[index]
    found = candidates(request)
    fast = price_all(Planner(request), found)
    slow = Planner(request)
    assert len(found) > 100
    assert [(step, peak) for step, peak, _c in fast] == [slow.estimate(c) for c in found]  # equal, not close


class _EstimatePricing:
    """The slow twin of `plan_price.Pricing`: every price from `Planner.estimate`, all at once."""

    def __init__(self, planner, found) -> None:
        self.candidates = found
        self._prices = [planner.estimate(c) for c in found]
        self.steps = [step for step, _peak in self._prices]
        self.by_step = sorted(range(len(found)), key=self.steps.__getitem__)

    def peak(self, index: int) -> int:
        return self._prices[index][1]

    def leanest(self, indices: list[int], count: int) -> list[int]:
        return sorted(indices, key=self.peak)[:count]


@pytest.mark.parametrize("index", range(4))
def test_the_rows_are_those_of_the_estimates(monkeypatch, index):
    """Lazy peaks and shared terms change no row: the plan (and its run row, or what is short) equals
    the plan priced by `estimate` for every candidate."""
    import attnres_pp.simulator.plan as plan_module

    request = _requests()[index]

    def outcome():
        try:
            result = make_plan(request)
        except Infeasible as error:
            return str(error)
        return json.dumps([result.rows, result.run, result.run_row])

    fast = outcome()
    monkeypatch.setattr(plan_module, "Pricing", _EstimatePricing)
    assert outcome() == fast


def test_the_run_row_is_the_plan_of_what_train_runs():
    """No top row runs on GPUs (T = 2 leads): the run row is the plan's top row at T = 1 alone."""
    request = PlanRequest(model=ModelConfig(vocab_size=32000, n_layers=8, d_model=4096, n_heads=16, seq_len=4096,
                                            block_size=4), global_batch=4, gpus=4, gpu_memory_gib=16.0, top=1,
                          tensor_parallel_sizes=(1, 2))
    result = make_plan(request)
    assert not result.rows[0]["runnable"] and result.run_row is None
    assert result.rows[0]["not_runnable_reason"].startswith("train refuses --tensor-parallel")
    alone = plan(dataclasses.replace(request, tensor_parallel_sizes=(1,)))[0]
    assert result.run == alone and result.run["runnable"]


# ---- every printed command against train's own checks ----

class _Accepted(Exception):
    """train's checks passed and it would start the ranks now."""


def _train_accepts(command: str, request: PlanRequest, monkeypatch, tmp_path) -> str | None:
    """None if `attnres-pp train` takes `command` up to starting its ranks on a cluster of the request's
    nodes (G GPUs each; a private Ray instance is one node), else its `error:` line."""
    from attnres_pp.launch.ray_checks import check_placement, placement_bundles
    from attnres_pp.train import engines

    nodes = request.gpus // request.gpus_per_node if "--address" in command else 1
    node = {"CPU": 2.0 * request.gpus_per_node, "GPU": float(request.gpus_per_node)}

    class Cluster:
        one_process, where, spans_nodes = False, "in the cluster", nodes > 1

        def __init__(self, pipe, world_size: int, **_options) -> None:
            self.pipe, self.world_size = pipe, world_size

        def gpus(self) -> int:
            return nodes * request.gpus_per_node

        def start(self, _worker_cls, _rank_kwargs, *, device: str):
            bundles = placement_bundles(self.world_size, self.pipe.tensor_parallel, gpu=device == "cuda")
            check_placement(bundles, self.pipe.placement, [dict(node) for _ in range(nodes)],
                            ranks_per_bundle=self.pipe.tensor_parallel)
            raise _Accepted

        def stop(self, graceful: bool) -> None:
            pass

    monkeypatch.setattr(engines, "make_rank_group", Cluster)
    monkeypatch.setattr("attnres_pp.launch.resolve.visible_gpus", lambda: request.gpus_per_node)
    # The host memory of a GPU node (train checks the model's fp32 state against it without --address).
    monkeypatch.setattr("attnres_pp.train.memory_fit.physical_memory_bytes", lambda: 2 * 1024 ** 4)
    monkeypatch.chdir(tmp_path)
    argv = shlex.split(command)
    assert argv[:2] == ["attnres-pp", "train"]
    try:
        code = main(argv[1:])
    except _Accepted:
        return None
    assert code == 2
    return "refused"


def test_every_row_command_is_what_train_accepts(monkeypatch, tmp_path, capsys):
    """Rows at T = 2 and 4 lead (refused on GPUs), and the run row at T = 1 below the table (taken), on
    two 4-GPU nodes (`--address auto --placement PACK`) and on one."""
    model = ModelConfig(vocab_size=32000, n_layers=8, d_model=4096, n_heads=16, seq_len=4096, block_size=4)
    requests = [PlanRequest(model=model, global_batch=gpus, gpus=gpus, gpus_per_node=4, gpu_memory_gib=16.0, top=4,
                            tensor_parallel_sizes=(1, 2, 4)) for gpus in (8, 4)]
    seen = set()
    for request in requests:
        result = make_plan(request)
        for row in [*result.rows, result.run]:
            refused = _train_accepts(row["command"], request, monkeypatch, tmp_path)
            err = capsys.readouterr().err
            assert (refused is None) == row["runnable"], (row["command"], err)
            if not row["runnable"]:
                assert err.startswith("error: --tensor-parallel") and err.count("\n") == 1
            seen.add((row["runnable"], "--address auto" in row["command"]))
    assert seen == {(True, True), (False, True), (True, False), (False, False)}  # both kinds, both clusters


def test_the_table_names_the_rows_train_refuses_and_runs_another(capsys):
    argv = ["simulate", "plan", "--layers", "8", "--d-model", "4096", "--heads", "16", "--seq-len", "4096",
            "--vocab-size", "32000", "--global-batch", "4", "--gpus", "4", "--gpu-memory-gib", "16", "--top", "1"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "row 1: train refuses --tensor-parallel" in out
    title, command = out.splitlines()[-2:]
    assert title.startswith("run the fastest configuration train runs, below the table")
    assert "--tensor-parallel" not in command and command.startswith("  attnres-pp train")
    assert main(argv + ["--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["run_row"] is None and out["run"]["runnable"] and out["run"]["not_runnable_reason"] is None
    assert not out["rows"][0]["runnable"]
    # At 8192 tokens a sequence only T > 1 fits 8 GiB: the table says that nothing train runs fits.
    assert main(["simulate", "plan", "--layers", "4", "--d-model", "4096", "--heads", "16", "--seq-len", "8192",
                 "--vocab-size", "32000", "--global-batch", "4", "--gpus", "4", "--gpu-memory-gib", "8"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[-1] == "none of the configurations train runs on these GPUs fits: see the rows' reasons"
