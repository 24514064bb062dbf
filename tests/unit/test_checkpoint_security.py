"""Loading a checkpoint runs no code from it: hand-made `.metadata` gadgets (attribute walks through an
admitted module, builtins, GLOBAL / STACK_GLOBAL / INST, REDUCE and BUILD on admitted classes with
hostile arguments, a truncated file) are refused by the guarded unpickler, by `train --resume` and
by `generate --resume`, each with one `error:` line, exit 2, and no side effect (a marker file that
every gadget would create is never created)."""

from __future__ import annotations

import pickle
import shutil
from pathlib import Path

import pytest

from attnres_pp.cli import main
from attnres_pp.train.checkpoint import latest_checkpoint
from attnres_pp.train.metadata_pickle import ADMITTED, CheckpointRefused, load_metadata
from tests.cli_batch import Run, run_cli_batch
from tests.pickle_gadgets import stack_global, text

# One worker runs the module (--dist loadgroup): its trained run and its one CLI child are built once.
pytestmark = pytest.mark.xdist_group("checkpoint-security")

TINY = ["--layers", "2", "--d-model", "16", "--heads", "2", "--seq-len", "8", "--batch-size", "2",
        "--microbatches", "1", "--eval-every", "0", "--quiet"]




def _call(func: bytes, *args: bytes) -> bytes:
    """func(*args) through REDUCE; the args are already pickled values."""
    return func + b"(" + b"".join(args) + b"tR"  # MARK ... TUPLE REDUCE


def _program(body: bytes) -> bytes:
    return b"\x80\x04" + body + b"."  # PROTO 4 ... STOP


def gadgets(marker: Path) -> dict[str, bytes]:
    """Pickles that create `marker` when unpickled by plain pickle (or by an unpickler that admits
    any name under `torch.distributed.checkpoint.`); each must be refused."""
    shell = text(f"touch {marker}")
    code = text(f"open({str(marker)!r}, 'w').close()")  # for eval
    return {
        # The reported attack: protocol 4 walks `os.system` through an admitted module's namespace.
        "attribute walk via an admitted module":
            _program(_call(stack_global("torch.distributed.checkpoint.filesystem", "os.system"), shell)),
        "attribute walk via the metadata module":
            _program(_call(stack_global("torch.distributed.checkpoint.metadata", "os.system"), shell)),
        "dotted walk to builtins through torch":
            _program(_call(stack_global("torch", "serialization.os.system"), shell)),
        "builtins.eval by STACK_GLOBAL": _program(_call(stack_global("builtins", "eval"), code)),
        "builtins.exec by GLOBAL": b"cbuiltins\nexec\n(V" + f"open({str(marker)!r}, 'w').close()".encode() + b"\ntR.",
        "os.system by GLOBAL": b"cos\nsystem\n(V" + f"touch {marker}".encode() + b"\ntR.",
        "getattr(os, 'system')": _program(_call(
            _call(stack_global("builtins", "getattr"), _call(stack_global("builtins", "__import__"), text("os")),
                  text("system")), shell)),
        "INST opcode": b"(V" + f"touch {marker}".encode() + b"\nios\nsystem\n.",
        # Admitted names used as weapons: a dataclass REDUCEd with arguments, a factory with an object.
        "REDUCE on an admitted class": _program(_call(
            stack_global("torch.distributed.checkpoint.metadata", "Metadata"), shell)),
        "REDUCE of an admitted factory on an admitted object": _program(_call(
            stack_global("torch", "Size"),
            stack_global("torch.distributed.checkpoint.metadata", "Metadata") + b")\x81")),  # NEWOBJ
        "REDUCE of a dtype": _program(_call(stack_global("torch", "float32"), shell)),
        "BUILD on a factory's product": _program(
            _call(stack_global("pathlib", "PosixPath"), text("/tmp"))
            + b"}" + text("_raw_paths") + shell + b"sb"),
        "NEWOBJ of an unlisted class": _program(stack_global("subprocess", "Popen") + b"(" + shell + b"\x85t\x81"),
        "persistent id": _program(shell + b"Q"),
        "extension registry": _program(b"\x82\x01"),
    }


@pytest.fixture()
def marker(tmp_path) -> Path:
    return tmp_path / "pwned"


@pytest.mark.subprocess
def test_each_gadget_really_runs_under_plain_pickle(marker):
    """The gadgets are real attacks: plain pickle runs the ones that need no refused opcode."""
    live = gadgets(marker)
    for name in ("attribute walk via an admitted module", "os.system by GLOBAL", "builtins.eval by STACK_GLOBAL",
                 "getattr(os, 'system')", "INST opcode"):
        marker.unlink(missing_ok=True)
        try:
            pickle.loads(live[name])
        except Exception:  # noqa: BLE001 - what the call returns afterwards does not matter
            pass
        assert marker.exists(), f"{name}: plain pickle did not run it, so the gadget proves nothing"
    marker.unlink()


@pytest.mark.parametrize("name", sorted(gadgets(Path("/m"))))
def test_the_guarded_unpickler_refuses_every_gadget(tmp_path, marker, name):
    path = tmp_path / ".metadata"
    path.write_bytes(gadgets(marker)[name])
    with pytest.raises(CheckpointRefused) as refused:
        load_metadata(path)
    assert "\n" not in str(refused.value) and str(path) in str(refused.value)
    assert not marker.exists()


@pytest.mark.subprocess
def test_the_prefix_rule_would_have_run_the_reported_gadget(tmp_path, marker):
    """A prefix rule (any name under a `torch.distributed.checkpoint.` module) resolves `os.system`;
    the exact list does not hold it."""
    class PrefixRule(pickle.Unpickler):
        def find_class(self, module, name):
            if module.startswith("torch.distributed.checkpoint."):
                return super().find_class(module, name)
            raise pickle.UnpicklingError(f"{module}.{name}")

    import io
    PrefixRule(io.BytesIO(gadgets(marker)["attribute walk via an admitted module"])).load()
    assert marker.exists()
    assert not any("." in name for _, name in ADMITTED)


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("security") / "run"
    assert main(["train", *TINY, "--launcher", "local", "--steps", "2", "--checkpoint-every", "1",
                 "--out", str(run)]) == 0
    return run


def test_a_real_checkpoint_loads_and_a_truncated_one_is_refused(trained_run, tmp_path):
    metadata = latest_checkpoint(trained_run) / ".metadata"
    assert load_metadata(metadata).state_dict_metadata  # what DCP writes is admitted
    data = metadata.read_bytes()
    for cut in (1, len(data) // 2, len(data) - 1):
        damaged = tmp_path / f"cut{cut}"
        damaged.write_bytes(data[:cut])
        with pytest.raises(CheckpointRefused, match="truncated or damaged"):
            load_metadata(damaged)


def _hostile_copy(trained_run: Path, tmp_path: Path, payload: bytes) -> Path:
    run = tmp_path / "hostile"
    shutil.copytree(trained_run, run)
    (latest_checkpoint(run) / ".metadata").write_bytes(payload)
    return run


def _argv(command: str, run: Path) -> list[str]:
    return {"train": ["train", "--resume", str(run), "--steps", "3", "--launcher", "local", "--quiet"],
            "generate": ["generate", "--resume", str(run), "--prompt", "def ", "--max-new-tokens", "2"]}[command]


FRESH = "attribute walk via an admitted module"


@pytest.fixture(scope="module")
def fresh_refusals(trained_run, tmp_path_factory) -> tuple[dict[str, Run], Path]:
    """The reported attack (FRESH) resumed by both commands in one fresh interpreter (`tests.cli_batch`),
    each on its own copy: each run's exit status and stderr, and the marker its gadget would create."""
    folder = tmp_path_factory.mktemp("fresh")
    marker = folder / "pwned"
    commands = ["train", "generate"]
    argvs = [_argv(command, _hostile_copy(trained_run, folder / command, gadgets(marker)[FRESH]))
             for command in commands]
    return dict(zip(commands, run_cli_batch(argvs, timeout_s=480), strict=True)), marker


# The reported attack goes through the CLI in a fresh interpreter (the exit status and stderr of
# `python -m attnres_pp.cli`); the other gadgets through the same `main` in this process.
@pytest.mark.parametrize(("name", "fresh"), [
    # both fresh runs in the first one's set-up: 240 s each, as when each test ran its own
    pytest.param(FRESH, True, marks=[pytest.mark.subprocess, pytest.mark.timeout(600)]),
    ("os.system by GLOBAL", False), ("REDUCE on an admitted class", False)])
@pytest.mark.parametrize("command", ["train", "generate"])
def test_resume_from_a_hostile_checkpoint_is_one_error_line(request, trained_run, tmp_path, marker, name, fresh,
                                                            command, capsys):
    if fresh:
        by_command, marker = request.getfixturevalue("fresh_refusals")
        status, stderr = by_command[command].returncode, by_command[command].stderr
    else:
        capsys.readouterr()
        status = main(_argv(command, _hostile_copy(trained_run, tmp_path, gadgets(marker)[name])))
        stderr = capsys.readouterr().err
    assert status == 2, stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "refusing to load" in lines[0], stderr
    assert "Traceback" not in stderr
    assert not marker.exists()
