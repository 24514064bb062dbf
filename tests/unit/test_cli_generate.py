"""`attnres-pp generate` end to end on a checkpoint written by `attnres-pp train`: JSON output with
the contract's keys (one object for one prompt, one per line for a batch), the same greedy text in
one process and pipelined (gloo's rules and NCCL's), batches from repeated --prompt and
--prompts-file, --stop, --device/--dtype, and every input mistake (`MISTAKES`, counted in
docs/generation.md) as one `error:` line with exit code 2."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from attnres_pp.cli import main
from tests.run_helpers import REPO

TINY = ["--layers", "4", "--d-model", "16", "--heads", "2", "--seq-len", "16", "--vocab-size", "128",
        "--batch-size", "4", "--microbatches", "2", "--residual", "msar", "--block-size", "3"]
JSON_KEYS = {"text", "tokens", "prompt_ids", "tokenizer", "prefill_s", "decode_s_per_token", "prompt_tokens",
             "checkpoint", "stages", "virtual", "tensor_parallel", "launcher"}


def _trained(tmp_path_factory, name: str, *flags: str) -> Path:
    """A tiny model trained on ASCII text with `flags`, in a fresh folder of its own."""
    root = tmp_path_factory.mktemp(name)
    data = root / "ascii.txt"
    data.write_text("def add(a, b):\n    return a + b\n\n" * 100)
    run = root / "run"
    assert main(["train", "--launcher", "local", *TINY, "--data", str(data), "--eval-every", "0", *flags, "--quiet",
                 "--out", str(run)]) == 0
    return run


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    """A tiny MSAR model trained for two steps on ASCII text, checkpointed every step."""
    return _trained(tmp_path_factory, "generate", "--steps", "2", "--checkpoint-every", "1")


@pytest.fixture(scope="module")
def learned_run_dir(tmp_path_factory) -> Path:
    """The same tiny model with learned positions (the recipe of older checkpoints): its context ends at seq_len."""
    return _trained(tmp_path_factory, "generate_learned", "--positions", "learned", "--steps", "1")


# In the test's process: what is checked is what `generate` writes to stdout and stderr, which does
# not depend on the interpreter it runs in (the `python -m attnres_pp.cli` entry point runs fresh in
# tests/cli_batch.py's children and the installed console script in tests/repo/test_wheel_install.py).
def test_generate_from_a_trained_checkpoint_prints_the_json_contract(run_dir, capfd):
    code = main(["generate", "--resume", str(run_dir), "--prompt", "def ", "--max-new-tokens", "8", "--temperature",
                 "0.9", "--top-k", "20", "--seed", "3", "--json"])
    done = capfd.readouterr()
    assert code == 0, done.err
    assert len(done.out.splitlines()) == 1  # one prompt: one object, as before batches
    payload = json.loads(done.out)
    assert set(payload) == JSON_KEYS
    assert len(payload["tokens"]) == 8 and all(0 <= t < 128 for t in payload["tokens"])
    assert payload["text"] == bytes(payload["tokens"]).decode("utf-8", errors="replace")
    assert payload["prefill_s"] > 0 and payload["decode_s_per_token"] > 0
    assert payload["checkpoint"].endswith("step_2")  # the final step's checkpoint, the trained model
    assert "prefill 4 tokens" in done.err  # progress on stderr, never in the JSON


def test_greedy_text_is_the_same_in_one_process_and_pipelined(run_dir, capsys):
    argv = ["generate", "--resume", str(run_dir), "--prompt", "return", "--max-new-tokens", "11",
            "--temperature", "0", "--json"]
    assert main(argv) == 0
    single = json.loads(capsys.readouterr().out)
    assert main([*argv, "--stages", "2", "--virtual", "2", "--launcher", "inprocess", "--prefill-chunk", "2"]) == 0
    piped = json.loads(capsys.readouterr().out)
    assert piped["tokens"] == single["tokens"] and piped["text"] == single["text"]
    assert (piped["stages"], piped["virtual"]) == (2, 2)


def test_nccl_rules_in_process_give_the_single_process_tokens(run_dir, capsys):
    argv = ["generate", "--resume", str(run_dir), "--prompt", "def a", "--prompt", "r", "--max-new-tokens", "9",
            "--temperature", "0", "--json"]
    assert main(argv) == 0
    single = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert main([*argv, "--launcher", "inprocess", "--p2p-semantics", "nccl", "--stages", "2", "--virtual", "2",
                 "--prefill-chunk", "2"]) == 0
    piped = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [p["tokens"] for p in piped] == [s["tokens"] for s in single] and len(piped) == 2


def _lines(out: str) -> list[dict]:
    return [json.loads(line) for line in out.splitlines()]


def test_a_batch_prints_one_object_per_prompt_in_order_each_as_alone(run_dir, tmp_path, capsys):
    prompts = ["def add(", "r", "return a\n\nde"]  # lengths 8, 1, 12; the last holds newlines
    common = ["generate", "--resume", str(run_dir), "--max-new-tokens", "5", "--temperature", "0", "--json"]
    alone = []
    for prompt in prompts:
        assert main([*common, "--prompt", prompt]) == 0
        alone.append(_lines(capsys.readouterr().out)[0])
    assert main([*common, *[a for p in prompts for a in ("--prompt", p)], "--stages", "2", "--launcher",
                 "inprocess"]) == 0
    batch = _lines(capsys.readouterr().out)
    assert [b["tokens"] for b in batch] == [a["tokens"] for a in alone]
    assert [b["prompt_tokens"] for b in batch] == [8, 1, 12] and all(set(b) == JSON_KEYS for b in batch)
    jsonl = tmp_path / "prompts.jsonl"
    jsonl.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    assert main([*common, "--prompts-file", str(jsonl)]) == 0
    assert [b["tokens"] for b in _lines(capsys.readouterr().out)] == [a["tokens"] for a in alone]
    lines = tmp_path / "prompts.txt"
    lines.write_bytes(b"def add(\r\nr\n")  # one prompt per line, CRLF or LF
    assert main([*common, "--prompts-file", str(lines)]) == 0
    assert [b["tokens"] for b in _lines(capsys.readouterr().out)] == [a["tokens"] for a in alone[:2]]
    whole = tmp_path / "whole.txt"
    whole.write_text(prompts[2])  # --prompt-file: the whole file is one prompt, newlines included
    assert main([*common, "--prompt-file", str(whole)]) == 0
    assert _lines(capsys.readouterr().out)[0]["tokens"] == alone[2]["tokens"]


def test_generation_runs_past_the_trained_length_the_same_pipelined(run_dir, capsys):
    """A rotary-position run (seq_len 16) generates 16 tokens after a 20-byte prompt (to position 36,
    past 2 x seq_len), its caches sliding over a window of 6: the same greedy tokens in one process
    and pipelined (P = 2 x T = 2 with this window: on rank processes in
    `test_generate_over_local_rank_processes`, on thread ranks in
    tests/parity/test_generate_window.py::test_tensor_parallel_greedy_tokens_past_the_trained_length)."""
    argv = ["generate", "--resume", str(run_dir), "--prompt", "def add(a, b): retur", "--max-new-tokens", "16",
            "--window", "6", "--temperature", "0", "--json"]
    assert main(argv) == 0
    single = _lines(capsys.readouterr().out)[0]
    assert len(single["tokens"]) == 16 and single["prompt_tokens"] == 20
    assert main([*argv, "--stages", "2", "--launcher", "inprocess", "--prefill-chunk", "3"]) == 0
    assert _lines(capsys.readouterr().out)[0]["tokens"] == single["tokens"]
    without_window = [a for a in argv if a not in ("--window", "6")]
    assert main(without_window) == 0  # the default window: the trained 16 positions
    assert _lines(capsys.readouterr().out)[0]["tokens"] != single["tokens"]


def test_stop_ends_a_sequence_before_the_string(run_dir, capsys):
    common = ["generate", "--resume", str(run_dir), "--prompt", "def ", "--max-new-tokens", "8", "--temperature",
              "0", "--json"]
    assert main(common) == 0
    full = _lines(capsys.readouterr().out)[0]
    stop = bytes(full["tokens"][3:5]).decode("utf-8")
    cut = bytes(full["tokens"]).index(stop.encode("utf-8"))
    assert main([*common, "--stop", stop]) == 0
    captured = capsys.readouterr()
    stopped = _lines(captured.out)[0]
    assert stopped["tokens"] == full["tokens"][:cut] and stop not in stopped["text"]
    assert "stopped at" in captured.err


def test_device_cpu_with_bf16_generates(run_dir, capsys):
    assert main(["generate", "--resume", str(run_dir), "--prompt", "def ", "--max-new-tokens", "4", "--device",
                 "cpu", "--dtype", "bf16", "--json"]) == 0
    out = _lines(capsys.readouterr().out)
    assert len(out) == 1 and len(out[0]["tokens"]) == 4 and all(0 <= t < 128 for t in out[0]["tokens"])


@pytest.mark.distributed
def test_generate_over_local_rank_processes(run_dir, capsys):
    """P = 2 x T = 2 on four rank processes over gloo (the default launcher; its pipeline hops and tp
    collectives both cross processes), past the trained length (to position 36, past 2 x seq_len)
    under a window of 6 that each rank's caches must slide over. P = 2 alone over gloo:
    tests/parity/test_generate_pipeline.py::test_greedy_tokens_are_identical_over_gloo."""
    argv = ["generate", "--resume", str(run_dir / "checkpoints" / "step_1"), "--prompt", "def add(a, b): retur",
            "--max-new-tokens", "16", "--window", "6", "--temperature", "0", "--json"]
    assert main(argv) == 0
    single = json.loads(capsys.readouterr().out)
    assert len(single["tokens"]) == 16 and single["prompt_tokens"] == 20
    assert main([a for a in argv if a not in ("--window", "6")]) == 0  # the window is what the ranks must get
    assert json.loads(capsys.readouterr().out)["tokens"] != single["tokens"]
    assert main([*argv, "--stages", "2", "--tensor-parallel", "2", "--prefill-chunk", "3"]) == 0  # 4 processes
    split = json.loads(capsys.readouterr().out)
    assert split["tokens"] == single["tokens"] and (split["stages"], split["tensor_parallel"]) == (2, 2)
    assert split["launcher"] == "local"


MISTAKES = [
    (["--resume", "{missing}", "--prompt", "x", "--max-new-tokens", "2"], "no such directory"),
    (["--resume", "{empty}", "--prompt", "x", "--max-new-tokens", "2"], "no complete checkpoint"),
    (["--resume", "{file}", "--prompt", "x", "--max-new-tokens", "2"], "is a file"),
    (["--resume", "{broken}", "--prompt", "x", "--max-new-tokens", "2"], "the shard file is truncated"),
    (["--resume", "{run}", "--prompt-file", "{empty}", "--max-new-tokens", "2"], "cannot read it"),
    (["--prompt", "x", "--max-new-tokens", "2"], "--resume RUN is required"),
    (["--resume", "{run}", "--prompt", "", "--max-new-tokens", "2"], "the prompt is empty"),
    (["--resume", "{run}", "--max-new-tokens", "2"], "exactly one of --prompt"),
    (["--resume", "{run}", "--prompt", "x", "--prompt-file", "f", "--max-new-tokens", "2"], "exactly one of"),
    (["--resume", "{run}", "--prompt-file", "{missing}", "--max-new-tokens", "2"], "cannot read it"),
    (["--resume", "{run}", "--prompt", "caf\u00e9", "--max-new-tokens", "2"], "outside the model's vocabulary"),
    (["--resume", "{learned}", "--prompt", "x" * 10, "--max-new-tokens", "8"], "--max-new-tokens 7 or less"),
    # A lone surrogate no argv byte maps to (argv's own non-UTF-8 bytes are taken as the bytes they are).
    (["--resume", "{run}", "--prompt", "x\ud800", "--max-new-tokens", "2"], "--prompt holds '\\ud800' at character 1"),
    (["--resume", "{run}", "--prompt", "x", "--stop", "\udfff", "--max-new-tokens", "2"], "--stop holds"),
    (["--resume", "{learned}", "--prompt", "x" * 17, "--max-new-tokens", "1"], "seq_len=16 (no sliding window)"),
    (["--resume", "{run}", "--prompt", "x", "--max-new-tokens", "2", "--window", "0"], "window=0"),
    (["--resume", "{run}", "--prompt", "x", "--max-new-tokens", "2", "--window", "4.5"],
     "--window '4.5' is invalid: expected an integer"),
    (["--resume", "{run}", "--prompt", "x"], "--max-new-tokens N is required"),
    (["--resume", "{run}", "--prompt", "x", "--max-new-tokens", "two"], "expected an integer"),
    (["--resume", "{run}", "--prompt", "x", "--max-new-tokens", "0"], "max_new_tokens=0"),
    (["--resume", "{run}", "--prompt", "x", "--max-new-tokens", "2", "--temperature", "-1"], "temperature=-1.0"),
    (["--resume", "{run}", "--prompt", "x", "--max-new-tokens", "2", "--stages", "3", "--virtual", "2",
     "--launcher", "inprocess"], "4 layers cannot fill"),
    (["--resume", "{run}", "--prompt", "x", "--max-new-tokens", "2", "--launcher", "mpi"], "launcher='mpi'"),
    (["--resume", "{run}", "--prompts-file", "{nothing}", "--max-new-tokens", "2"], "holds no prompts"),
    (["--resume", "{run}", "--prompts-file", "{blank}", "--max-new-tokens", "2"], "line 2 is blank"),
    (["--resume", "{run}", "--prompts-file", "{bad.jsonl}", "--max-new-tokens", "2"], "line 2 is not JSON"),
    (["--resume", "{run}", "--prompts-file", "{noprompt.jsonl}", "--max-new-tokens", "2"],
     'line 1 is not an object with a "prompt" string'),
    (["--resume", "{run}", "--prompts-file", "{missing}", "--max-new-tokens", "2"], "cannot read it"),
    (["--resume", "{run}", "--prompt-file", "{blank}", "--prompts-file", "{blank}", "--max-new-tokens", "2"],
     "got --prompt-file and --prompts-file"),
    (["--resume", "{run}", "--prompt", "x", "--prompts-file", "{blank}", "--max-new-tokens", "2"],
     "got --prompt and --prompts-file"),
    (["--resume", "{run}", "--prompt", "x", "--prompt", "", "--max-new-tokens", "2"], "prompt 2: the prompt is empty"),
    (["--resume", "{learned}", "--prompt", "x", "--prompt", "x" * 10, "--max-new-tokens", "8"],
     "prompt 2: the prompt (10 tokens)"),
    (["--resume", "{run}", "--prompt", "x", "--prompt", "caf\u00e9", "--max-new-tokens", "2"],
     "prompt 2: prompt byte 0xc3"),
    (["--resume", "{run}", "--prompt", "x", "--max-new-tokens", "2", "--stop", ""], "--stop needs a non-empty"),
    (["--resume", "{run}", "--prompt", "x", "--max-new-tokens", "2", "--device", "cuda"],
     "--device cuda needs a CUDA GPU"),
    (["--resume", "{run}", "--prompt", "x", "--max-new-tokens", "2", "--device", "tpu"], "device='tpu'"),
    (["--resume", "{run}", "--prompt", "x", "--max-new-tokens", "2", "--dtype", "fp16"], "dtype='fp16'"),
    (["--resume", "{run}", "--prompt", "x", "--max-new-tokens", "2", "--p2p-semantics", "mpi"],
     "p2p_semantics='mpi'"),
    (["--resume", "{run}", "--prompt", "x", "--max-new-tokens", "2", "--tensor-parallel", "3"],
     "--tensor-parallel 3 does not divide the checkpoint's 2 heads"),
    (["--resume", "{run}", "--prompt", "x", "--max-new-tokens", "2", "--tensor-parallel", "0"],
     "tensor_parallel=0"),
    (["--resume", "{run}", "--prompt", "x", "--max-new-tokens", "2", "--threads", "0"],
     "--threads '0' is invalid: expected an integer > 0, e.g. --threads 1"),
    (["--resume", "{run}", "--prompt", "x", "--max-new-tokens", "2", "--threads", "nan"],
     "--threads 'nan' is invalid: expected an integer"),
]


@pytest.mark.parametrize(("argv", "needle"), MISTAKES)
def test_input_mistakes_exit_2_with_one_line(run_dir, learned_run_dir, tmp_path, capsys, monkeypatch, argv, needle):
    monkeypatch.setenv("ATTNRES_PP_FORCE_CPU", "1")  # --device cuda must fail the same way on a GPU machine
    (tmp_path / "empty").mkdir()
    (tmp_path / "nothing").write_bytes(b"")
    (tmp_path / "blank").write_text("a\n\nb\n")
    (tmp_path / "bad.jsonl").write_text('{"prompt": "a"}\n{"prompt": "b"\n')
    (tmp_path / "noprompt.jsonl").write_text('{"text": "a"}\n')
    (tmp_path / "file").write_text("not a run")
    broken = tmp_path / "broken"  # a checkpoint whose shard files are damaged
    shutil.copytree(run_dir / "checkpoints" / "step_1", broken)
    shards = sorted(broken.glob("*.distcp"))
    assert shards, "the checkpoint format changed: damage its data files instead"
    for shard in shards:
        shard.write_bytes(b"\x80garbage")
    names = {"run": str(run_dir), "learned": str(learned_run_dir), "broken": str(broken),
             **{name: str(tmp_path / name) for name in ("missing", "empty", "file", "nothing", "blank")}}
    names.update({name.replace(".", "_"): str(tmp_path / name) for name in ("bad.jsonl", "noprompt.jsonl")})
    argv = [a.replace(".jsonl}", "_jsonl}") for a in argv]
    code = main(["generate", *[a.format(**names) if a.startswith("{") else a for a in argv]])
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.startswith("error: ") and needle in err and "Traceback" not in err, err
    assert len(err.strip().splitlines()) == 1, err


def test_docs_state_the_number_of_input_mistakes():
    text = (REPO / "docs" / "generation.md").read_text()
    assert f"{len(MISTAKES)} input mistakes" in text, f"docs/generation.md should say {len(MISTAKES)} input mistakes"
