"""`--dp-shard fsdp` (FSDP2 over the replicas) over gloo in four processes, D = 2, P = 2, V = 2: the
losses equal the replicated in-process run's (Block AttnRes under a loop schedule, MSAR under ZB-V
with the I/W split, resharding after every forward and selective checkpointing), each rank holds
about half the parameter, gradient and AdamW bytes, and DCP checkpoints move between fsdp and
replicate at another P and another D. bf16 uses FSDP2's mixed-precision policy: fp32 shards, bf16
compute copies, losses within a bf16 tolerance of replicate's bf16."""

from __future__ import annotations

import pytest

from attnres_pp.cli import main
from tests.run_helpers import assert_same_losses, summary
from tests.spawn_helpers import spawn_ranks

pytestmark = pytest.mark.distributed

TINY = ["--layers", "4", "--d-model", "32", "--heads", "2", "--seq-len", "16", "--batch-size", "8", "--microbatches",
        "2", "--eval-every", "0", "--quiet", "--data-parallel", "2"]
D2P2V2 = [*TINY, "--stages", "2", "--virtual", "2"]


def _state_bytes(entry: dict) -> int:
    return entry["param_bytes"] + entry["grad_bytes"] + entry["optimizer_bytes"]


# The upper bound of a rank's sharded state over its whole state: MSAR's tied convolutions and gate
# scales stay whole, a larger share of this tiny model than of a real one.
def _assert_sharded(whole_run: dict, fsdp_run: dict, at_most: float) -> None:
    """Each fsdp rank holds half of every sharded tensor (FSDP2 pads dim 0 to a multiple of D) of
    what the replicated rank holds."""
    for whole, shard in zip(whole_run["memory_per_rank"], fsdp_run["memory_per_rank"], strict=True):
        assert 0.5 * _state_bytes(whole) <= _state_bytes(shard) <= at_most * _state_bytes(whole)


def test_fsdp_over_gloo_equals_the_replicated_run(tmp_path):
    """MSAR under ZB-V with the I/W split, resharding after every forward and selective
    checkpointing. Block AttnRes under a loop schedule is the first run of
    test_checkpoints_move_between_fsdp_and_replicate_at_another_split, checked the same way."""
    layout = [*D2P2V2, "--residual", "msar", "--block-size", "3", "--schedule", "zbv", "--steps", "3"]
    assert main(["train", *layout, "--launcher", "inprocess", "--out", str(tmp_path / "replicate")]) == 0
    assert main(["train", *layout, "--launcher", "local", "--dp-shard", "fsdp", "--fsdp-reshard-after-forward",
                 "always", "--activation-checkpoint", "selective", "--out", str(tmp_path / "fsdp")]) == 0
    want, got = summary(tmp_path / "replicate"), summary(tmp_path / "fsdp")
    assert_same_losses(got["losses"], want["losses"])
    _assert_sharded(want, got, 0.56)


def test_checkpoints_move_between_fsdp_and_replicate_at_another_split(tmp_path):
    """Block AttnRes under interleaved 1F1B at D = 2, P = 2, V = 2: the fsdp run equals the
    replicated one (losses, and half the state per rank) and resumes at P = 1 under replicate; the
    replicated run (on thread ranks: the reference, and a replicated checkpoint as any launcher
    writes it) resumes at P = 1 under fsdp; both to the uninterrupted losses."""
    layout = [*D2P2V2, "--residual", "attnres", "--block-size", "3", "--schedule", "interleaved_1f1b", "--steps", "3",
              "--checkpoint-every", "2", "--no-final-checkpoint"]  # the resumes continue from step_2
    replicated, sharded = tmp_path / "replicated", tmp_path / "sharded"
    assert main(["train", *layout, "--launcher", "inprocess", "--out", str(replicated)]) == 0
    whole = summary(replicated)
    want = whole["losses"]
    assert main(["train", *layout, "--launcher", "local", "--dp-shard", "fsdp", "--out", str(sharded)]) == 0
    first_run = summary(sharded)
    assert_same_losses(first_run["losses"], want)
    _assert_sharded(whole, first_run, 0.51)
    for run, then in ((sharded, "replicate"), (replicated, "fsdp")):
        (run / "summary.json").unlink()
        assert main(["train", "--resume", str(run), "--launcher", "local", "--stages", "1", "--virtual", "1",
                     "--schedule", "1f1b", "--dp-shard", then, "--quiet"]) == 0
        resumed = summary(run)["config"]["pipeline"]
        assert (resumed["stages"], resumed["dp_shard"]) == (1, then)
        assert_same_losses(summary(run)["losses"], want)


def test_checkpoints_move_between_fsdp_and_replicate_at_another_d(tmp_path):
    """fsdp at D = 2 resumes under replicate at D = 1, and replicate at D = 1 under fsdp at D = 2, to
    the uninterrupted run's losses (each first run goes on to step 3 uninterrupted: the reference);
    MSAR, so its 0-dim gate scales (kept whole by FSDP2) and tied convolutions round-trip too."""
    layout = [*TINY, "--residual", "msar", "--block-size", "3", "--schedule", "1f1b", "--steps", "3"]
    cases = (("fsdp_to_d1", ["--dp-shard", "fsdp"], ["--data-parallel", "1", "--dp-shard", "replicate"]),
             ("d1_to_fsdp", ["--data-parallel", "1"], ["--data-parallel", "2", "--dp-shard", "fsdp"]))
    uninterrupted = []
    for name, first, then in cases:
        run = tmp_path / name
        assert main(["train", *layout, "--launcher", "local", *first, "--checkpoint-every", "2",
                     "--no-final-checkpoint", "--out", str(run)]) == 0
        uninterrupted.append(summary(run)["losses"])
        (run / "summary.json").unlink()
        assert main(["train", "--resume", str(run), "--launcher", "local", *then, "--quiet"]) == 0
        resumed = summary(run)["config"]["pipeline"]
        assert (resumed["data_parallel"], resumed["dp_shard"]) == ((1, "replicate") if name == "fsdp_to_d1"
                                                                  else (2, "fsdp"))
        assert_same_losses(summary(run)["losses"], uninterrupted[-1])
    assert_same_losses(uninterrupted[1], uninterrupted[0])  # fsdp D = 2 and replicate D = 1 agree

# bf16 under fsdp (FSDP2's MixedPrecisionPolicy) against bf16 under replicate (autocast over fp32
# weights). The two differ by rounding only: under fsdp the ops autocast keeps in fp32 (norms, the
# depth-attention math, the loss) read bf16-rounded weights. One rounding to bf16 errs by at most
# 2^-9 relative; measured over these 3 steps the losses differ by <= 1.5e-4 relative (about as much
# as either bf16 run differs from fp32), so 1e-3 relative (a quarter of bf16's 2^-8 spacing) leaves
# 7x headroom while a wrong update (the loss falls by ~2e-2 relative per step here) cannot pass.
BF16_RTOL = 1e-3


def test_fsdp_bf16_tracks_the_replicated_bf16_run(tmp_path):
    layout = [*D2P2V2, "--residual", "msar", "--block-size", "3", "--schedule", "zbv", "--steps", "3",
              "--dtype", "bf16"]
    assert main(["train", *layout, "--launcher", "inprocess", "--out", str(tmp_path / "replicate")]) == 0
    assert main(["train", *layout, "--launcher", "local", "--dp-shard", "fsdp", "--out", str(tmp_path / "fsdp")]) == 0
    want, got = summary(tmp_path / "replicate")["losses"], summary(tmp_path / "fsdp")["losses"]
    assert len(got) == len(want) == 3
    assert_same_losses(got, want, rtol=BF16_RTOL)
    assert got[-1] < got[0] - 0.1  # it trains


def _bf16_rank(rank: int, init_method: str, run_cfg: dict, results) -> None:
    """One rank of a D = 2 bf16 fsdp run: the dtypes of shards, compute copies, gradients and moments."""
    import traceback

    import torch
    from torch.distributed.tensor import DTensor

    from attnres_pp.pipeline.stage_setup import init_process_group
    from attnres_pp.train.stage_worker import StageWorker

    try:
        torch.set_num_threads(1)
        _backend, device = init_process_group(init_method, rank, 2, 60.0)
        worker = StageWorker(run_cfg, rank)
        worker.connect(device)
        seen: dict[str, set] = {"sharded": set(), "compute": set(), "accumulated": set(), "grad": set(),
                                "moments": set()}
        units = list(worker.fsdp.units.values())
        seen["sharded"] |= {(type(p).__name__, p.dtype) for u in units for p in u.parameters() if p.dim()}
        worker.begin_step(0)
        runtime = worker.runtime
        while not runtime.finished:
            action = runtime.actions[runtime.cursor]
            if action.is_compute:  # what the chunk computes with: FSDP2's unsharded copies
                worker.fsdp.before(action)
                seen["compute"] |= {(type(p).__name__, p.dtype) for u in worker.fsdp.units_of[action.chunk_index]
                                    for p in u.parameters() if p.dim()}
            runtime.run_next()
        record = runtime.finish_step()
        # The microbatches' gradients add up in FSDP2's fp32 accumulator, not in the bf16 copies.
        seen["accumulated"] |= {fp.unsharded_accumulated_grad.dtype for u in units
                                for fp in u._get_fsdp_state()._fsdp_param_group.fsdp_params
                                if fp.unsharded_accumulated_grad is not None}
        worker.sync_gradients()
        seen["grad"] |= {(type(p.grad).__name__, p.grad.dtype) for u in units for p in u.parameters()
                         if p.dim() and p.grad is not None}
        worker.optimizer_step(1e-3)
        seen["moments"] |= {v.dtype for s in worker.optimizer.state.values() for k, v in s.items()
                            if k.startswith("exp_avg")}
        seen["sharded"] |= {(type(p).__name__, p.dtype) for u in units for p in u.parameters() if p.dim()}
        assert all(isinstance(p, DTensor) for u in units for p in u.parameters() if p.dim())
        results.put((rank, {k: sorted(map(str, v)) for k, v in seen.items()}, sum(record.losses.values())))
    except Exception:
        results.put((rank, traceback.format_exc()))


def test_fsdp_bf16_keeps_fp32_shards_and_computes_in_bf16(tmp_path):

    from attnres_pp.train.config import RunConfig

    run_cfg = RunConfig.from_dict({
        "model": {"n_layers": 2, "d_model": 16, "n_heads": 2, "seq_len": 8, "residual": "attnres",
                  "block_size": 2},
        "train": {"steps": 1, "batch_size": 8, "microbatches": 2, "seed": 0, "dtype": "bf16", "device": "cpu"},
        "pipeline": {"stages": 1, "virtual": 2, "schedule": "interleaved_zb", "launcher": "local", "timeout_s": 60.0,
                     "data_parallel": 2, "dp_shard": "fsdp"},
    }).to_dict()
    for _rank_id, seen, _loss in spawn_ranks(_bf16_rank, 2, tmp_path, run_cfg):
        assert seen == {"sharded": ["('DTensor', torch.float32)"], "compute": ["('Parameter', torch.bfloat16)"],
                        "accumulated": ["torch.float32"], "grad": ["('DTensor', torch.float32)"],
                        "moments": ["torch.float32"]}, seen
