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
    assert main(["bench", "peer", "--compile", "--out", str(tmp_path)]) == 2
    assert "--compile applies to variants only" in capsys.readouterr().err


def test_markdown_lists_ratios_and_targets():
    names = [n for n in variants.variant_overrides(1) if n != "standard"]
    single = {label: {"step_s": {"standard": 0.1}, "ratios": dict.fromkeys(names, 1.5)} for label in variants.SHAPES}
    payload = {"ratios": {n: {"single_process": dict.fromkeys(variants.SHAPES, 1.5), "pipelined": {}} for n in names},
               "single_process": single, "pipelined": {}, "single_batch": 4, "pipeline": variants.PIPELINE,
               "rounds": 8, "warmup_rounds": 2, "pipeline_rounds": 4, "pipeline_warmup_rounds": 1,
               "shapes": {label: {} for label in variants.SHAPES},
               "targets_16L_d256_single_process": {"msar": {"target": 2.0, "measured": 1.5, "met": True}}}
    text = variants.to_markdown(payload)
    assert "| msar | 1.500 | 1.500 |" in text and "msar: 1.500 (target <= 2.0) met" in text


@pytest.mark.parametrize("name", ["variants"])
def test_variants_is_registered(name):
    assert build_parser().parse_args(["bench", name]).name == name
