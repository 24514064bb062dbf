"""The slow-link emulation (`--link-gbps`, `comm.link`): the arrival a sender stamps on a message
(latency + bytes / bandwidth, messages to one peer one after the other), the stamp carried after
the payload, the receiver's wait, the config checks and the one-line CLI errors."""

from __future__ import annotations

import time

import pytest
import torch

from attnres_pp.cli import main
from attnres_pp.comm.link import LinkClock, LinkModel
from attnres_pp.comm.wire import stamp_numel, wait_for_arrival, with_arrival
from attnres_pp.pipeline.config import PipelineConfig
from tests.run_helpers import summary


def test_arrival_is_latency_plus_bytes_over_bandwidth():
    link = LinkModel(gbps=0.2, latency_s=20e-6)  # 25e6 bytes/s
    assert link.bytes_per_s == pytest.approx(25e6)
    clock = LinkClock(link)
    # An idle link: 1 MB leaves at once, occupies the link 40 ms, arrives 20 us after that.
    assert clock.arrival(1, 1_000_000, posted_s=10.0) == pytest.approx(10.0 + 0.04 + 20e-6)
    # Posted 10 ms later, the next message waits for the link (free at 10.04), then its own 4 ms.
    assert clock.arrival(1, 100_000, posted_s=10.01) == pytest.approx(10.04 + 0.004 + 20e-6)
    # Another peer has a link of its own.
    assert clock.arrival(0, 100_000, posted_s=10.01) == pytest.approx(10.01 + 0.004 + 20e-6)
    # Once the link has drained, a message leaves when posted.
    assert clock.arrival(1, 0, posted_s=11.0) == pytest.approx(11.0 + 20e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("numel", [5, 6])
def test_the_stamp_travels_after_the_payload(dtype, numel):
    payload = torch.arange(numel, dtype=dtype)
    stamped = with_arrival(payload, arrival_s=time.perf_counter() - 1.0)  # already due: no wait
    assert stamped.numel() == numel + stamp_numel(dtype)
    assert torch.equal(wait_for_arrival(stamped), payload)


def test_the_receiver_waits_until_the_emulated_arrival():
    due = time.perf_counter() + 0.05
    started = time.perf_counter()
    wait_for_arrival(with_arrival(torch.zeros(4), due))
    assert time.perf_counter() >= due
    assert time.perf_counter() - started < 5.0  # loose: the machine may be busy


@pytest.mark.parametrize(("values", "needle"), [
    ({"link_gbps": 0}, "link_gbps=0"),
    ({"link_gbps": -1.0}, "link_gbps=-1.0"),
    ({"link_gbps": float("nan")}, "link_gbps=nan"),
    ({"link_gbps": float("inf")}, "link_gbps=inf"),
    ({"link_gbps": True}, "link_gbps=True"),
    ({"link_gbps": 1.0, "link_latency_us": -5.0}, "link_latency_us=-5.0"),
    ({"link_latency_us": 20.0}, "give its bandwidth too"),
    ({"link_gbps": 1.0, "launcher": "inprocess"}, "use --launcher local or ray"),
])
def test_config_refuses_bad_links(values, needle):
    with pytest.raises(ValueError, match=None) as error:
        PipelineConfig(**values)
    assert needle in str(error.value)


def test_config_builds_the_link_and_reads_toml_keys():
    assert PipelineConfig().link is None
    cfg = PipelineConfig.from_dict({"stages": 2, "link_gbps": 0.2, "link_latency_us": 50})
    assert cfg.link.gbps == 0.2 and cfg.link.latency_s == pytest.approx(50e-6)
    assert cfg.to_dict()["link_gbps"] == 0.2


@pytest.mark.parametrize(("argv", "needle"), [
    (["--link-gbps", "0"], "PipelineConfig.link_gbps=0.0"),
    (["--link-gbps", "nan"], "PipelineConfig.link_gbps=nan"),
    (["--link-gbps", "fast"], "--link-gbps 'fast'"),
    (["--link-gbps", "1", "--link-latency-us", "-1"], "PipelineConfig.link_latency_us=-1.0"),
    (["--link-latency-us", "10"], "give its bandwidth too"),
])
def test_train_flags_exit_2_with_one_line(tmp_path, capsys, argv, needle):
    assert main(["train", "--launcher", "local", "--stages", "2", *argv, "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and needle in err and len(err.strip().splitlines()) == 1


@pytest.mark.distributed
def test_an_emulated_link_delays_steps_and_changes_neither_losses_nor_bytes(tmp_path):
    """Two gloo ranks, the same run with and without a 0.001 Gb/s link (125 kB/s): equal losses and
    counted bytes (the arrival stamp is not payload), and each step at least as long as the link needs
    for one direction's bytes (a lower bound only: the machine may be busy)."""

    tiny = ["--layers", "2", "--d-model", "32", "--heads", "2", "--seq-len", "16", "--batch-size", "4",
            "--microbatches", "2", "--steps", "2", "--eval-every", "0", "--quiet", "--launcher", "local",
            "--stages", "2", "--schedule", "1f1b", "--block-size", "2"]
    summaries = {}
    for name, extra in (("plain", []), ("slow", ["--link-gbps", "0.001", "--link-latency-us", "100"])):
        assert main(["train", *tiny, *extra, "--out", str(tmp_path / name)]) == 0
        summaries[name] = summary(tmp_path / name)
    plain, slow = summaries["plain"], summaries["slow"]
    assert slow["losses"] == plain["losses"]
    assert slow["bytes_sent_per_step"] == plain["bytes_sent_per_step"] > 0
    assert slow["config"]["pipeline"]["link_gbps"] == 0.001
    one_direction_s = slow["bytes_sent_per_step"] / 2 / LinkModel(gbps=0.001).bytes_per_s
    assert slow["step_time_s"] >= one_direction_s


@pytest.mark.distributed
def test_an_emulated_link_under_the_nccl_issue_order(tmp_path):
    """`--p2p-semantics nccl` over gloo (the batched transport, NCCL's issue order) stamps and delays
    its messages as the plain transport does: the losses and counted bytes of the plain run, each step
    at least as long as the link needs for one direction's bytes."""

    tiny = ["--layers", "2", "--d-model", "32", "--heads", "2", "--seq-len", "16", "--batch-size", "4",
            "--microbatches", "2", "--steps", "2", "--eval-every", "0", "--quiet", "--launcher", "local",
            "--stages", "2", "--schedule", "1f1b", "--block-size", "2"]
    summaries = {}
    for name, extra in (("plain", []), ("slow_nccl_order", ["--p2p-semantics", "nccl", "--link-gbps", "0.001"])):
        assert main(["train", *tiny, *extra, "--out", str(tmp_path / name)]) == 0
        summaries[name] = summary(tmp_path / name)
    plain, slow = summaries["plain"], summaries["slow_nccl_order"]
    assert slow["losses"] == pytest.approx(plain["losses"], rel=1e-6)
    assert slow["bytes_sent_per_step"] == plain["bytes_sent_per_step"] > 0
    assert slow["config"]["pipeline"]["p2p_semantics"] == "nccl"
    one_direction_s = slow["bytes_sent_per_step"] / 2 / LinkModel(gbps=0.001).bytes_per_s
    assert slow["step_time_s"] >= one_direction_s
