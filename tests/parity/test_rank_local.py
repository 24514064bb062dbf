"""Rank-local model: a pipeline rank materialises only its own chunks (everything else stays on the
meta device, with no storage), and what it holds equals the single-process model by name."""

from __future__ import annotations

import pytest
import torch

from attnres_pp.comm.partition import make_partition
from attnres_pp.model import Transformer
from attnres_pp.pipeline.chunk import build_rank_model, rank_module_names, rank_parameters
from tests.pipeline_helpers import model_config
from tests.reference_model import VARIANTS


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("P,V,placement", [(2, 2, "loop"), (3, 1, "loop"), (2, 2, "vshape")])
def test_a_rank_holds_only_its_chunks_with_the_whole_models_values(variant, P, V, placement):
    cfg = model_config(variant, 6 if P == 3 else 4)
    partition = make_partition(cfg.n_layers, P, V, placement=placement)
    whole = dict(Transformer(cfg, seed=3).named_parameters())
    held_by = {}
    for rank in range(P):
        model, chunks = build_rank_model(cfg, partition, rank, seed=3)
        params = rank_parameters(chunks, model)
        materialised = {name for name, p in model.named_parameters() if not p.is_meta}
        assert materialised == set(params), "a rank allocated parameters its chunks do not use"
        for name, p in params.items():
            assert torch.equal(p, whole[name]), name
            held_by.setdefault(name, []).append(rank)
        # The chunks of every other rank: none of their layers' parameters is allocated here.
        for other in range(P):
            if other == rank:
                continue
            theirs = {f"layers.{i}." for c in partition.chunks_of(other) for i in partition.layer_range(c)}
            assert not any(name.startswith(tuple(theirs)) for name in materialised)
    # Together the ranks hold the whole model; only MSAR's tied stream convs are on several ranks.
    assert set(held_by) == set(whole)
    shared = {name for name, ranks in held_by.items() if len(ranks) > 1}
    assert shared == {name for name in whole if name.startswith("stream_convs.")}


def test_rank_module_names_place_embedding_and_head_with_their_chunks():
    cfg = model_config("msar", 4)
    vshape = make_partition(4, 2, 2, placement="vshape")  # chunks 0 and 3 on rank 0
    assert rank_module_names(cfg, vshape, 0) == ["embed", "layers.0", "layers.3", "head", "stream_convs"]
    assert rank_module_names(cfg, vshape, 1) == ["layers.1", "layers.2", "stream_convs"]
    loop = make_partition(4, 2, 2)
    assert rank_module_names(model_config("block", 4), loop, 1) == ["layers.1", "layers.3", "head"]


def test_memory_benchmark_reports_every_rank():
    from attnres_pp.bench.memory import MODEL, to_markdown
    from attnres_pp.cli import build_parser

    assert build_parser().parse_args(["bench", "memory", "--quick"]).name == "memory"
    MiB = 2**20
    row = {"stages": 2, "params_per_rank": [50_500_000, 50_400_000], "state_bytes_per_rank": [771 * MiB, 770 * MiB],
           "rss_after_build_per_rank": [572 * MiB, 571 * MiB], "peak_rss_per_rank": [1303 * MiB, 1276 * MiB]}
    table = to_markdown({"model": MODEL, "import_rss": 267 * MiB, "whole_model_build_rss": 663 * MiB, "rows": [row]})
    assert "| 2 | 50.5 M, 50.4 M | 771, 770 | 572, 571 | 1,303, 1,276 | 1,303 | 1,036 |" in table
    assert "32 layers, d = 512" in table and "663 MiB" in table
