"""`attnres-pp generate` end to end on a checkpoint written by `attnres-pp train`: JSON output with
the contract's keys, the same greedy text in one process and pipelined, and every input mistake
as one `error:` line with exit code 2."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from attnres_pp.cli import main

REPO = Path(__file__).resolve().parents[1]
TINY = ["--layers", "4", "--d-model", "16", "--heads", "2", "--seq-len", "16", "--vocab-size", "128",
        "--batch-size", "4", "--microbatches", "2", "--residual", "msar", "--block-size", "3"]
JSON_KEYS = {"text", "tokens", "prefill_s", "decode_s_per_token"}


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    """A tiny MSAR model trained for two steps on ASCII text, checkpointed every step."""
    root = tmp_path_factory.mktemp("generate")
    data = root / "ascii.txt"
    data.write_text("def add(a, b):\n    return a + b\n\n" * 100)
    run = root / "run"
    assert main(["train", "--launcher", "local", *TINY, "--data", str(data), "--steps", "2", "--eval-every", "0",
                 "--checkpoint-every", "1", "--quiet", "--out", str(run)]) == 0
    return run


def generate_cli(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "attnres_pp.cli", "generate", *argv], cwd=REPO,
                          capture_output=True, text=True, timeout=300)


def test_generate_from_a_trained_checkpoint_prints_the_json_contract(run_dir):
    done = generate_cli("--resume", str(run_dir), "--prompt", "def ", "--max-new-tokens", "8", "--temperature",
                        "0.9", "--top-k", "20", "--seed", "3", "--json")
    assert done.returncode == 0, done.stderr
    payload = json.loads(done.stdout)
    assert JSON_KEYS <= set(payload)
    assert len(payload["tokens"]) == 8 and all(0 <= t < 128 for t in payload["tokens"])
    assert payload["text"] == bytes(payload["tokens"]).decode("utf-8", errors="replace")
    assert payload["prefill_s"] > 0 and payload["decode_s_per_token"] > 0
    assert payload["checkpoint"].endswith("step_2")  # the final step's checkpoint, the trained model
    assert "prefill 4 tokens" in done.stderr  # progress on stderr, never in the JSON


def test_greedy_text_is_the_same_in_one_process_and_pipelined(run_dir, capsys):
    argv = ["generate", "--resume", str(run_dir), "--prompt", "return", "--max-new-tokens", "11",
            "--temperature", "0", "--json"]
    assert main(argv) == 0
    single = json.loads(capsys.readouterr().out)
    assert main([*argv, "--stages", "2", "--virtual", "2", "--launcher", "inprocess", "--prefill-chunk", "2"]) == 0
    piped = json.loads(capsys.readouterr().out)
    assert piped["tokens"] == single["tokens"] and piped["text"] == single["text"]
    assert (piped["stages"], piped["virtual"]) == (2, 2)


@pytest.mark.distributed
def test_generate_over_local_rank_processes(run_dir, capsys):
    argv = ["generate", "--resume", str(run_dir / "checkpoints" / "step_1"), "--prompt", "a + b",
            "--max-new-tokens", "6", "--temperature", "0", "--json"]
    assert main(argv) == 0
    single = json.loads(capsys.readouterr().out)
    assert main([*argv, "--stages", "2", "--launcher", "local", "--prefill-chunk", "3"]) == 0
    assert json.loads(capsys.readouterr().out)["tokens"] == single["tokens"]


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--resume", "{missing}", "--prompt", "x", "--max-new-tokens", "2"], "no such directory"),
        (["--resume", "{empty}", "--prompt", "x", "--max-new-tokens", "2"], "no complete checkpoint"),
        (["--resume", "{file}", "--prompt", "x", "--max-new-tokens", "2"], "is a file"),
        (["--resume", "{broken}", "--prompt", "x", "--max-new-tokens", "2"], "cannot be read"),
        (["--resume", "{run}", "--prompt-file", "{empty}", "--max-new-tokens", "2"], "cannot read it"),
        (["--prompt", "x", "--max-new-tokens", "2"], "--resume RUN is required"),
        (["--resume", "{run}", "--prompt", "", "--max-new-tokens", "2"], "the prompt is empty"),
        (["--resume", "{run}", "--max-new-tokens", "2"], "exactly one of --prompt"),
        (["--resume", "{run}", "--prompt", "x", "--prompt-file", "f", "--max-new-tokens", "2"], "exactly one of"),
        (["--resume", "{run}", "--prompt-file", "{missing}", "--max-new-tokens", "2"], "cannot read it"),
        (["--resume", "{run}", "--prompt", "caf\u00e9", "--max-new-tokens", "2"], "outside the model's vocabulary"),
        (["--resume", "{run}", "--prompt", "x" * 10, "--max-new-tokens", "8"], "--max-new-tokens 7 or less"),
        (["--resume", "{run}", "--prompt", "x" * 17, "--max-new-tokens", "1"], "seq_len=16"),
        (["--resume", "{run}", "--prompt", "x"], "--max-new-tokens N is required"),
        (["--resume", "{run}", "--prompt", "x", "--max-new-tokens", "two"], "expected an integer"),
        (["--resume", "{run}", "--prompt", "x", "--max-new-tokens", "0"], "max_new_tokens=0"),
        (["--resume", "{run}", "--prompt", "x", "--max-new-tokens", "2", "--temperature", "-1"], "temperature=-1.0"),
        (["--resume", "{run}", "--prompt", "x", "--max-new-tokens", "2", "--stages", "3", "--virtual", "2",
          "--launcher", "inprocess"], "4 layers cannot fill"),
        (["--resume", "{run}", "--prompt", "x", "--max-new-tokens", "2", "--launcher", "mpi"], "launcher='mpi'"),
    ],
)
def test_input_mistakes_exit_2_with_one_line(run_dir, tmp_path, capsys, argv, needle):
    (tmp_path / "empty").mkdir()
    (tmp_path / "file").write_text("not a run")
    broken = tmp_path / "broken"  # a checkpoint whose shard files are damaged
    shutil.copytree(run_dir / "checkpoints" / "step_1", broken)
    shards = sorted(broken.glob("*.distcp"))
    assert shards, "the checkpoint format changed: damage its data files instead"
    for shard in shards:
        shard.write_bytes(b"\x80garbage")
    names = {"run": str(run_dir), "missing": str(tmp_path / "missing"), "empty": str(tmp_path / "empty"),
             "file": str(tmp_path / "file"), "broken": str(broken)}
    code = main(["generate", *[a.format(**names) if a.startswith("{") else a for a in argv]])
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.startswith("error: ") and needle in err and "Traceback" not in err, err
    assert len(err.strip().splitlines()) == 1, err
