"""Calibration from a measured trace charges the runtime's own per-action work to F and B."""

from __future__ import annotations

import json

import pytest

from attnres_pp.schedule.timeline import account
from attnres_pp.schedule.trace import write_chrome_trace
from attnres_pp.simulator.calibrate import calibrate_from

# gpipe, P = 2, V = 1, m = 1: rank 1 starts its forward 0.1 s after the data arrived (dispatch gap)
# and each send takes 0.1 s of packing and posting.
EVENTS = [
    (0, "F0.0", 0.0, 1.0, "compute"), (0, "SF0.0", 1.0, 1.1, "comm"),
    (0, "RB0.0", 1.1, 4.5, "comm"), (0, "B0.0", 4.5, 6.5, "compute"),
    (1, "RF1.0", 0.0, 1.2, "comm"), (1, "F1.0", 1.3, 2.3, "compute"),
    (1, "B1.0", 2.3, 4.3, "compute"), (1, "SB1.0", 4.3, 4.4, "comm"),
]


@pytest.fixture
def run_dir(tmp_path):
    write_chrome_trace(EVENTS, tmp_path / "trace.json")
    config = {"pipeline": {"stages": 2, "virtual": 1, "schedule": "gpipe", "cache": True},
              "train": {"microbatches": 1}}
    (tmp_path / "summary.json").write_text(json.dumps({"config": config}))
    return tmp_path


def test_runtime_overhead_is_added_to_every_compute_action(run_dir):
    raw = calibrate_from(run_dir, runtime_overhead=False).costs
    charged = calibrate_from(run_dir).costs
    overhead = account(EVENTS, 2)["overhead_s_per_compute"]
    # 0.1 s dispatch + 2 x 0.1 s sends (+ receive work) over 4 compute actions
    assert overhead >= 0.3 / 4 - 1e-9
    assert raw.forward_s == pytest.approx((1.0, 1.0))
    assert charged.forward_s == pytest.approx(tuple(f + overhead for f in raw.forward_s))
    assert charged.backward_s == pytest.approx(tuple(b + overhead for b in raw.backward_s))
