"""What a memory prediction takes besides the model (`MemorySetup`: the run's parallel layout and
policies) and the choices its fields allow, shared by the parts of `simulator.memory`."""

from __future__ import annotations

from dataclasses import dataclass

DTYPE_BYTES = {"fp32": 4, "bf16": 2}
AC_POLICIES = ("none", "full", "selective")
DP_SHARDS = ("replicate", "fsdp")
# train's --fsdp-reshard-after-forward (`pipeline.config.RESHARD_AFTER_FORWARD`; the simulator reads no pipeline)
RESHARD_AFTER_FORWARD = ("never", "always")
ATTENTION_KERNELS = ("flash", "math")
MEMORY_KEYS = ("param_bytes", "grad_bytes", "optimizer_bytes", "activation_peak_bytes", "cache_peak_bytes")
# Launchers whose ranks on one host hand hops over through shared-memory slots (`comm.shm_transport`).
LAUNCHERS = ("inprocess", "local", "ray")
SLOT_LAUNCHERS = ("local", "ray")
SLOT_ALIGN_ELEMENTS = 64  # comm.shm_transport.ALIGN_ELEMENTS (the simulator imports no torch)


@dataclass(frozen=True, kw_only=True)
class MemorySetup:
    """What a memory prediction needs besides the model: the run's parallel layout and policies."""

    schedule: str
    n_stages: int
    n_virtual: int = 1
    n_microbatches: int
    tokens: int
    dtype: str = "bf16"
    cache: bool = True
    data_parallel: int = 1
    dp_shard: str = "replicate"
    activation_checkpoint: str = "none"
    layer_counts: tuple[int, ...] | None = None
    attention_kernel: str = "flash"
    reshard_after_forward: str = "never"  # fsdp: train's --fsdp-reshard-after-forward
    tensor_parallel: int = 1  # T, docs/spec.md section 10 (derived)
    sequence_parallel: bool | None = None  # None: on when T > 1
    launcher: str = "inprocess"  # train's --launcher: local and ray map shared-memory receive slots
    expert_parallel: int = 1  # EP, docs/spec.md section 12: E / EP routed experts per rank (derived for EP > 1)
    # EP > 1: the rows the most-loaded EP rank's experts receive over the balanced N K (1.0: balanced
    # routing); every rank is priced at it, so the prediction is the most-loaded rank's.
    moe_load_factor: float = 1.0

    @property
    def sp(self) -> bool:
        return self.tensor_parallel > 1 and self.sequence_parallel is not False

    def __post_init__(self) -> None:
        for name in ("n_stages", "n_virtual", "n_microbatches", "tokens", "data_parallel", "tensor_parallel",
                     "expert_parallel"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"MemorySetup.{name}={value!r} is invalid: must be an integer >= 1")
        for name, allowed in (("dtype", tuple(DTYPE_BYTES)), ("dp_shard", DP_SHARDS),
                              ("activation_checkpoint", AC_POLICIES), ("attention_kernel", ATTENTION_KERNELS),
                              ("reshard_after_forward", RESHARD_AFTER_FORWARD), ("launcher", LAUNCHERS)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"MemorySetup.{name}={getattr(self, name)!r} is invalid: choose one of "
                                 f"{', '.join(allowed)}")
        if not 1.0 <= self.moe_load_factor < float("inf"):  # NaN too
            raise ValueError(f"--moe-load-factor {self.moe_load_factor} is invalid: it is the most-loaded expert-"
                             "parallel rank's rows over the balanced ones, a number >= 1 (1.0: balanced routing)")
        if self.reshard_after_forward != "never" and self.dp_shard != "fsdp":
            raise ValueError(f"--fsdp-reshard-after-forward {self.reshard_after_forward} needs --dp-shard fsdp "
                             f"(it is FSDP2's; --dp-shard is {self.dp_shard})")
