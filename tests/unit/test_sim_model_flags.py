"""`simulate memory` and `simulate plan` take `train`'s model flags: every one of them, with train's
default and meaning (the same ModelConfig from the same argv), and a bad value is one `error:` line
with exit 2 from each of the three commands."""

from __future__ import annotations

import argparse
import json

import pytest

from attnres_lab.memory_predict import CASES, case_flags, microbatch_sequences, train_argv
from attnres_pp.cli import build_parser, main
from attnres_pp.train.cli import build_run_config, flag_overrides

from ..distributed import test_expert_parallel_gloo, test_fsdp, test_sim_held_bytes
from . import test_memory_per_rank, test_sim_blocks_knobs


def _subparser(command: str, sub: str | None = None) -> argparse.ArgumentParser:
    parser = build_parser([command])
    path = [command] + ([sub] if sub else [])
    for name in path:
        action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        parser = action.choices[name]
    return parser


def _options(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {option: action for action in parser._actions for option in action.option_strings}


def _train_model_flags() -> list[argparse.Action]:
    """train's flags that set a [model] key: each one given alone (with a value its type reads)."""
    parser = _subparser("train")
    found = []
    for action in parser._actions:
        if not action.option_strings or action.dest in ("help", "config", "resume"):
            continue
        option = action.option_strings[0]
        value = [] if action.nargs == 0 else [str(action.choices[0]) if action.choices else "1"]
        overrides = flag_overrides(parser.parse_args([option, *value]))
        if "model" in overrides:
            found.append(action)
    return found


MODEL_FLAGS = _train_model_flags()
SIMULATORS = (("memory", _subparser("simulate", "memory")), ("plan", _subparser("simulate", "plan")))


def test_train_has_model_flags_to_share():
    options = {a.option_strings[0] for a in MODEL_FLAGS}
    assert {"--residual", "--block-size", "--blocks", "--layers", "--d-model", "--key-norm-gain"} <= options


@pytest.mark.parametrize("name,parser", SIMULATORS)
def test_every_train_model_flag_is_the_simulators_with_its_default(name, parser):
    options = _options(parser)
    for action in MODEL_FLAGS:
        for option in action.option_strings:
            assert option in options, (name, option)
            got = options[option]
            assert (got.dest, got.default, got.type, got.choices, got.nargs, got.const) == (
                action.dest, action.default, action.type, action.choices, action.nargs, action.const), (name, option)
    # The pipeline split of a model, too (plan refuses it: it searches the split).
    assert options["--layer-counts"].default == _options(_subparser("train"))["--layer-counts"].default


def _memory_per_rank_train_argvs(tmp_path) -> list[tuple[str, list[str]]]:
    """The train argv of every case whose `memory_per_rank` CI's tests read: the memory prediction
    cases, the runs of test_memory_per_rank and test_fsdp, the held-bytes runs and the experts' fsdp run."""
    argvs = [(name, train_argv(case_flags(case), tmp_path / "run")) for name, case in CASES]
    per_rank = test_memory_per_rank.TINY
    argvs += [("memory_per_rank one", ["train", *per_rank, "--batch-size", "4", "--launcher", "local"]),
              ("memory_per_rank D=2", ["train", *per_rank, "--batch-size", "8", "--launcher", "inprocess",
                                       "--stages", "2", "--data-parallel", "2"]),
              ("memory_per_rank zb_h1 AC", ["train", *per_rank, "--batch-size", "4", "--stages", "2", "--schedule",
                                            "zb_h1", "--activation-checkpoint", "full"]),
              ("fsdp D2P2V2", ["train", *test_fsdp.D2P2V2, "--dp-shard", "fsdp"])]
    argvs += [(f"held bytes {schedule} {dp_shard}", test_sim_held_bytes.train_argv(schedule, virtual, dp_shard,
                                                                                   tmp_path / "held"))
              for schedule, virtual, dp_shard in test_sim_held_bytes.REAL_RUNS]
    argvs.append(("experts EP2 fsdp", ["train", *test_expert_parallel_gloo.TINY, "--expert-parallel", "2",
                                       "--dp-shard", "fsdp", "--launcher", "local"]))
    argvs.append(("blocks and key-norm gain", ["train", "--batch-size", "4", *test_sim_blocks_knobs.MODEL,
                                                *test_sim_blocks_knobs.LAYOUT]))
    return argvs


def _shared_tokens(argv: list[str], options: set[str]) -> list[str]:
    """The flags (with their values) of a train argv that the simulator's parser also has."""
    train_options = _options(_subparser("train"))
    out, i = [], 1
    while i < len(argv):
        option = argv[i]
        width = 1 if train_options[option].nargs == 0 else 2
        if option in options:
            out += argv[i:i + width]
        i += width
    return out


def _model_tokens(argv: list[str]) -> list[str]:
    return _shared_tokens(argv, {o for a in MODEL_FLAGS for o in a.option_strings})


def test_memory_per_rank_cases_give_the_simulators_trains_model(tmp_path, capsys):
    from attnres_pp.simulator.cli import memory, plan

    argvs = _memory_per_rank_train_argvs(tmp_path)
    assert len(argvs) == len(CASES) + 4 + len(test_sim_held_bytes.REAL_RUNS) + 1 + 1
    memory_options = set(_options(dict(SIMULATORS)["memory"]))
    for name, argv in argvs:
        run_cfg = build_run_config(build_parser(argv).parse_args(argv))
        pipe = run_cfg.pipeline
        layout = {"batch_size": run_cfg.train.batch_size, "microbatches": run_cfg.train.microbatches,
                  "data_parallel": pipe.data_parallel}
        tokens = microbatch_sequences(layout) * run_cfg.model.seq_len
        # What the simulator needs that train resolves itself (its own defaults), then train's own flags.
        sim = ["simulate", "memory", "--json", "--schedule", pipe.schedule, "--stages", str(pipe.stages),
               "--virtual", str(pipe.virtual), "--microbatches", str(run_cfg.train.microbatches),
               "--data-parallel", str(pipe.data_parallel), "--tokens", str(tokens),
               *_shared_tokens(argv, memory_options - {"--dtype"})]
        cfg, _setup = memory.build(build_parser(sim).parse_args(sim))
        assert cfg == run_cfg.model, name
        assert main(sim) == 0, name
        report = json.loads(capsys.readouterr().out)
        assert len(report["memory_per_rank"]) == pipe.world_size, name
        planned = ["simulate", "plan", "--global-batch", "8", "--gpus", "4", "--gpu-memory-gib", "16",
                   *_model_tokens(argv)]
        assert plan.build(build_parser(planned).parse_args(planned)).model == run_cfg.model, name


def test_standard_residual_needs_no_block_size(capsys):
    argv = ["simulate", "memory", "--schedule", "1f1b", "--stages", "2", "--microbatches", "4", "--layers", "4",
            "--residual", "standard", "--json"]
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    assert len(report["memory_per_rank"]) == 2
    assert all(rank["cache_peak_bytes"] == 0 for rank in report["memory_per_rank"])


COMMANDS = {
    "train": ["train", "--steps", "1", "--quiet"],
    "memory": ["simulate", "memory", "--schedule", "1f1b", "--stages", "2", "--microbatches", "4"],
    "plan": ["simulate", "plan", "--global-batch", "8", "--gpus", "4", "--gpu-memory-gib", "16"],
}


@pytest.mark.parametrize("command", sorted(COMMANDS))
@pytest.mark.parametrize("bad,needle", [(["--layers", "two"], "--layers 'two' is invalid: expected an integer"),
                                        (["--residual", "highway"], "ModelConfig.residual='highway' is invalid"),
                                        (["--key-rank", "0"], "ModelConfig.key_rank=0 is invalid")])
def test_a_bad_model_flag_is_one_error_line_and_exit_2(command, bad, needle, tmp_path, capsys):
    argv = COMMANDS[command] + bad + (["--out", str(tmp_path / "run")] if command == "train" else [])
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith("error: ") and captured.err.count("\n") == 1, captured.err
    assert needle in captured.err


def test_plan_refuses_the_split_it_searches(capsys):
    assert main(COMMANDS["plan"] + ["--layer-counts", "2,2"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "error: --layer-counts: simulate plan searches over it" in err


@pytest.mark.parametrize("command", ["memory", "plan"])
def test_blocks_and_key_norm_gain_change_the_prediction(command, capsys):
    """Priced, not ignored: each changes what the command prints (`test_sim_blocks_knobs` holds the
    figures to a run)."""
    outputs = []
    for extra in ([], ["--blocks", "3"], ["--key-norm-gain"]):
        assert main(COMMANDS[command] + ["--json", "--layers", "4", *extra]
                    + (["--tensor-parallel", "1"] if command == "plan" else [])) == 0
        report = json.loads(capsys.readouterr().out)
        outputs.append(report["memory_per_rank"] if command == "memory" else report["rows"][0]["peak_memory_bytes"])
    assert outputs[0] != outputs[1] and outputs[0] != outputs[2]
