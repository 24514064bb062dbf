"""--attention-kernel: flash is what the fitted units measure; math adds its fp32 probabilities
(H x T x T per sequence) and drops the log-sum-exp, derived from shapes (simulator.memory)."""

import itertools
import json

import pytest

from attnres_pp.comm.partition import make_partition
from attnres_pp.model.config import ModelConfig
from attnres_pp.schedule.schedules import build_schedule
from attnres_pp.simulator.memory import MemorySetup, activation_bytes, predict_memory, predict_ranks
from attnres_pp.simulator.plan import PlanRequest, plan


def _cfg(seq_len=256, n_heads=4, residual="standard"):
    return ModelConfig(vocab_size=512, n_layers=8, d_model=128, n_heads=n_heads, d_ff=0, seq_len=seq_len,
                       residual=residual, block_size=4)


def _setup(kernel, **kw):
    return MemorySetup(schedule="1f1b", n_stages=2, n_microbatches=4, tokens=2 * 256, attention_kernel=kernel, **kw)


@pytest.mark.parametrize("policy", ["none", "full", "selective"])
@pytest.mark.parametrize("residual", ["standard", "attnres"])
def test_flash_never_above_math(policy, residual):
    cfg = _cfg(residual=residual)
    flash = predict_memory(cfg, _setup("flash", activation_checkpoint=policy))
    math_ = predict_memory(cfg, _setup("math", activation_checkpoint=policy))
    for f, m in zip(flash, math_, strict=True):
        assert f.peak_bytes <= m.peak_bytes
        assert f.terms["activation_peak_bytes"] <= m.terms["activation_peak_bytes"]


def test_math_difference_is_scores_minus_lse_per_layer_in_flight():
    # 1F1B, P=2, m=4: rank 0 holds P=2 microbatches' forwards at its peak, rank 1 one.
    t_seq, heads, d, n_seq = 256, 4, 128, 2
    cfg = _cfg(seq_len=t_seq, n_heads=heads)
    partition = make_partition(cfg.n_layers, 2, 1, None)
    schedule = build_schedule("1f1b", 2, 1, 4)
    flash = predict_ranks(cfg, _setup("flash"), schedule, partition, None)
    math_ = predict_ranks(cfg, _setup("math"), schedule, partition, None)
    # Math saves sqrt(scale) q and k and v as fp32 copies (bf16 inputs upcast) and the fp32
    # probabilities; flash the rotated q and k (bf16 copies: rotary positions, the default), the bf16
    # qkv storage (v is a view of it) and the fp32 log-sum-exp.
    scores, lse = 4 * heads * t_seq * t_seq, 4 * heads * t_seq
    per_layer = scores + 3 * 4 * t_seq * d - 2 * 2 * t_seq * d - 3 * 2 * t_seq * d - lse
    layers_per_chunk = cfg.n_layers // 2
    for rank, in_flight in ((0, 2), (1, 1)):
        diff = math_[rank].terms["activation_peak_bytes"] - flash[rank].terms["activation_peak_bytes"]
        assert diff == per_layer * layers_per_chunk * n_seq * in_flight


def test_equal_only_in_what_attention_saves():
    cfg = _cfg()
    partition = make_partition(cfg.n_layers, 2, 1, None)
    for dtype, policy in itertools.product(("bf16", "fp32"), ("none", "full", "selective")):
        f = activation_bytes(cfg, partition, 1, tokens=512, dtype=dtype, activation_checkpoint=policy)
        m = activation_bytes(cfg, partition, 1, tokens=512, dtype=dtype, activation_checkpoint=policy,
                             attention_kernel="math")
        assert (f.stored, f.input_kept) == (m.stored, m.input_kept)
        if policy == "full":
            # Everything is recomputed, the attention included: the math kernel's probabilities are
            # transient in the recomputation, the one B runs and the one I runs under a split schedule.
            assert f.saved == m.saved and m.transient > f.transient and m.input_transient > f.input_transient
        else:
            assert f.input_transient == m.input_transient


def test_plan_with_flash_is_at_least_as_lean():
    # Flash's layouts are a superset of math's: its best row is at least as fast, and a layout both
    # keep costs no more memory under flash.
    cfg = ModelConfig(vocab_size=32000, n_layers=16, d_model=1024, n_heads=8, d_ff=0, seq_len=4096,
                      residual="attnres", block_size=4)
    rows = {k: plan(PlanRequest(model=cfg, global_batch=32, gpus=8, gpu_memory_gib=40, block_size=4, top=50,
                                attention_kernel=k)) for k in ("flash", "math")}
    assert rows["flash"]
    if rows["math"]:
        assert rows["flash"][0]["step_time_s"] <= rows["math"][0]["step_time_s"]
    peaks = {k: {json.dumps(r["config"], sort_keys=True): r["peak_memory_bytes"] for r in v} for k, v in rows.items()}
    shared = peaks["flash"].keys() & peaks["math"].keys()
    assert all(peaks["flash"][key] <= peaks["math"][key] for key in shared)


def _cli(capsys, *args):
    from attnres_pp.cli import main

    try:
        code = main(["simulate", *args])
    except SystemExit as exit_:
        code = exit_.code
    out = capsys.readouterr()
    return code, out.out, out.err


def test_bogus_kernel_is_one_error_line(capsys):
    for command in (["memory", "--schedule", "1f1b", "--stages", "2", "--microbatches", "2", "--layers", "4",
                     "--block-size", "2"], ["plan", "--layers", "4", "--global-batch", "8", "--gpus", "2",
                                            "--gpu-memory-gib", "80"]):
        code, _out, err = _cli(capsys, *command, "--attention-kernel", "bogus")
        assert code == 2
        lines = [line for line in err.splitlines() if line.strip()]
        assert len(lines) == 1 and lines[0].startswith("error:") and "--attention-kernel" in lines[0]


def test_json_names_the_kernel(capsys):
    base = ["memory", "--schedule", "1f1b", "--stages", "2", "--microbatches", "2", "--layers", "4",
            "--block-size", "2", "--d-model", "64", "--seq-len", "64", "--tokens", "64", "--json"]
    assert json.loads(_cli(capsys, *base)[1])["attention_kernel"] == "flash"
    assert json.loads(_cli(capsys, *base, "--attention-kernel", "math")[1])["attention_kernel"] == "math"


# The layer recipes change what each kernel saves (docs/spec.md section 11): rotated or normalised
# q and k are new tensors, grouped kv heads have their own storage and math repeats them.
RECIPES = {"legacy": {"positions": "learned", "mlp": "gelu"}, "rope": {}, "rope_gqa": {"n_kv_heads": 2},
           "learned_gqa": {"positions": "learned", "n_kv_heads": 2}, "rope_qk_norm": {"qk_norm": True},
           "learned_mqa_qk_norm": {"positions": "learned", "n_kv_heads": 1, "qk_norm": True},
           "rope_gqa_qk_norm": {"n_kv_heads": 2, "qk_norm": True}}


@pytest.mark.parametrize("residual", ["standard", "attnres"])
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_math_correction_matches_the_cpu_math_kernel(residual, dtype, recipe):
    # The CPU runs both kernels: the derived difference is what the saved-tensor count sees.
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from attnres_lab.memory_units import saved_bytes
    from attnres_pp.simulator.memory import attention_correction

    cfg = ModelConfig(vocab_size=48, n_layers=2, d_model=32, n_heads=4, d_ff=64, seq_len=16, residual=residual,
                      block_size=2, **RECIPES[recipe])
    partition = make_partition(2, 1, 1, None)
    flash = saved_bytes(cfg, partition, 0, n_sequences=2, dtype=dtype)
    with sdpa_kernel([SDPBackend.MATH]):
        math_ = saved_bytes(cfg, partition, 0, n_sequences=2, dtype=dtype)
    derived = attention_correction(cfg, partition, 0, tokens=32, dtype=dtype, activation_checkpoint="none",
                                   attention_kernel="math")
    assert math_ - flash == derived["saved"]
