"""Memory counted per rank (docs/spec.md section 8): the saved-tensor meter's rules (each storage once,
parameters never, released when autograd drops it), and `memory_per_rank` in summary.json from every
launcher: one process, in-process and local processes, with equal counts where they must agree (Ray's
actors: tests/distributed/test_ray.py, on its shared instance)."""

from __future__ import annotations

import gc

import pytest
import torch

from attnres_pp.cli import main
from attnres_pp.comm.partition import make_partition
from attnres_pp.comm.plan import plan_for_model
from attnres_pp.comm.shm_files import slot_layout
from attnres_pp.model.config import ModelConfig
from attnres_pp.pipeline.memory_meter import ActivationMeter
from attnres_pp.pipeline.routes import hop_shapes, wire_messages
from attnres_pp.schedule.passes import insert_comm
from attnres_pp.schedule.schedules import build_schedule, schedule_placement
from attnres_pp.simulator.memory import MemorySetup, predict_memory, transport_slot_bytes
from attnres_pp.train.memory_report import MEMORY_KEYS
from tests.run_helpers import summary

TINY = ["--layers", "2", "--d-model", "32", "--heads", "2", "--seq-len", "16", "--steps", "2", "--eval-every", "0",
        "--quiet"]


def test_a_storage_saved_twice_or_through_views_counts_once_and_parameters_never():
    weight = torch.nn.Parameter(torch.randn(8, 8))
    meter = ActivationMeter()
    meter.set_excluded([weight])
    x = torch.randn(4, 8, requires_grad=True)
    with meter.saving():
        y = x * x  # saves x twice: one storage
        first, second = y.view(2, 16).unbind(0)  # views of y
        z = (first * second).sum() + (y @ weight).sum()  # saves the views (one storage) and the weight (never)
    assert meter.live_bytes == x.numel() * 4 + y.numel() * 4
    assert meter.peak_bytes == meter.live_bytes
    z.backward()
    assert meter.live_bytes == 0  # the backward dropped every saved tensor
    assert meter.peak_bytes == x.numel() * 4 + y.numel() * 4
    meter.reset_peak()
    assert meter.peak_bytes == 0


def test_a_retained_graph_keeps_its_storages_until_it_is_dropped():
    meter = ActivationMeter()
    x = torch.randn(16, requires_grad=True)
    with meter.saving():
        loss = (x.exp() * x).sum()
    torch.autograd.grad(loss, x, retain_graph=True)
    assert meter.live_bytes == 2 * 16 * 4  # x and exp(x): I keeps the graph for W
    del loss
    assert meter.live_bytes == 0


def test_a_graph_dropped_unrun_releases_its_storages_without_the_garbage_collector():
    """A node that saves its own output (exp) must not hold itself through the kept tensor's grad_fn:
    dropping the graph unrun (an aborted step) releases every storage at once, gc off."""
    meter = ActivationMeter()
    x = torch.randn(16, requires_grad=True)
    gc.disable()
    try:
        with meter.saving():
            y = x.exp()  # saves its output y
            loss = (y * x).sum()  # saves y (again: one storage) and x
        assert meter.live_bytes == 2 * 16 * 4
        del y, loss
        assert meter.live_bytes == 0
        with meter.saving():  # a storage counted again after its release, at the same address or not
            z = x.exp()
        assert meter.live_bytes == 16 * 4 and meter.peak_bytes == 2 * 16 * 4
        del z
        assert meter.live_bytes == 0
    finally:
        gc.enable()


def test_a_handle_reports_what_it_is_counted_as_while_its_storage_is_alive():
    meter = ActivationMeter()
    weight = torch.nn.Parameter(torch.randn(4))
    meter.set_excluded([weight])
    x = torch.randn(4, 4)
    first, second, excluded = meter.pack(x[0]), meter.pack(x[1]), meter.pack(weight)
    assert meter.counted(first) == meter.counted(second) == (("cpu", x.untyped_storage().data_ptr()), 64)
    assert meter.counted(excluded) is None and meter.unpack(excluded) is weight
    assert meter.unpack(second).data_ptr() == x[1].data_ptr() and meter.live_bytes == 64
    del first
    assert meter.live_bytes == 64  # the second handle still holds the storage
    del second
    assert meter.live_bytes == 0


def check_memory_entries(entries: list, n_ranks: int) -> None:
    assert len(entries) == n_ranks
    for entry in entries:
        assert set(MEMORY_KEYS) <= set(entry)
        assert entry["param_bytes"] > 0 and entry["grad_bytes"] == entry["param_bytes"]
        assert entry["optimizer_bytes"] == 2 * entry["param_bytes"]  # AdamW's two fp32 moments
        assert entry["activation_peak_bytes"] > 0 and entry["peak_rss_bytes"] > 0


def test_every_in_this_process_launcher_writes_memory_per_rank(tmp_path):
    assert main(["train", *TINY, "--batch-size", "4", "--launcher", "local", "--out", str(tmp_path / "one")]) == 0
    whole = summary(tmp_path / "one")["memory_per_rank"]
    check_memory_entries(whole, 1)
    assert main(["train", *TINY, "--batch-size", "8", "--launcher", "inprocess", "--stages", "2",
                 "--data-parallel", "2", "--out", str(tmp_path / "inproc")]) == 0
    entries = summary(tmp_path / "inproc")["memory_per_rank"]
    check_memory_entries(entries, 4)
    # The ranks' parameters are the whole model's (MSAR's tied convs aside: none here), per replica.
    assert entries[0]["param_bytes"] + entries[1]["param_bytes"] == whole[0]["param_bytes"]
    assert entries[0] == {**entries[2], "peak_rss_bytes": entries[0]["peak_rss_bytes"]}  # replicas hold the same


@pytest.mark.distributed
def test_local_processes_count_what_the_in_process_ranks_count(tmp_path):
    layout = [*TINY, "--batch-size", "4", "--stages", "2", "--schedule", "zb_h1", "--activation-checkpoint", "full"]
    assert main(["train", *layout, "--launcher", "inprocess", "--out", str(tmp_path / "inproc")]) == 0
    assert main(["train", *layout, "--launcher", "local", "--out", str(tmp_path / "procs")]) == 0
    want, got = (summary(tmp_path / d)["memory_per_rank"] for d in ("inproc", "procs"))
    check_memory_entries(got, 2)
    for w, g in zip(want, got, strict=True):
        for key in ("param_bytes", "grad_bytes", "optimizer_bytes", "cache_peak_bytes"):
            assert g[key] == w[key], key
        # Received hops are views of one message buffer over the wire, separate tensors in memory.
        assert 0.5 * w["activation_peak_bytes"] <= g["activation_peak_bytes"] <= 2 * w["activation_peak_bytes"]

        # The shared-memory receive slots, mapped for the whole step: the local ranks hold them,
        # in-process ranks none, and the simulator predicts them to the byte.
        assert w["transport_buffer_bytes"] == 0
    cfg = ModelConfig(n_layers=2, d_model=32, n_heads=2, seq_len=16)
    predicted = predict_memory(cfg, MemorySetup(schedule="zb_h1", n_stages=2, n_microbatches=2, tokens=2 * 16,
                                                dtype="fp32", activation_checkpoint="full", launcher="local"))
    for p, g in zip(predicted, got, strict=True):
        assert g["transport_buffer_bytes"] == p.terms["transport_buffer_bytes"] > 0


@pytest.mark.parametrize(("schedule", "n_virtual", "residual", "dtype"), [
    ("1f1b", 1, "attnres", "fp32"), ("interleaved_1f1b", 2, "lr_attnres", "bf16"), ("zbv", 2, "attnres", "fp32"),
    ("dualpipev", 2, "msar", "fp32"), ("interleaved_zb", 4, "standard", "bf16")])
def test_the_slots_the_simulator_prices_are_the_shared_memory_transports_layout(schedule, n_virtual, residual, dtype):
    """`transport_slot_bytes` (from the compute order alone) against the layout the transport
    allocates from the lowered schedule's messages (`comm.shm_transport._layout`), every rank."""
    cfg = ModelConfig(n_layers=8, d_model=24, n_heads=2, seq_len=8, residual=residual,
                      block_size=2)
    n_stages, n_microbatches, n_sequences = 2, 4, 3
    schedule_ = build_schedule(schedule, n_stages, n_virtual, n_microbatches)
    partition = make_partition(cfg.n_layers, n_stages, n_virtual, placement=schedule_placement(schedule))
    plan = plan_for_model(cfg, partition, True)
    lowered = insert_comm(schedule_)
    element = {"fp32": 4, "bf16": 2}[dtype]
    layout = slot_layout(wire_messages(lowered, plan, hop_shapes((n_sequences, cfg.seq_len), cfg.source_width,
                                                             cfg.d_model)))
    for pp_rank in range(n_stages):
        allocated = sum(n for (_src, dst), (n, _offsets) in layout.items() if dst == pp_rank) * element
        assert transport_slot_bytes(schedule_, plan, pp_rank, tokens=n_sequences * cfg.seq_len, cfg=cfg,
                                    dtype=dtype) == allocated > 0
