"""Bad inputs to `train`, `simulate` and `bench`, as a new user types them: each exits with code 2 and
one `error:` line that names what to change, with no traceback, and no train case starts an engine
or Ray. Run in this process (argparse's refusals arrive as SystemExit) so the table takes seconds.

Placeholders in the argv: {tmp} a fresh folder, {file} an existing plain file, {toml} the case's TOML
text written to a file, {calibration} an `attnres-lab fidelity` calibration file. Root ignores permission
bits, so "unwritable" and "unreadable" are a path under an existing file, /proc (which refuses new
entries) and /proc/self/mem (a regular file whose read fails).
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import pytest

from attnres_pp.cli import main

TRAIN = ["train", "--launcher", "local", "--steps", "1", "--layers", "2", "--d-model", "32", "--heads", "2",
         "--seq-len", "16", "--batch-size", "4", "--data", "{tmp}/tiny.txt", "--quiet"]
RAY = [*TRAIN, "--launcher", "ray", "--stages", "2"]
OUT = ["--out", "{tmp}/run"]
SCHEDULE = ["simulate", "schedule", "--schedule", "1f1b", "--stages", "4", "--microbatches", "8"]
MODEL_COSTS = [*SCHEDULE, "--costs", "model", "--layers", "8", "--block-size", "4"]
COMM = ["simulate", "comm", "--layers", "8", "--block-size", "4"]
MEMORY = ["simulate", "memory", "--schedule", "1f1b", "--stages", "2", "--microbatches", "4", "--layers", "8",
          "--block-size", "4"]
PREDICT = ["simulate", "predict", "--calibration", "{calibration}"]
PLAN = ["simulate", "plan", "--layers", "8", "--d-model", "256", "--heads", "4", "--seq-len", "256",
        "--global-batch", "8", "--gpus", "4", "--gpu-memory-gib", "16"]
PROJECT = ["simulate", "project", "--layers", "8", "--d-model", "256", "--block-size", "4", "--tokens", "512",
           "--stages", "2", "--microbatches", "4"]
LAYER_COUNTS = "--layer-counts '{}' is invalid: expected comma-separated positive integers"
# A calibration as `attnres-lab fidelity` writes it (units in seconds), for the `simulate predict` cases.
CALIBRATION = {
    "forward_units_s": {"layer": 1e-3, "add": 1e-5, "embed": 1e-4, "head": 3e-4, "merge": 2e-4,
                        "phase1_a_b_c_e": [1e-4, 1e-5, 0.0, 1e-5], "phase1_floor": 1e-4},
    "backward_units_s": {"layer": 2e-3, "add": 2e-5, "embed": 1e-4, "head": 4e-4, "merge": 3e-4,
                         "phase1_a_b_c_e": [1e-4, 2e-5, 0.0, 1e-5], "phase1_floor": 2e-4},
    "forward_scale": 1.0, "backward_scale": 1.0,
    "messages": {"send_fixed_s": 1e-4, "send_s_per_byte": 1e-10, "recv_fixed_s": 2e-5, "link_latency_s": 2e-5,
                 "link_s_per_byte": 1e-10, "dispatch_s": 5e-6},
    "calibrated_on": {"model": {"vocab_size": 256, "n_layers": 8, "d_model": 128, "n_heads": 4, "seq_len": 64,
                                "residual": "attnres", "block_size": 4},
                      "schedule": "1f1b", "n_stages": 2, "n_virtual": 1, "n_microbatches": 4, "microbatch_size": 4,
                      "cache": True},
}
UNREACHABLE = "127.0.0.1:1"  # loopback port 1: refused at once, and never another machine

# (id, argv, TOML text for {toml} or None, a piece of the error line). TOML cases use keys that TRAIN's
# flags do not set, since flags win over the file.
CASES = [
    # train: flags
    ("train-timeout-nan", [*TRAIN, *OUT, "--timeout", "nan"], None, "timeout_s=nan"),
    ("train-timeout-inf", [*TRAIN, *OUT, "--timeout", "inf"], None, "timeout_s=inf"),
    ("train-timeout-zero", [*TRAIN, *OUT, "--timeout", "0"], None, "finite number of seconds > 0"),
    ("train-timeout-word", [*TRAIN, *OUT, "--timeout", "soon"], None, "--timeout 'soon'"),
    ("train-lr-nan", [*TRAIN, *OUT, "--lr", "nan"], None, "TrainConfig.lr=nan"),
    ("train-steps-float", [*TRAIN, *OUT, "--steps", "1.5"], None, "--steps '1.5'"),
    ("train-key-rank-negative", [*TRAIN, *OUT, "--key-rank", "-3"], None, "key_rank=-3"),
    ("train-block-size-zero", [*TRAIN, *OUT, "--block-size", "0"], None, "block_size=0"),
    ("train-heads-not-dividing", [*TRAIN, *OUT, "--heads", "3"], None, "must divide d_model"),
    ("train-stages-zero", [*TRAIN, *OUT, "--stages", "0"], None, "stages=0"),
    ("train-layer-counts-zero", [*TRAIN, *OUT, "--stages", "2", "--layer-counts", "2,0"], None, "layers >= 1"),
    ("train-max-restarts-negative", [*TRAIN, *OUT, "--max-restarts", "-1"], None, "max_restarts=-1"),
    ("train-cache-choice", [*TRAIN, *OUT, "--cache", "maybe"], None, "invalid choice"),
    ("train-keep-checkpoints-negative", [*TRAIN, *OUT, "--keep-checkpoints", "-1"], None, "keep_checkpoints=-1"),
    # dualpipev: a V of two chunks per rank, and m >= 2P (checked by the run's config, before any rank)
    ("train-dualpipev-few-microbatches", [*TRAIN, *OUT, "--layers", "4", "--stages", "2", "--virtual", "2",
                                          "--schedule", "dualpipev", "--microbatches", "2"], None,
     "dualpipev needs m >= 2P=4 microbatches"),
    ("train-dualpipev-virtual-odd", [*TRAIN, *OUT, "--layers", "6", "--stages", "2", "--virtual", "3",
                                     "--schedule", "dualpipev", "--microbatches", "4"], None,
     "dualpipev places exactly 2 chunks per rank (a V), but virtual V=3"),
    ("train-dualpipev-virtual-4", [*TRAIN, *OUT, "--layers", "8", "--stages", "2", "--virtual", "4",
                                   "--schedule", "dualpipev", "--microbatches", "4"], None,
     "dualpipev places exactly 2 chunks per rank (a V), but virtual V=4"),
    ("train-dualpipev-toml-few-microbatches", [*TRAIN, *OUT, "--config", "{toml}", "--layers", "4"],
     '[pipeline]\nstages = 2\nvirtual = 2\nschedule = "dualpipev"\n', "dualpipev needs m >= 2P=4 microbatches"),
    ("train-keep-checkpoints-word", [*TRAIN, *OUT, "--keep-checkpoints", "x"], None, "--keep-checkpoints 'x'"),
    ("train-final-checkpoint-value", [*TRAIN, *OUT, "--final-checkpoint=no"], None, "ignored explicit argument"),
    # 206e9 parameters: without the check the first layer's allocation fails deep in a rank.
    ("train-model-larger-than-memory", [*TRAIN, *OUT, "--d-model", "65536"], None,
     "GiB, more than this machine's"),
    ("train-model-larger-than-memory-ray", [*RAY, *OUT, "--d-model", "65536"], None, "choose a smaller --d-model"),
    ("train-toml-not-utf8", [*TRAIN, *OUT, "--config", "{tmp}/latin1.toml"], None, "latin1.toml' is not UTF-8"),
    ("train-triton-on-cpu-ray", [*RAY, *OUT, "--kernels", "triton", "--device", "cpu"], None,
     "need a CUDA device"),
    # train: paths
    ("train-out-is-file", [*TRAIN, "--out", "{file}"], None, "is an existing file"),
    ("train-out-under-file", [*TRAIN, "--out", "{file}/run"], None, "is a file, not a directory"),
    ("train-out-unwritable", [*TRAIN, "--out", "/proc/attnres-run"], None, "refuses new entries"),
    ("train-data-directory", [*TRAIN, *OUT, "--data", "{tmp}"], None, "it is a directory"),
    ("train-data-txt-directory", [*TRAIN, *OUT, "--data", "{tmp}/folder.txt"], None, "it is a directory"),
    ("train-data-unreadable", [*TRAIN, *OUT, "--data", "{tmp}/mem.txt"], None, "cannot be read"),
    ("train-data-missing", [*TRAIN, *OUT, "--data", "{tmp}/missing.txt"], None, "no such file"),
    ("train-config-directory", [*TRAIN, *OUT, "--config", "{tmp}"], None, "cannot be read"),
    ("train-config-missing", [*TRAIN, *OUT, "--config", "{tmp}/missing.toml"], None, "not found"),
    # train: TOML values of the wrong type
    ("toml-string-for-int", [*TRAIN, *OUT, "--config", "{toml}"], '[train]\nwarmup_steps = "5"\n',
     '[train] warmup_steps = "5" is invalid: expected an integer, found a string'),
    ("toml-float-for-int", [*TRAIN, *OUT, "--config", "{toml}"], "[model]\nvocab_size = 256.0\n",
     "expected an integer, found a float; write vocab_size = 256"),
    ("toml-bool-for-int", [*TRAIN, *OUT, "--config", "{toml}"], "[train]\nseed = true\n",
     "expected an integer, found a boolean"),
    ("toml-string-for-float", [*TRAIN, *OUT, "--config", "{toml}"], '[train]\nweight_decay = "0.1"\n',
     "expected a number, found a string"),
    ("toml-int-for-list", [*TRAIN, *OUT, "--config", "{toml}"], "[pipeline]\nlayer_counts = 3\n",
     "write layer_counts = [3]"),
    ("toml-strings-in-list", [*TRAIN, *OUT, "--config", "{toml}"], '[model]\nstream_kernels = ["4"]\n',
     "found a list holding a string"),
    ("toml-string-for-bool", [*TRAIN, *OUT, "--config", "{toml}"], '[pipeline]\ncache = "no"\n',
     "expected true or false"),
    ("toml-int-for-string", [*TRAIN, *OUT, "--config", "{toml}"], "[model]\nresidual = 5\n",
     "expected a string in quotes, found an integer"),
    ("toml-table-for-int", [*TRAIN, *OUT, "--config", "{toml}"], "[train]\neval_every = {a = 1}\n",
     "found a table"),
    ("toml-timeout-nan", [*TRAIN, *OUT, "--config", "{toml}"], "[pipeline]\ntimeout_s = nan\n", "timeout_s=nan"),
    ("toml-norm-eps-inf", [*TRAIN, *OUT, "--config", "{toml}"], "[model]\nnorm_eps = inf\n", "norm_eps=inf"),
    ("toml-unknown-key", [*TRAIN, *OUT, "--config", "{toml}"], "[train]\nbatchsize = 8\n", "batch_size"),
    ("toml-keep-checkpoints-negative", [*TRAIN, *OUT, "--config", "{toml}"], "[train]\nkeep_checkpoints = -2\n",
     "0 keeps every one"),
    # train: Ray
    ("ray-address-unreachable", [*RAY, *OUT, "--address", UNREACHABLE], None, "cannot be reached"),
    ("ray-client-address-unreachable", [*RAY, *OUT, "--address", f"ray://{UNREACHABLE}"], None,
     "cannot be reached"),
    ("ray-address-without-port", [*RAY, *OUT, "--address", "127.0.0.1"], None, "give HOST:PORT"),
    ("ray-address-bad-port", [*RAY, *OUT, "--address", "127.0.0.1:99999"], None, "give HOST:PORT"),
    ("ray-address-dashboard", [*RAY, *OUT, "--address", "http://127.0.0.1:8265"], None, "dashboard"),
    ("ray-env-address-unreachable", [*RAY, *OUT], None, "RAY_ADDRESS 127.0.0.1:1 cannot be reached"),
    ("ray-not-installed", [*RAY, *OUT], None, "pip install"),
    ("address-without-ray", [*TRAIN, *OUT, "--address", UNREACHABLE], None, "--address is for --launcher ray"),
    # simulate
    ("sweep-blocks-zero", ["simulate", "sweep", "--blocks", "0"], None, "argument --blocks"),
    ("sweep-blocks-negative", ["simulate", "sweep", "--blocks", "-4"], None, "argument --blocks"),
    ("sweep-blocks-not-dividing", ["simulate", "sweep", "--blocks", "3"], None, "must divide"),
    ("sweep-stages-zero", ["simulate", "sweep", "--stages", "0"], None, "argument --stages"),
    ("sweep-key-rank-negative", ["simulate", "sweep", "--key-rank", "-3"], None, "argument --key-rank"),
    ("sweep-tokens-float", ["simulate", "sweep", "--tokens", "1.5"], None,
     "argument --tokens: '1.5' is invalid: expected an integer"),
    ("sweep-out-is-file", ["simulate", "sweep", "--only", "bubble", "--out", "{file}"], None,
     "is an existing file"),
    ("schedule-key-rank-negative", [*MODEL_COSTS, "--key-rank", "-3"], None, "argument --key-rank"),
    ("schedule-tflops-nan", [*MODEL_COSTS, "--tflops", "nan"], None, "argument --tflops"),
    ("schedule-tflops-zero", [*MODEL_COSTS, "--tflops", "0"], None, "finite number > 0"),
    ("schedule-tflops-inf", [*MODEL_COSTS, "--tflops", "inf"], None, "argument --tflops"),
    ("schedule-tflops-word", [*MODEL_COSTS, "--tflops", "fast"], None, "'fast' is invalid: expected a number"),
    ("schedule-bandwidth-zero", [*MODEL_COSTS, "--bandwidth-gbs", "0"], None, "argument --bandwidth-gbs"),
    ("schedule-latency-negative", [*MODEL_COSTS, "--latency-us", "-1"], None, "finite number >= 0"),
    ("schedule-latency-nan", [*MODEL_COSTS, "--latency-us", "nan"], None, "argument --latency-us"),
    ("schedule-tokens-negative", [*SCHEDULE, "--layers", "8", "--block-size", "4", "--tokens", "-5"], None,
     "argument --tokens"),
    ("schedule-d-ff-negative", [*MODEL_COSTS, "--d-ff", "-1"], None, "argument --d-ff"),
    ("schedule-stages-zero", [*SCHEDULE, "--stages", "0"], None, "argument --stages"),
    ("schedule-dualpipev-few-microbatches", [*SCHEDULE, "--schedule", "dualpipev", "--virtual", "2",
                                             "--microbatches", "7"], None, "dualpipev needs m >= 2P=8 microbatches"),
    ("schedule-dualpipev-virtual-odd", [*SCHEDULE, "--schedule", "dualpipev", "--virtual", "3"], None,
     "dualpipev places exactly 2 chunks per rank"),
    ("schedule-trace-directory", [*SCHEDULE, "--trace", "{tmp}"], None, "is a directory"),
    ("schedule-plot-directory", [*SCHEDULE, "--plot", "{tmp}"], None, "is a directory"),
    ("schedule-trace-under-file", [*SCHEDULE, "--trace", "{file}/trace.json"], None, "is a file"),
    ("schedule-calibrate-from-bad-json", [*SCHEDULE, "--calibrate-from", "{tmp}/badrun"], None, "not valid JSON"),
    ("comm-stages-zero", [*COMM, "--stages", "0"], None, "argument --stages"),
    ("comm-virtual-zero", [*COMM, "--stages", "2", "--virtual", "0"], None, "argument --virtual"),
    ("comm-layer-counts-negative", [*COMM, "--stages", "2", "--layer-counts", "10,-2"], None, "at least one layer"),
    ("comm-layer-counts-word", [*COMM, "--stages", "2", "--layer-counts", "4,x"], None, LAYER_COUNTS.format("4,x")),
    ("comm-layer-counts-empty", [*COMM, "--stages", "2", "--layer-counts", ""], None, LAYER_COUNTS.format("")),
    ("memory-layer-counts-word", [*MEMORY, "--layer-counts", "2;2"], None, LAYER_COUNTS.format("2;2")),
    ("memory-layer-counts-zero", [*MEMORY, "--layer-counts", "4,0"], None, "at least one layer"),
    ("memory-stages-zero", [*MEMORY, "--stages", "0"], None, "argument --stages: '0' is invalid"),
    ("memory-dp-shard-choice", [*MEMORY, "--dp-shard", "zero3"], None, "argument --dp-shard: invalid choice"),
    ("memory-reshard-without-fsdp", [*MEMORY, "--fsdp-reshard-after-forward", "always"], None,
     "--fsdp-reshard-after-forward always needs --dp-shard fsdp"),
    ("memory-reshard-choice", [*MEMORY, "--dp-shard", "fsdp", "--fsdp-reshard-after-forward", "often"], None,
     "argument --fsdp-reshard-after-forward: invalid choice"),
    ("predict-layer-counts-word", [*PREDICT, "--layer-counts", "4,,4"], None, LAYER_COUNTS.format("4,,4")),
    ("predict-virtual-word", [*PREDICT, "--virtual", "x"], None, "--virtual 'x' is invalid: expected an integer"),
    ("predict-stages-zero", [*PREDICT, "--stages", "0"], None, "--stages '0' is invalid: expected an integer > 0"),
    ("predict-calibration-missing", ["simulate", "predict"], None, "the following arguments are required"),
    ("plan-global-batch-missing", ["simulate", "plan", "--d-model", "64"], None, "--global-batch is required"),
    ("plan-gpus-zero", [*PLAN, "--gpus", "0"], None, "--gpus '0' is invalid: expected an integer > 0"),
    ("project-tflops-word", [*PROJECT, "--tflops", "fast"], None, "--tflops 'fast' is invalid: expected a number"),
    ("simulate-unknown-command", ["simulate", "commm"], None, "argument simulate_command: invalid choice"),
    ("train-layer-counts-word", [*TRAIN, *OUT, "--stages", "2", "--layer-counts", "1,x"], None,
     LAYER_COUNTS.format("1,x")),
    # bench
    ("bench-out-is-file", ["bench", "comm", "--no-timing", "--out", "{file}"], None, "is an existing file"),
    ("bench-out-under-file", ["bench", "bubbles", "--out", "{file}/results"], None, "is a file"),
    ("bench-unknown-name", ["bench", "latency"], None, "invalid choice"),
    ("bench-no-timing-not-comm", ["bench", "overhead", "--no-timing"], None, "comm only"),
    # memory: activation checkpointing and FSDP2 names
    ("train-ac-unknown", [*TRAIN, *OUT, "--activation-checkpoint", "some"], None, "activation_checkpoint='some'"),
    ("toml-ac-unknown", [*TRAIN, *OUT, "--config", "{toml}"], '[train]\nactivation_checkpoint = "all"\n',
     "choose one of none, full, selective"),
    ("train-dp-shard-unknown", [*TRAIN, *OUT, "--dp-shard", "zero3"], None, "dp_shard='zero3'"),
    ("train-reshard-without-fsdp", [*TRAIN, *OUT, "--fsdp-reshard-after-forward", "always"], None,
     "needs dp_shard='fsdp'"),
    ("train-reshard-unknown", [*TRAIN, *OUT, "--dp-shard", "fsdp", "--fsdp-reshard-after-forward", "often"], None,
     "choose one of never, always"),
    ("train-fsdp-inprocess", [*TRAIN, *OUT, "--dp-shard", "fsdp", "--launcher", "inprocess"], None,
     "use --launcher local or ray"),
    # --fault-tolerance replicas: D >= 2 replicated pipelines (P x T ranks each), local or Ray, on cpu
    ("train-ft-unknown", [*TRAIN, *OUT, "--fault-tolerance", "always"], None, "fault_tolerance='always'"),
    ("train-ft-one-replica", [*TRAIN, *OUT, "--fault-tolerance", "replicas"], None,
     "does not support --data-parallel 1"),
    ("train-ft-inprocess", [*TRAIN, *OUT, "--fault-tolerance", "replicas", "--data-parallel", "2", "--launcher",
                            "inprocess"], None, "does not support --launcher inprocess"),
    ("train-ft-fsdp", [*TRAIN, *OUT, "--fault-tolerance", "replicas", "--data-parallel", "2", "--dp-shard", "fsdp"],
     None, "does not support --dp-shard fsdp (FSDP over the D replicas would shard each replica's state across"),
    ("train-ft-cuda", [*TRAIN, *OUT, "--fault-tolerance", "replicas", "--data-parallel", "2", "--device", "cuda"],
     None, "does not support --device cuda"),
    ("train-ft-min-replicas-above-d", [*TRAIN, *OUT, "--fault-tolerance", "replicas", "--data-parallel", "2",
                                       "--min-replicas", "3"], None, "--min-replicas 3 above --data-parallel 2"),
    ("train-ft-min-replicas-zero", [*TRAIN, *OUT, "--fault-tolerance", "replicas", "--data-parallel", "2",
                                    "--min-replicas", "0"], None, "min_replicas=0"),
    ("train-failure-in-allreduce-without-ft", [*TRAIN, *OUT, "--stages", "2", "--inject-failure", "1:1:allreduce"],
     None, "':allreduce' is for --fault-tolerance replicas"),
    ("train-failure-unknown-point", [*TRAIN, *OUT, "--fault-tolerance", "replicas", "--data-parallel", "2",
                                     "--inject-failure", "1:1:backward"], None, "can only be 'allreduce'"),
    ("train-lighthouse-without-ft", [*TRAIN, *OUT, "--lighthouse", "http://localhost:29510"], None,
     "--lighthouse is for --fault-tolerance replicas"),
    ("toml-ft-one-replica", [*TRAIN, *OUT, "--config", "{toml}"], '[train]\nfault_tolerance = "replicas"\n',
     "does not support --data-parallel 1"),
    # tensor and sequence parallelism (docs/spec.md section 10): TRAIN has 2 heads, d_ff 128, seq_len 16
    ("train-tp-zero", [*TRAIN, *OUT, "--tensor-parallel", "0"], None, "tensor_parallel=0 is invalid"),
    ("toml-tp-quoted", [*TRAIN, *OUT, "--config", "{toml}"], '[pipeline]\ntensor_parallel = "2"\n',
     "tensor_parallel"),
    ("train-tp-heads", [*TRAIN, *OUT, "--tensor-parallel", "4"], None, "does not divide the 2 heads"),
    ("toml-tp-d-ff", [*TRAIN, *OUT, "--tensor-parallel", "2", "--config", "{toml}"], "[model]\nd_ff = 33\n",
     "does not divide d_ff = 33"),
    ("train-tp-seq-len", [*TRAIN, *OUT, "--tensor-parallel", "2", "--seq-len", "15"], None,
     "does not divide --seq-len 15: sequence parallelism"),
    ("train-tp-node", [*TRAIN, *OUT, "--tensor-parallel", "2", "--device", "cuda"], None,
     "larger than a node's 1 ranks (GPUs visible on this node)"),
    ("train-tp-failure-rank", [*TRAIN, *OUT, "--tensor-parallel", "2", "--stages", "2", "--inject-failure", "4:1"],
     None, "RANK must be in 0..3 (--stages 2 x --tensor-parallel 2)"),
    ("train-tp-ray-cuda", [*TRAIN, *OUT, "--tensor-parallel", "2", "--launcher", "ray", "--device", "cuda"], None,
     "does not support --device cuda under --launcher ray"),
    ("train-tp-msar-halo", [*TRAIN, *OUT, "--tensor-parallel", "2", "--residual", "msar"], None,
     "fewer than the 11 that MSAR's widest causal convolution reads"),
    ("train-tp-fsdp-columns", [*TRAIN, *OUT, "--tensor-parallel", "2", "--dp-shard", "fsdp", "--data-parallel", "3",
                               "--batch-size", "6", "--microbatches", "2", "--device", "cpu"], None,
     "--data-parallel 3 not dividing d_model = 32"),
]

# Every refusal, argparse's included, is one line starting `error: `.
_ERROR_LINE = re.compile(r"^error: ")


@pytest.fixture
def no_start(monkeypatch):
    """Fail the test if training or Ray would start."""
    def refuse(*_args, **_kwargs):
        raise AssertionError("a bad input got as far as starting training or Ray")

    monkeypatch.setattr("attnres_pp.train.cli.run_training", refuse)
    try:
        import ray
    except ImportError:
        return
    monkeypatch.setattr(ray, "init", refuse)


def _prepare(case_id: str, tmp: Path, monkeypatch) -> None:
    (tmp / "tiny.txt").write_text("a small corpus for the bad-input cases " * 40)
    (tmp / "file").write_text("not a directory")
    (tmp / "folder.txt").mkdir()
    (tmp / "badrun").mkdir()
    (tmp / "badrun" / "summary.json").write_text("{")
    (tmp / "calibration.json").write_text(json.dumps({"calibration": CALIBRATION}))
    (tmp / "latin1.toml").write_bytes('[train]\nseed = 1 # r\u00e9glage\n'.encode("latin-1"))  # not UTF-8
    if case_id == "train-data-unreadable":
        if not os.path.exists("/proc/self/mem"):
            pytest.skip("needs /proc/self/mem")
        (tmp / "mem.txt").symlink_to("/proc/self/mem")
    if case_id == "train-out-unwritable" and not os.path.isdir("/proc/self"):
        pytest.skip("needs /proc")
    if case_id.startswith("ray-"):
        if case_id == "ray-not-installed":
            monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` now fails as if it were missing
        else:
            ray = pytest.importorskip("ray")
            if ray.is_initialized():
                pytest.skip("a Ray instance is already running in this process: the address is not used")
    if case_id == "train-triton-on-cpu-ray":  # refused before Ray starts, unless the interpreter is asked for
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    if case_id == "train-tp-node":  # one GPU on this node, whatever the machine has
        monkeypatch.setattr("attnres_pp.launch.resolve.visible_gpus", lambda: 1)
    if case_id == "ray-env-address-unreachable":
        monkeypatch.setenv("RAY_ADDRESS", UNREACHABLE)
    else:
        monkeypatch.delenv("RAY_ADDRESS", raising=False)


@pytest.mark.parametrize(("case_id", "argv", "toml", "needle"), CASES, ids=[case[0] for case in CASES])
def test_bad_input_is_one_error_line_and_exit_2(case_id, argv, toml, needle, tmp_path, monkeypatch, capsys,
                                                no_start):
    _prepare(case_id, tmp_path, monkeypatch)
    if toml is not None:
        (tmp_path / "case.toml").write_text(toml)
    argv = [a.format(tmp=tmp_path, file=tmp_path / "file", toml=tmp_path / "case.toml",
                     calibration=tmp_path / "calibration.json") for a in argv]
    try:
        code = main(argv)
    except SystemExit as exit_:  # argparse's own refusals
        code = exit_.code
    captured = capsys.readouterr()
    said = captured.out + captured.err
    errors = [line for line in said.splitlines() if _ERROR_LINE.match(line)]
    assert code == 2, said
    assert "Traceback" not in said, said
    assert len(errors) == 1, said
    assert needle in errors[0], errors[0]
    if argv[0] == "simulate":  # no usage text or progress around the refusal
        assert captured.err.splitlines() == errors, captured.err


def test_a_usage_error_of_the_top_level_command_is_one_error_line(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["simulat", "comm"])
    assert exit_.value.code == 2
    assert capsys.readouterr().err == ("error: argument command: invalid choice: 'simulat' (choose from 'prepare', "
                                       "'train', 'simulate', 'generate', 'export', 'analyze', 'plot', 'bench'); "
                                       "see attnres-pp --help\n")


def test_the_table_covers_at_least_45_inputs_across_the_three_commands():
    commands = {argv[0] for _id, argv, _toml, _needle in CASES}
    assert len(CASES) >= 45 and commands == {"train", "simulate", "bench"}
    assert len({case[0] for case in CASES}) == len(CASES)
