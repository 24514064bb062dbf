"""`simulate memory`'s all-gathered copy under FSDP2 without resharding (`predict_ranks`' gathered
bytes, `chunk_gathered_bytes` summed over a rank's chunks) against what `train.fsdp` really holds:
the rank's FSDP2 units are built over a fake process group of D ranks (torch's "fake" backend: the
meshes and the shards are real, the collectives move nothing), every unit is unsharded, and the
storages behind the unsharded parameters are counted, each once.

Mixtures of experts under expert parallelism (docs/spec.md section 12): at D > EP each expert slice
is a unit over the D / EP "edp" holders (its buffer padded over them: E = 6, EP = 2 gives 3 experts
over 2 holders, 4 rows); at D = EP it stays whole (the parameter itself, not a copy); the selection
bias stays whole; MSAR's gate scalars and tied convolutions are not in units."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from attnres_pp.comm.partition import make_partition
from attnres_pp.model.config import ModelConfig
from attnres_pp.simulator.memory import MemorySetup, predict_memory

MODEL = dict(vocab_size=256, n_layers=2, d_model=32, n_heads=2, seq_len=16, residual="attnres", block_size=1,
             moe_top_k=2, moe_shared_experts=1, moe_d_ff=16, moe_dense_layers=1)
CASES = (  # (D, EP, E, dtype, residual)
    (4, 2, 4, "fp32", "attnres"),
    (2, 2, 4, "fp32", "attnres"),  # one holder per slice: whole
    (4, 2, 6, "bf16", "attnres"),  # 3 experts over 2 holders: padded to 4 rows; the router's 6 rows to 8
    (4, 1, 6, "fp32", "msar"),  # no EP: experts sharded over D like any parameter; MSAR's scalars whole
)


def counted_gathered_bytes(cfg: ModelConfig, data_parallel: int, expert_parallel: int, dtype: str) -> int:
    """Bytes of the storages behind rank 0's unsharded FSDP2 parameters, every unit unsharded."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from attnres_pp.pipeline.chunk import build_rank_model, rank_module_names
    from attnres_pp.train.fsdp import FsdpShards

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=data_parallel)
    try:
        partition = make_partition(cfg.n_layers, 1, 1)
        model, chunks = build_rank_model(cfg, partition, 0, seed=0, expert_parallel=(0, expert_parallel))
        dp_mesh = init_device_mesh("cpu", (data_parallel,), mesh_dim_names=("dp",))
        expert_mesh = init_device_mesh("cpu", (data_parallel // expert_parallel, expert_parallel),
                                       mesh_dim_names=("edp", "ep")) if expert_parallel > 1 else None
        shards = FsdpShards(model, chunks, rank_module_names(cfg, partition, 0), dp_mesh, "never", dtype,
                            edp_mesh=None if expert_mesh is None else expert_mesh["edp"],
                            data_parallel=data_parallel)
        units = [*shards.units.values(), *shards.expert_units.values()]
        storages = {}
        for unit in units:
            unit.unshard()
            for fsdp_param in unit._get_fsdp_state()._fsdp_param_group.fsdp_params:
                storage = fsdp_param.unsharded_param.untyped_storage()
                storages[storage.data_ptr()] = storage.nbytes()
        return sum(storages.values())
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("data_parallel,expert_parallel,experts,dtype,residual", CASES)
def test_predicted_gathered_copy_equals_what_fsdp_holds(data_parallel, expert_parallel, experts, dtype, residual):
    extra = {"block_size": 2} if residual == "msar" else {}
    cfg = ModelConfig(**{**MODEL, "moe_experts": experts, "residual": residual, **extra})
    setup = MemorySetup(schedule="1f1b", n_stages=1, n_microbatches=2, tokens=32, dtype=dtype,
                        data_parallel=data_parallel, dp_shard="fsdp", expert_parallel=expert_parallel)
    predicted = predict_memory(cfg, setup)[0].gathered_bytes
    assert predicted == counted_gathered_bytes(cfg, data_parallel, expert_parallel, dtype)
