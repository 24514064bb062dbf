"""`attnres-pp bench variants`: the paired ratios, the variants it times, the command line and the
markdown of a (synthetic) payload. The timing itself runs only as the benchmark."""

from __future__ import annotations

import pytest

from attnres_pp.bench import variants
from attnres_pp.cli import build_parser, main
from attnres_pp.model import ModelConfig


def test_paired_ratios_are_medians_of_same_round_ratios():
    times = {"standard": [1.0, 2.0, 4.0], "msar": [2.0, 2.0, 20.0]}
    assert variants.paired_ratios(times) == {"msar": 2.0}  # median of 2, 1, 5


def test_every_variant_is_a_valid_model_at_both_shapes():
    names = set()
    for shape, block_size in variants.SHAPES.values():
        for name, overrides in variants.variant_overrides(block_size).items():
            ModelConfig.from_dict({**shape, **overrides})
            names.add(name)
    assert names == {"standard", "full_attnres", "block_attnres", "p_lr_attnres", "s_lr_attnres", "msar"}
    assert set(variants.TARGETS) <= names


def test_rotation_puts_every_variant_in_every_position():
    orders = [order for _, order in variants._rotations(("a", "b", "c"), 3)]
    assert [o[0] for o in orders] == ["a", "b", "c"]


def test_cli_parses_variants_and_refuses_compile_elsewhere(tmp_path, capsys):
    args = build_parser().parse_args(["bench", "variants", "--quick", "--compile", "--json"])
    assert (args.name, args.quick, args.compile, args.json) == ("variants", True, True, True)
    with pytest.raises(SystemExit) as refused:  # argparse's refusal: peer has no such flag
        main(["bench", "peer", "--compile", "--out", str(tmp_path)])
    assert refused.value.code == 2
    assert "--compile applies to variants only" in capsys.readouterr().err


def test_target_shape_steps_1024_tokens_with_the_default_recipe_in_both_modes():
    shape, _ = variants.SHAPES[variants.TARGET_LABEL]
    cfg = ModelConfig.from_dict(dict(shape))
    assert (cfg.n_layers, cfg.d_model) == (16, 256)
    assert (cfg.positions, cfg.mlp) == ("rope", "swiglu")  # nothing in the shape overrides the defaults
    assert variants.SINGLE_BATCH * cfg.seq_len >= 1024
    pipe = variants.PIPELINE
    assert (pipe["stages"], pipe["virtual"], pipe["cache"]) == (2, 2, True)
    # The pipelined step is the same global batch split into whole microbatches.
    assert variants.SINGLE_BATCH % pipe["microbatches"] == 0
    assert variants.TARGETS == {"block_attnres": 1.10, "s_lr_attnres": 1.10, "full_attnres": 1.5, "msar": 2.0}


def test_targets_are_judged_in_every_mode_measured_at_the_target_shape():
    ratios = {"block_attnres": 1.10, "s_lr_attnres": 1.11, "full_attnres": 1.2, "msar": 2.5, "p_lr_attnres": 9.0}
    piped = {name: r - 0.05 for name, r in ratios.items()}
    results = {"single_process": {"4L_d64": {"ratios": {}}, variants.TARGET_LABEL: {"ratios": ratios}},
               "pipelined": {variants.TARGET_LABEL: {"ratios": piped}}}
    judged = variants.judge_targets(results)
    assert {name: t["met"] for name, t in judged["single_process"].items()} == {
        "block_attnres": True, "s_lr_attnres": False, "full_attnres": True, "msar": False}
    assert {name: t["met"] for name, t in judged["pipelined"].items()} == {
        "block_attnres": True, "s_lr_attnres": True, "full_attnres": True, "msar": False}
    assert judged["pipelined"]["msar"]["measured"] == 2.45
    # --quick pipelines the small shape only: no pipelined verdict is made up.
    assert set(variants.judge_targets({"single_process": results["single_process"],
                                       "pipelined": {"4L_d64": {"ratios": ratios}}})) == {"single_process"}


def test_pipelined_steps_every_variant_on_the_global_batch_in_rotation(monkeypatch):
    """Each engine is built from the shape, its variant and PIPELINE with the global batch split into
    microbatches; the engines step in rotation and the warm-up steps are dropped (a fake engine: the
    real ones run as the benchmark)."""
    from types import SimpleNamespace

    order, built = [], {}

    class FakeEngine:
        def __init__(self, run_cfg):
            self.run_cfg, self.samples = run_cfg, []
            built[run_cfg.model.residual, run_cfg.model.block_size, run_cfg.model.key_mode] = run_cfg

        def step(self):
            order.append(self.run_cfg.model.residual)
            wall_s = (2.0 if self.run_cfg.model.residual == "msar" else 1.0) * (1 + len(self.samples))
            self.samples.append(SimpleNamespace(wall_s=wall_s, bytes_sent=7))

        def close(self):
            pass

    monkeypatch.setattr(variants, "TimedEngine", FakeEngine)
    shape, block_size = variants.SHAPES[variants.TARGET_LABEL]
    out = variants.pipelined(shape, block_size, warmup=1, rounds=2)
    assert len(built) == len(variants.variant_overrides(block_size)) == 6
    for cfg in built.values():
        assert cfg.train.batch_size == variants.SINGLE_BATCH and cfg.train.microbatches == 4
        assert (cfg.pipeline.stages, cfg.pipeline.virtual, cfg.pipeline.cache) == (2, 2, True)
        assert cfg.model.seq_len == 256 and cfg.model.n_layers == 16
    assert order[:6] != order[6:12] and sorted(order[:6]) == sorted(order[6:12])  # shifted each round
    assert out["ratios"]["msar"] == 2.0 and out["step_s"]["standard"] == 2.5  # steps 2 and 3 of standard
    assert out["step_s_all"]["standard"] == [2.0, 3.0] and out["bytes_per_step"]["msar"] == 7


def _payload(names, single_ratio, piped_ratio):
    shapes = {label: variants._shape_record(s, b) for label, (s, b) in variants.SHAPES.items()}
    single = {label: {"step_s": {"standard": 0.1}, "ratios": dict.fromkeys(names, single_ratio)}
              for label in variants.SHAPES}
    piped = {label: {"step_s": {"standard": 0.2}, "ratios": dict.fromkeys(names, piped_ratio)}
             for label in variants.SHAPES}
    return {"ratios": {n: {"single_process": dict.fromkeys(variants.SHAPES, single_ratio),
                           "pipelined": dict.fromkeys(variants.SHAPES, piped_ratio)} for n in names},
            "single_process": single, "pipelined": piped, "single_batch": 4, "pipeline": variants.PIPELINE,
            "rounds": 8, "warmup_rounds": 2, "pipeline_rounds": 4, "pipeline_warmup_rounds": 1, "shapes": shapes,
            f"targets_{variants.TARGET_LABEL}": variants.judge_targets({"single_process": single,
                                                                        "pipelined": piped}),
            "load_average": {"before": [1.5, 2.0, 2.5], "after": [3.0, 2.0, 1.0]}}


def test_markdown_lists_ratios_targets_per_mode_shapes_and_load():
    names = [n for n in variants.variant_overrides(1) if n != "standard"]
    text = variants.to_markdown(_payload(names, 1.05, 1.3))
    assert "| msar | 1.050 | 1.050 | 1.300 | 1.300 |" in text
    single, piped = text.split("Targets at 16L_d256, pipelined:")
    assert "Targets at 16L_d256, single process:" in single
    assert "- s_lr_attnres: 1.050 (target <= 1.1) met" in single
    assert "- s_lr_attnres: 1.300 (target <= 1.1) missed" in piped and "- msar: 1.300 (target <= 2.0) met" in piped
    assert "seq_len 256, 1024 tokens a step, block size 4; rope positions, swiglu" in text
    assert "cache on" in text
    assert "Load average (1, 5, 15 min) before [1.5, 2.0, 2.5], after [3.0, 2.0, 1.0]." in text


@pytest.mark.parametrize("name", ["variants"])
def test_variants_is_registered(name):
    assert build_parser().parse_args(["bench", name]).name == name


def test_compile_puts_eager_and_compiled_models_in_one_rotation(monkeypatch):
    """Eager and compiled models of every variant share each round; per variant the compiled / eager
    ratio is the median of the pairs and the first (compiling) step is kept apart (aot_eager: no
    C++ toolchain needed; a tiny shape)."""
    import functools

    import attnres_pp.model as model_pkg

    monkeypatch.setattr(model_pkg, "Transformer", type("AotEagerTransformer", (model_pkg.Transformer,), {
        "__init__": functools.partialmethod(model_pkg.Transformer.__init__, compile_backend="aot_eager")}))
    monkeypatch.setattr(variants, "variant_overrides", lambda block_size: {
        "standard": {"residual": "standard", "block_size": 1}, "msar": {"residual": "msar", "block_size": 1}})
    shape = {"vocab_size": 16, "n_layers": 1, "d_model": 8, "n_heads": 2, "seq_len": 4}
    out = variants.single_process(shape, 1, warmup=1, rounds=3, compile_model=True)
    compiled = out["compiled"]
    assert set(out["step_s"]) == set(compiled["step_s"]) == set(compiled["first_step_s"]) == {"standard", "msar"}
    assert set(out["ratios"]) == set(compiled["ratios"]) == {"msar"}
    assert all(len(t) == 3 for t in [*out["step_s_all"].values(), *compiled["step_s_all"].values()])
    for name, ratio in compiled["compiled_over_eager"].items():
        pairs = [c / e for c, e in zip(compiled["step_s_all"][name], out["step_s_all"][name], strict=True)]
        assert ratio == sorted(pairs)[1] > 0
    assert "compiled" not in variants.single_process(shape, 1, warmup=0, rounds=1)


def test_compile_results_do_not_overwrite_the_eager_ones(tmp_path, monkeypatch):
    seen = {}

    def fake_run(quick, out_dir, progress, compile_model=False, kv_heads=None):
        seen["stem"] = out_dir.name
        return {"ratios": {}, "compile": compile_model}

    monkeypatch.setattr(variants, "run", fake_run)
    monkeypatch.setattr(variants, "to_markdown", lambda payload: "table")
    assert main(["bench", "variants", "--quick", "--compile", "--out", str(tmp_path)]) == 0
    assert seen["stem"].startswith("variants_compile_quick_")
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_file()) == [
        f"{seen['stem']}.json", f"{seen['stem']}.md"]


def test_markdown_lists_the_compile_speedup_and_compile_time():
    names = [n for n in variants.variant_overrides(1) if n != "standard"]
    single = {label: {"step_s": {"standard": 0.1}, "ratios": dict.fromkeys(names, 1.5)} for label in variants.SHAPES}
    compiled = {label: {"step_s": {"standard": 0.08}, "ratios": dict.fromkeys(names, 1.2),
                        "first_step_s": {"standard": 12.0, "msar": 30.0},
                        "compiled_over_eager": {"standard": 0.8, "msar": 0.64}} for label in variants.SHAPES}
    payload = {"ratios": {n: {"single_process": dict.fromkeys(variants.SHAPES, 1.5), "pipelined": {},
                              "single_process_compiled": dict.fromkeys(variants.SHAPES, 1.2)} for n in names},
               "single_process": single, "pipelined": {}, "compiled": compiled, "single_batch": 4,
               "pipeline": variants.PIPELINE, "rounds": 8, "warmup_rounds": 2, "pipeline_rounds": 4,
               "pipeline_warmup_rounds": 1, "shapes": {label: {} for label in variants.SHAPES},
               "targets_16L_d256": {}}
    text = variants.to_markdown(payload)
    assert "| msar | 1.500 | 1.500 | 1.200 | 1.200 |" in text
    assert "first step (compiles) standard 12.0 s, msar 30.0 s" in text
    assert "Compiled / eager step (median over rounds of the pair in one rotation): standard 0.800, msar 0.640" in text


@pytest.mark.parametrize("kv_heads", [1, 2])
def test_kv_heads_times_grouped_query_attention_in_every_shape(kv_heads):
    shapes = variants.shapes_with(kv_heads)
    assert set(shapes) == set(variants.SHAPES)
    for label, (shape, block_size) in shapes.items():
        record = variants._shape_record(shape, block_size)
        assert record["kv_heads"] == kv_heads and record["model"]["n_heads"] == variants.HEADS
        for overrides in variants.variant_overrides(block_size).values():
            assert ModelConfig.from_dict({**shape, **overrides}).kv_heads == kv_heads
        # The plain shapes stay multi-head attention.
        assert variants._shape_record(*variants.SHAPES[label])["kv_heads"] == variants.HEADS
    args = build_parser().parse_args(["bench", "variants", "--quick", "--kv-heads", str(kv_heads)])
    assert variants.run_options(args)["kv_heads"] == kv_heads
    assert f"variants_kv{kv_heads}_quick_" in variants.results_stem(args)


@pytest.mark.parametrize("kv_heads", ["3", "0", "8"])
def test_kv_heads_that_do_not_divide_the_heads_are_one_error_line(kv_heads, tmp_path, capsys):
    assert main(["bench", "variants", "--quick", "--kv-heads", kv_heads, "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: --kv-heads {kv_heads} must divide the shapes' 4 query heads: give 1, 2 or 4"]
    assert not any(tmp_path.iterdir())


def test_a_selection_times_standard_and_the_named_variants_and_refuses_unknown_names(tmp_path, capsys):
    assert set(variants.selected(variants.variant_overrides(4), ("msar",))) == {"standard", "msar"}
    args = build_parser().parse_args(["bench", "variants", "--variants", "msar,block_attnres", "--rounds", "3",
                                      "--mode", "pipelined"])
    assert variants.check(args) is None
    options = variants.run_options(args)
    assert (options["names"], options["rounds"], options["modes"]) == (("msar", "block_attnres"), 3, ("pipelined",))
    assert variants.results_stem(args).startswith("variants_msar-block_attnres_pipelined_")
    for bad in (["--variants", "msar,nothing"], ["--variants", "standard"], ["--rounds", "0"]):
        assert main(["bench", "variants", *bad, "--out", str(tmp_path)]) == 2
        assert capsys.readouterr().err.startswith(f"error: {bad[0]}")
    assert not list(tmp_path.iterdir())
