"""A seeded fuzzer over a real small checkpoint: N_CASES mutations of its `.metadata` (bit flips,
truncations, inserted bytes and inserted opcode gadgets: the hang, memory and code-running ones),
of its meta.json and of its shard (every mutation kind of each file drawn, and every gadget inserted
in turn, each asserted to have been tried), each loaded with `read_parameters` under a 5 s timer and
a +256 MiB address-space limit, all in one child process (a fork of the test's, which has torch
imported already). Asserted: no hang, no memory blow-up, no exception but CheckpointRefused (no
traceback), no code run (an audit hook watches for process events and for an open of the gadgets'
marker file, and the marker never appears) and no read outside the folder (the hook records every
open; a decoy checkpoint beside it is never opened). The counts are printed:

    PYTHONPATH=. python3 -m pytest -p no:benchmark -q -s tests/unit/test_checkpoint_fuzz.py
"""

from __future__ import annotations

import json
import os
import random
import signal
import sys
import tempfile
import time
import traceback
from pathlib import Path

import pytest

SEED = 29
N_CASES = 500  # 53 gadget inserts (each of the 33 at least once) and every kind of each file: asserted
CASE_SECONDS = 5
EXTRA_MEMORY = 256 << 20


def _text(value: str) -> bytes:
    data = value.encode()
    return b"\x8c" + bytes([len(data)]) + data


def _gadgets(marker: Path) -> list[bytes]:
    """Opcode snippets to insert: each is harmful somewhere (runs code, hangs a naive check, allocates)."""
    touch = f"touch {marker}".encode()
    size = _text("torch") + _text("Size") + b"\x93"
    return [
        b"cos\nsystem\n(V" + touch + b"\ntR",  # GLOBAL os.system, REDUCE
        _text("torch.distributed.checkpoint.filesystem") + _text("os.system") + b"\x93(" + _text(touch.decode())
        + b"tR",
        b"cbuiltins\neval\n(V" + f"open({str(marker)!r}, 'w').close()".encode() + b"\ntR",
        size + b")" + b"2\x86" * 40 + b"\x85R",  # 2^40 leaves under torch.Size
        b"]\x94h\x00a",  # a list holding itself
        b")" + b"\x85" * 5000,  # deep tuples
        b"\x96" + (2 ** 31).to_bytes(8, "little"),  # BYTEARRAY8
        b"\x95" + (2 ** 40).to_bytes(8, "little"),  # FRAME
        b"\x8f", b"\x90", b"\x91", b"\x97", b"\x98",  # sets, buffers
        b"b", b"\x81", b"R", b"s", b"u", b"a", b"e", b"2", b"0", b"(", b"t", b".",
        b"j" + (2 ** 31).to_bytes(4, "little"), b"h\x00", b"}b", b"N", b"\x8a\xff" + b"\x7f" * 255,
    ]


BYTE_KINDS, META_KINDS = 5, 6


def _mutate_bytes(rng: random.Random, data: bytes, inserts: list[bytes], kind: int, turn: int) -> bytes:
    """`data` mutated by `kind` (< BYTE_KINDS); a gadget insert (kind 3) takes the inserts in turn."""
    data = bytearray(data)
    if kind == 0:  # bit flips
        for _ in range(rng.randint(1, 8)):
            position = rng.randrange(len(data))
            data[position] ^= 1 << rng.randrange(8)
    elif kind == 1:  # truncation
        data = data[:rng.randrange(len(data))]
    elif kind == 2:  # random bytes inserted
        position = rng.randrange(len(data))
        data[position:position] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 16)))
    elif kind == 3:  # a gadget inserted
        position = rng.randrange(len(data))
        data[position:position] = inserts[turn % len(inserts)]
    else:  # a byte overwritten with a chosen value (an opcode or a length byte)
        data[rng.randrange(len(data))] = rng.choice((0, 1, 0x7F, 0x80, 0xFF, *b"bR\x81s.)]}(th"))
    return bytes(data)


def _mutate_meta(rng: random.Random, text: str, kind: int) -> bytes:
    """meta.json mutated by `kind` (< META_KINDS)."""
    if kind == 0:
        return text.encode()[:rng.randrange(len(text))]
    if kind == 1:
        return b"[" * 100_000 + b"]" * 100_000  # nesting beyond the parser's recursion
    if kind == 2:
        return rng.choice([b"5", b"null", b"[]", b'"x"', b"{}", b'{"config": 5}'])
    meta = json.loads(text)
    model = meta["config"]["model"]
    if kind == 3:  # a size in the config changed
        key = rng.choice(sorted(k for k, v in model.items() if isinstance(v, int) and not isinstance(v, bool)))
        model[key] = rng.choice([0, -1, 1, 2, 3, 7, 64, 10 ** 6, 10 ** 12, 2 ** 63, "x", None, [1]])
    elif kind == 4:  # a key removed or a value replaced anywhere in the model table
        key = rng.choice(sorted(model))
        if rng.random() < 0.5:
            del model[key]
        else:
            model[key] = rng.choice([None, "x", [], {}, 1.5, True])
    else:
        data = bytearray(text.encode())
        data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
        return bytes(data)
    return json.dumps(meta).encode()


def _child(work: Path, n_cases: int) -> dict:
    """Runs in the child: make the checkpoint, a decoy beside it, then the cases. Returns the counts."""
    import resource

    import torch

    torch.set_num_threads(1)
    from attnres_pp.model import ModelConfig, Transformer
    from attnres_pp.train.config import TrainConfig
    from attnres_pp.train.metadata_pickle import CheckpointRefused
    from attnres_pp.train.optim import build_optimizer
    from attnres_pp.train.shards import read_parameters, save_shard, shard_state

    cfg = ModelConfig(n_layers=1, d_model=8, n_heads=1, seq_len=4, vocab_size=16)
    folders = {}
    for name, seed in (("run", 0), ("decoy", 1)):
        model = Transformer(cfg, backend="torch", seed=seed)
        params = dict(model.named_parameters())
        folder = work / name / "checkpoints" / "step_1"
        save_shard(folder, shard_state(model, params, build_optimizer(model, TrainConfig()), "dp0.layers0:1"),
                   distributed=False)
        (folder / "meta.json").write_text(json.dumps({"format": 2, "steps_done": 1,
                                                      "config": {"model": cfg.to_dict()}}))
        folders[name] = folder
    step, decoy = folders["run"], folders["decoy"]
    marker = work / "pwned"
    originals = {name: (step / name).read_bytes() for name in (".metadata", "meta.json", "__0_0.distcp")}
    inserts = _gadgets(marker)
    # Decoy shard names that a mutated path could reach, and absolute ones, inserted as text.
    inserts += [_text("../../../decoy/checkpoints/step_1/__0_0.distcp"), _text(str(decoy / "__0_0.distcp")),
                _text("__0_0.distcp/../../../../decoy/checkpoints/step_1/__0_0.distcp")]

    opened_outside, code_runs = [], []
    decoy_root, step_root = str(decoy.parent.parent), str(step)

    def audit(event: str, args) -> None:
        if event == "open" and isinstance(args[0], (str, bytes, os.PathLike)):
            path = os.fsdecode(args[0])
            if path.startswith(decoy_root) or (path.endswith(".distcp") and not path.startswith(step_root)):
                opened_outside.append(path)
            if path == str(marker):  # what the eval/exec gadgets do
                code_runs.append(f"open {path}")
        elif event in ("os.system", "subprocess.Popen", "os.exec", "os.posix_spawn", "os.fork"):
            code_runs.append(event)

    read_parameters(step)  # warm up: imports and first-use allocations happen outside the limit
    sys.addaudithook(audit)
    status = Path("/proc/self/status").read_text()
    vm = int(next(line for line in status.splitlines() if line.startswith("VmSize")).split()[1]) * 1024
    resource.setrlimit(resource.RLIMIT_AS, (vm + EXTRA_MEMORY, resource.RLIM_INFINITY))

    def expired(*_):
        raise TimeoutError

    signal.signal(signal.SIGALRM, expired)
    rng = random.Random(SEED)
    counts = {"cases": 0, "refused": 0, "loaded ok": 0, "hangs": 0, "memory": 0, "tracebacks": 0}
    kinds_tried: set[str] = set()
    gadget_turn = 0
    examples = []
    started = time.monotonic()
    for case in range(n_cases):
        target = rng.choices([".metadata", "meta.json", "__0_0.distcp"], weights=(6, 2, 2))[0]
        kind = rng.randrange(META_KINDS if target == "meta.json" else BYTE_KINDS)
        kinds_tried.add(f"{target} {kind}")
        if target == "meta.json":
            mutated = _mutate_meta(rng, originals[target].decode(), kind)
        else:
            gadget_turn += target == ".metadata" and kind == 3
            mutated = _mutate_bytes(rng, originals[target], inserts if target == ".metadata" else [b"\x00" * 64],
                                    kind, gadget_turn - 1)
        (step / target).write_bytes(mutated)
        counts["cases"] += 1
        signal.setitimer(signal.ITIMER_REAL, CASE_SECONDS)
        try:
            read_parameters(step)
            counts["loaded ok"] += 1
        except CheckpointRefused as error:
            counts["refused"] += 1
            if "\n" in str(error) or len(str(error)) > 1000:
                counts["tracebacks"] += 1
                examples.append(f"case {case} ({target}): a multi-line or long message {str(error)[:300]!r}")
        except TimeoutError:
            counts["hangs"] += 1
            examples.append(f"case {case} ({target}): over {CASE_SECONDS} s")
        except MemoryError:
            counts["memory"] += 1
            examples.append(f"case {case} ({target}): MemoryError")
        except BaseException as error:  # noqa: BLE001 - anything else is a finding
            counts["tracebacks"] += 1
            examples.append(f"case {case} ({target}): {type(error).__name__}: "
                            f"{traceback.format_exc()[-600:]}")
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
        (step / target).write_bytes(originals[target])
    counts["seconds"] = round(time.monotonic() - started, 1)
    counts["code runs"] = len(code_runs) + marker.exists()
    counts["reads outside"] = len(opened_outside)
    counts["kinds tried"] = sorted(kinds_tried)
    counts["gadgets inserted"], counts["gadgets"] = gadget_turn, len(inserts)
    counts["examples"] = examples[:10] + opened_outside[:5] + code_runs[:5]
    return counts


def _in_a_fork(work: Path, n_cases: int, timeout_s: float = 300.0) -> dict:
    """_child's counts, run in a forked child (its limits and audit hook die with it); the child is
    SIGKILLed and the test fails past `timeout_s`."""
    with tempfile.TemporaryFile() as out:
        pid = os.fork()
        if pid == 0:  # the child: never returns into pytest
            code = 1
            try:
                out.write(json.dumps(_child(work, n_cases)).encode())
                code = 0
            except BaseException:  # noqa: BLE001 - reported to the parent
                out.write(traceback.format_exc().encode())
            finally:
                out.flush()
                os._exit(code)
        deadline = time.monotonic() + timeout_s
        while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
            time.sleep(0.1)
        if done[0] == 0:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        out.seek(0)
        text = out.read().decode(errors="replace")
    assert done[0] != 0, f"the fuzz child ran past {timeout_s} s (killed)"
    assert os.waitstatus_to_exitcode(done[1]) == 0, text[-3000:]
    return json.loads(text)


@pytest.mark.subprocess
def test_fuzzed_checkpoints_are_refused_or_loaded_never_anything_else(tmp_path):
    started = time.monotonic()
    counts = _in_a_fork(tmp_path, N_CASES)
    print(f"\nfuzz (seed {SEED}): {counts['cases']} cases, {counts['refused']} refused, {counts['loaded ok']} loaded "
          f"ok, {counts['hangs']} hangs, {counts['memory']} memory, {counts['tracebacks']} tracebacks, "
          f"{counts['code runs']} code runs, {counts['reads outside']} reads outside, {counts['gadgets inserted']} "
          f"inserts of {counts['gadgets']} gadgets; cases {counts['seconds']} s, "
          f"all {time.monotonic() - started:.1f} s")
    assert counts["cases"] == N_CASES
    # Every mutation kind of every file was drawn, and every gadget inserted at least once.
    assert counts["kinds tried"] == sorted([f"meta.json {k}" for k in range(META_KINDS)] + [
        f"{target} {k}" for target in (".metadata", "__0_0.distcp") for k in range(BYTE_KINDS)])
    assert counts["gadgets inserted"] >= counts["gadgets"] > 30
    assert (counts["hangs"], counts["memory"], counts["tracebacks"], counts["code runs"],
            counts["reads outside"]) == (0, 0, 0, 0, 0), counts["examples"]
    assert counts["refused"] > N_CASES // 4 and counts["loaded ok"] > 0  # the mutations reach both outcomes

