"""The link probe's fit (`attnres_lab.link_probe`) and how the simulator prices measured links
(`RunShape.rank_links`): each direction its own link, messages queue on the real link, an emulated
link on top delivers no sooner than either. Synthetic numbers, no process: the probe ranks themselves
run over real links in tests/multihost/test_multihost.py."""

from __future__ import annotations

import dataclasses
import gzip

import pytest

from attnres_lab.fidelity_hosts import CALIBRATION, EMULATED_LATENCY_US, HostCase, held_out_cases, probed_shape
from attnres_lab.link_probe import ACK_BYTES, LinkFit, fit_direction, fit_from_dict, fit_line, summarize
from attnres_lab.transfer_fit import unit_times_from_probe
from attnres_pp.comm.link import LinkModel
from attnres_pp.schedule.schedules import build_schedule
from attnres_pp.simulator.engine import simulate
from attnres_pp.simulator.transfer import RunShape, TransferCalibration

from .test_sim_fidelity import _FREE, _probe, _shape, _truth_costs

SIZES = (16 * 1024, 256 * 1024, 2048 * 1024)


def _round_trips(fixed_s: float, s_per_byte: float, reply_s: float) -> dict[int, float]:
    """Round trips of a link whose one-way time is fixed + bytes x s_per_byte, the reply taking
    reply_s: as rank 0 times them."""
    trips = {n: fixed_s + n * s_per_byte + reply_s for n in SIZES}
    trips[ACK_BYTES] = 2 * reply_s
    return trips


def test_a_direction_fit_recovers_the_fixed_cost_and_rate():
    # 150 us per message and 0.5 Gb/s of payload; the 4-byte reply costs about the fixed cost.
    fit = fit_direction(_round_trips(150e-6, 8 / 0.5e9, 150e-6 + ACK_BYTES * 8 / 0.5e9))
    assert fit.fixed_s == pytest.approx(150e-6, rel=1e-3)
    assert fit.gbps == pytest.approx(0.5, rel=1e-6) and fit.residual_s < 1e-9
    # The simulator's link leaves out the sender's and the receiver's own work, priced apart.
    assert fit.link(busy_s=100e-6).latency_s == pytest.approx(50e-6, rel=1e-2)
    assert fit.link(busy_s=1.0).latency_s == 0.0


def test_times_that_do_not_grow_with_the_size_bound_the_rate_instead_of_failing():
    """A link faster than the machine's noise (the unshaped veth under a loaded suite): the probe's
    times do not grow with the size, so the rate is bounded by the largest message's time over its
    bytes (never faster than the data allow) and the fit says it is unresolved."""
    # One-way times a loaded suite measured on the unshaped link (seconds), as round trips.
    one_way = {16384: 7.28e-4, 65536: 7.32e-4, 262144: 1.29e-4, 1048576: 4.1e-5, 2097152: 6.86e-4}
    reply = 4.31e-4
    noisy = {ACK_BYTES: 2 * reply, **{n: t + reply for n, t in one_way.items()}}
    fit = fit_direction(noisy)
    assert not fit.resolved and fit.s_per_byte == pytest.approx(6.86e-4 / 2097152)
    assert fit.fixed_s == pytest.approx(4.1e-5) and fit.message_s(2097152) >= 6.86e-4
    assert not fit_from_dict(fit.to_dict()).resolved
    assert fit_direction(_round_trips(1e-4, 8 / 1e9, 1e-4)).resolved
    with pytest.raises(ValueError, match="at least two sizes"):
        fit_line({1000: 2e-3})


def test_the_flow_checks_are_one_where_the_model_holds():
    """Two messages back to back: the second one wire time after the first; both directions at once:
    as long as the slower direction alone (full duplex). Rank files as `_round` writes them."""
    fixed, per_byte = 100e-6, 8 / 2e9
    trips = {str(n): [t, t * 1.3] for n, t in _round_trips(fixed, per_byte, fixed).items()}
    size = SIZES[-1]
    one_way = fixed + size * per_byte
    rank0 = {"round_trips": trips, "back_to_back": {str(size): [one_way + size * per_byte]},
             "both_ways": {str(size): [one_way * 1.5, one_way]}}
    rank1 = {"round_trips": trips, "back_to_back": {str(size): []}, "both_ways": {str(size): [one_way * 1.5, one_way]}}
    summary = summarize(rank0, rank1)
    assert summary["back_to_back_over_model"] == pytest.approx(1.0, rel=1e-6)
    assert summary["both_ways_over_one_way"] == pytest.approx(1.0, rel=1e-6)  # the faster of the repeats
    assert summary["forward"]["gbps"] == pytest.approx(2.0, rel=1e-6)
    assert summary["sizes_bytes"] == sorted([ACK_BYTES, *SIZES])


def _calibration(shape: RunShape | None = None) -> tuple[TransferCalibration, dict]:
    probe = _probe(layer=(0.001, 0.002))
    shape = shape or _shape("1f1b", 1, 4, "cached", 8)
    return TransferCalibration(forward=unit_times_from_probe(probe, "fwd"),
                               backward=unit_times_from_probe(probe, "bwd"), messages=_FREE, forward_scale=1.0,
                               backward_scale=1.0, calibrated_on=shape), probe


def test_each_direction_is_priced_on_its_own_link():
    """V = 2 over two ranks: forward hops 0 and 2 run rank 0 -> 1 and hop 1 rank 1 -> 0; backward the
    other way. A slow 1 -> 0 direction slows exactly the hops that cross it, and the step."""
    calibration, _ = _calibration()
    fast, slow = LinkModel(gbps=1.0, latency_s=1e-4), LinkModel(gbps=0.01, latency_s=1e-3)
    base = _shape("interleaved_1f1b", 2, 4, "cached", 8)
    shape = base.__class__(**{**base.__dict__, "rank_links": ((0, 1, fast), (1, 0, slow))})
    costs = calibration.costs(shape)
    n_bytes = shape.hop_bytes()
    assert costs.hop_fwd_s == pytest.approx((fast.message_s(n_bytes[0]), slow.message_s(n_bytes[1]),
                                             fast.message_s(n_bytes[2])))
    assert costs.hop_bwd_s == pytest.approx((slow.message_s(n_bytes[0]), fast.message_s(n_bytes[1]),
                                             slow.message_s(n_bytes[2])))
    assert costs.wire_bwd_s == pytest.approx((slow.wire_s(n_bytes[0]), fast.wire_s(n_bytes[1]),
                                              slow.wire_s(n_bytes[2]))) and costs.shared_links
    both_fast = base.__class__(**{**base.__dict__, "rank_links": ((0, 1, fast), (1, 0, fast))})
    assert calibration.predict_step_s(shape) > calibration.predict_step_s(both_fast)
    one_way = base.__class__(**{**base.__dict__, "rank_links": ((0, 1, fast),)})
    with pytest.raises(ValueError, match="no link from rank 1 to rank 0"):
        calibration.costs(one_way)


def test_an_emulated_latency_holds_a_message_the_real_link_brought_sooner():
    calibration, _ = _calibration()
    real = LinkModel(gbps=0.5, latency_s=1e-4)
    emulated = LinkModel(gbps=100.0, latency_s=1e-3)
    base = _shape("interleaved_1f1b", 2, 4, "naive", 8)
    shape = base.__class__(**{**base.__dict__, "link": emulated, "rank_links": ((0, 1, real), (1, 0, real))})
    costs = calibration.costs(shape)
    for n_bytes, hop, wire in zip(shape.hop_bytes(), costs.hop_fwd_s, costs.wire_fwd_s, strict=True):
        assert hop == pytest.approx(max(real.message_s(n_bytes), emulated.message_s(n_bytes)))
        assert wire == pytest.approx(real.wire_s(n_bytes))  # the queue is the real link's


def test_probed_links_price_a_run_as_hand_built_costs_do():
    """probed_shape turns a probe summary into per-direction links (fixed cost less the busy work as
    latency, the fitted rate) and the prediction equals a simulation of costs built by hand."""
    calibration, probe = _calibration(CALIBRATION.fidelity_case().shape())  # the benchmark's model
    forward = LinkFit(fixed_s=3e-4, s_per_byte=8 / 0.5e9, residual_s=0.0)
    backward = LinkFit(fixed_s=2e-4, s_per_byte=8 / 0.1e9, residual_s=0.0)
    case = HostCase("interleaved_1f1b", 2, "naive", 0.5)
    links = {case.link_state: {"busy": {"forward": forward.to_dict(), "backward": backward.to_dict()}}}
    shape = probed_shape(case, links, busy_s=5e-5)
    n_bytes = shape.hop_bytes()

    def one_way(fit: LinkFit, size: int) -> tuple[float, float]:
        return fit.fixed_s - 5e-5 + size * fit.s_per_byte, size * fit.s_per_byte

    by_hop = {True: [forward, backward, forward], False: [backward, forward, backward]}  # hop c: rank c % 2 -> other
    hop_fwd, wire_fwd = zip(*(one_way(f, b) for f, b in zip(by_hop[True], n_bytes, strict=True)), strict=True)
    hop_bwd, wire_bwd = zip(*(one_way(f, b) for f, b in zip(by_hop[False], n_bytes, strict=True)), strict=True)
    plain = _truth_costs(probe, _FREE, case.fidelity_case().shape())
    truth = dataclasses.replace(plain, hop_fwd_s=hop_fwd, hop_bwd_s=hop_bwd, wire_fwd_s=wire_fwd, wire_bwd_s=wire_bwd)
    expected = simulate(build_schedule("interleaved_1f1b", 2, 2, 4), truth).makespan
    assert calibration.predict_step_s(shape) == pytest.approx(expected, rel=1e-9)
    assert expected > simulate(build_schedule("interleaved_1f1b", 2, 2, 4), plain).makespan


def test_the_host_cases_cover_the_issue():
    """Unshaped V = 2 runs (the schedule transfer alone), every tc rate in cached and naive, and
    emulated latency (which this kernel's tc cannot add) on the unshaped and a shaped link."""
    cases = held_out_cases((0.0,), quick=False)
    assert CALIBRATION not in cases and len(set(cases)) == len(cases)
    assert {(c.gbps, c.mode) for c in cases if not c.emulated_latency_us} >= {
        (g, m) for g in (None, 0.1, 0.5, 2.0) for m in ("cached", "naive")}
    emulated = [c for c in cases if c.emulated_latency_us]
    assert {c.gbps for c in emulated} == {None, 0.5} and {c.mode for c in emulated} == {"cached", "naive"}
    pipeline = emulated[0].run_config().pipeline
    assert pipeline.link_latency_us == EMULATED_LATENCY_US and pipeline.launcher == "ray"
    assert pipeline.placement == "SPREAD"
    quick = held_out_cases((0.0,), quick=True)
    assert len(quick) < len(cases) and any(c.emulated_latency_us for c in quick)


def test_a_run_shorter_than_its_priced_messages_is_refused_not_fitted_below_zero():
    """Calibrating on a run whose link, as priced, outlasts its measured step: no compute level fits
    (a negative one would price every action below zero), so the fit says so."""
    from attnres_lab.transfer_fit import fit_transfer

    probe = _probe(layer=(0.001, 0.002))
    crawl = LinkModel(gbps=1e-6, latency_s=1.0)  # seconds per message: far longer than the step below
    base = _shape("1f1b", 1, 4, "cached", 8)
    shape = base.__class__(**{**base.__dict__, "rank_links": ((0, 1, crawl), (1, 0, crawl))})
    measured = [[(0, "F0.0", 0.0, 0.004, "compute"), (0, "B0.0", 0.004, 0.012, "compute"),
                 (1, "F1.0", 0.0, 0.004, "compute"), (1, "B1.0", 0.004, 0.012, "compute")]]
    with pytest.raises(ValueError, match="no compute level fits it"):
        fit_transfer(probe, shape, measured)


def test_the_analysis_recovers_runs_simulated_from_known_costs_and_reads_its_kept_file(tmp_path):
    """`analyse` on runs simulated from a known truth (probe units, per-direction probed links, two
    rounds): every held-out prediction, and every rotation's, equals the measurement; `reanalyse`
    of the kept file gives the same rows."""
    import json

    from attnres_lab.fidelity_hosts import analyse, reanalyse

    from .test_sim_fidelity import _measured_steps

    probe = _probe(layer=(0.001, 0.002), embed=(0.0005, 0.0004), head=(0.0008, 0.001))
    fit = {"fixed_s": 2e-4, "s_per_byte": 8 / 0.5e9, "gbps": 0.5, "residual_s": 0.0}
    fast = {"fixed_s": 5e-5, "s_per_byte": 8 / 20e9, "gbps": 20.0, "residual_s": 0.0}
    links = {(None, 0.0): {load: {"forward": fast, "backward": fast} for load in ("idle", "busy")},
             (0.5, 0.0): {load: {"forward": fit, "backward": fit} for load in ("idle", "busy")}}
    cases = [HostCase("interleaved_1f1b", 2, "cached"), HostCase("gpipe", 2, "naive", 0.5),
             HostCase("interleaved_1f1b", 2, "naive", 0.5, emulated_latency_us=EMULATED_LATENCY_US)]
    truth_units = TransferCalibration(forward=unit_times_from_probe(probe, "fwd"),
                                      backward=unit_times_from_probe(probe, "bwd"), messages=_FREE,
                                      forward_scale=1.0, backward_scale=1.0,
                                      calibrated_on=CALIBRATION.fidelity_case().shape())
    measured = {}
    for case in [CALIBRATION, *cases]:
        shape = probed_shape(case, links, busy_s=0.0)
        measured[case] = [_measured_steps(shape, truth_units.costs(shape))] * 2
    result = analyse(probe, links, measured, cases, True, lambda line: None)
    assert result["rounds"] == 2 and len(result["rows"]) == 3
    for row in result["rows"]:
        assert abs(row["error"]) < 1e-6, row
    assert len(result["rotation"]) == 4 and all(entry["max_abs_error"] < 1e-6 for entry in result["rotation"])
    kept = tmp_path / "runs.json"
    kept.write_text(json.dumps({"probe": probe, "links": [[list(state), v] for state, v in links.items()],
                                "runs": [[dataclasses.asdict(c), measured[c]] for c in measured]}))
    predicted = [r["predicted_step_s"] for r in result["rows"]]
    zipped = tmp_path / "runs.json.gz"  # as committed beside a table
    zipped.write_bytes(gzip.compress(kept.read_bytes()))
    for path in (kept, zipped):
        assert [r["predicted_step_s"] for r in reanalyse(path, lambda line: None)["rows"]] == pytest.approx(predicted)


def test_the_stacks_cpu_share_is_charged_to_each_end_for_the_wire_time():
    """A link whose sender's stack takes 30% of a core and receiver's 10% while a message is on the
    wire: each end's busy time per message grows by that share of the message's wire time, in the
    direction it crosses (the step grows with it); a share outside 0-1 is refused."""
    calibration, _ = _calibration()
    base = _shape("interleaved_1f1b", 2, 4, "naive", 8)
    plain = LinkModel(gbps=0.01, latency_s=1e-4)
    shared = LinkModel(gbps=0.01, latency_s=1e-4, sender_cpu_share=0.3, receiver_cpu_share=0.1)
    one = base.__class__(**{**base.__dict__, "rank_links": ((0, 1, shared), (1, 0, plain))})
    none = base.__class__(**{**base.__dict__, "rank_links": ((0, 1, plain), (1, 0, plain))})
    costs, bare = calibration.costs(one), calibration.costs(none)
    n_bytes = one.hop_bytes()
    crosses_0_to_1 = {True: (True, False, True), False: (False, True, False)}  # hop c forward: rank c % 2 -> other
    for forward, send, recv, send_bare, recv_bare in ((True, costs.send_fwd_s, costs.recv_fwd_s, bare.send_fwd_s,
                                                        bare.recv_fwd_s),
                                                       (False, costs.send_bwd_s, costs.recv_bwd_s, bare.send_bwd_s,
                                                        bare.recv_bwd_s)):
        for hop, on in enumerate(crosses_0_to_1[forward]):
            wire = shared.wire_s(n_bytes[hop])
            assert send[hop] == pytest.approx(send_bare[hop] + (0.3 * wire if on else 0.0))
            assert recv[hop] == pytest.approx(recv_bare[hop] + (0.1 * wire if on else 0.0))
    assert calibration.predict_step_s(one) > calibration.predict_step_s(none)
    with pytest.raises(ValueError, match="share of a core between 0 and 1"):
        LinkModel(gbps=1.0, receiver_cpu_share=1.5)


def test_a_busy_round_reports_each_roles_cpu_share_and_prices_both_directions_with_it():
    fixed, per_byte = 100e-6, 8 / 0.5e9
    trips = {str(n): [t] for n, t in _round_trips(fixed, per_byte, fixed).items()}
    size = SIZES[-1]
    flows = {"back_to_back": {str(size): [1.0]}, "both_ways": {str(size): [1.0]}}
    rank0 = {"round_trips": trips, **flows, "cpu_share": {"share": 0.25, "messages": 10, "bytes": size,
                                                          "stream_s": 10 * size * per_byte}}
    rank1 = {"round_trips": trips, **flows, "cpu_share": {"share": 0.05, "messages": 10, "bytes": size,
                                                          "stream_s": 10 * size * per_byte}}
    summary = summarize(rank0, rank1)
    assert summary["cpu_share"]["send"] == 0.25 and summary["cpu_share"]["recv"] == 0.05
    assert summary["cpu_share"]["stream_gbps"] == pytest.approx(0.5)
    case = HostCase("interleaved_1f1b", 2, "naive", 0.5)
    shape = probed_shape(case, {case.link_state: {"busy": summary}}, busy_s=0.0)
    links = {(s, d): link for s, d, link in shape.rank_links}
    assert (links[(0, 1)].sender_cpu_share, links[(0, 1)].receiver_cpu_share) == (0.25, 0.05)
    assert (links[(1, 0)].sender_cpu_share, links[(1, 0)].receiver_cpu_share) == (0.25, 0.05)  # per role
