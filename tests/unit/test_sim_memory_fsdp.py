"""`simulator.memory.state_bytes` under `fsdp` against real FSDP2 shards: two gloo processes (forked
from the fork server, as the local launcher's ranks are) shard a rank's modules with `fully_shard`
and take one AdamW step; each counts the storages it holds."""

from __future__ import annotations

import traceback

import pytest
import torch

from attnres_pp.comm.partition import make_partition
from attnres_pp.model.config import ModelConfig
from attnres_pp.simulator.memory import rank_parameter_shapes, state_bytes
from tests.spawn_helpers import spawn_ranks

WORLD = 2
CFG = dict(vocab_size=37, n_layers=3, d_model=12, n_heads=2, seq_len=8, residual="attnres", block_size=3)


def _worker(rank: int, init_method: str, results) -> None:
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from attnres_pp.pipeline.chunk import build_rank_model, rank_parameters

    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=WORLD)
        cfg = ModelConfig(**CFG)
        partition = make_partition(cfg.n_layers, 1, 1)
        model, chunks = build_rank_model(cfg, partition, 0, seed=0)
        # One group: a layer's phase-1 read batches the pseudo-queries of the next layers of its block,
        # which a per-layer group would not have gathered yet. Shard sizes do not depend on grouping.
        fully_shard(model)
        params = list(rank_parameters(chunks, model).values())
        optimizer = torch.optim.AdamW(params, foreach=False)
        idx = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len))
        model(idx, idx).backward()
        optimizer.step()

        def storages(tensors) -> int:
            unique = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
            return sum(unique.values())

        local = [p.to_local() for p in params]
        state = [v.to_local() if hasattr(v, "to_local") else v for s in optimizer.state.values()
                 for key, v in s.items() if key in ("exp_avg", "exp_avg_sq")]  # docs/spec.md section 8: the two moments
        counted = {"param_bytes": storages(local), "grad_bytes": storages(p.grad.to_local() for p in params),
                   "optimizer_bytes": sum(t.untyped_storage().nbytes() for t in state)}
        dist.destroy_process_group()
        results.put((rank, counted))
    except Exception:
        results.put((rank, traceback.format_exc()))


@pytest.mark.distributed
def test_fsdp_state_bytes_equal_real_shards(tmp_path):
    counted_by_rank = dict(spawn_ranks(_worker, WORLD, tmp_path, timeout_s=120.0))
    cfg = ModelConfig(**CFG)
    shapes = rank_parameter_shapes(cfg, make_partition(cfg.n_layers, 1, 1), 0)
    assert any(s and s[0] % WORLD for s in shapes)  # some shards are padded
    assert sorted(counted_by_rank) == list(range(WORLD))
    for rank, counted in counted_by_rank.items():
        assert counted == state_bytes(shapes, data_parallel=WORLD, dp_shard="fsdp", dp_rank=rank)
