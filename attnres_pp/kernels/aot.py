"""Ahead-of-time builds of the Triton depth-attention kernels for a GPU this machine does not have.

`launches(case)` runs the real launchers (phase 1 / phase 2 / MSAR's fused streams, forward and
backward) on meta tensors
with every `kernel[grid](...)` call recorded instead of run, so each build uses exactly the tiles,
warps, dtypes and argument specialisation (ints equal to 1 become constants, ints and pointers
divisible by 16 are marked so) that a CUDA launch of that shape would compile. `build(launch,
arch)` compiles one launch with `triton.compile` for `GPUTarget("cuda", arch, 32)` (PTX, then the
bundled ptxas) and reads its registers, stack frame, local and shared memory with the bundled
`cuobjdump --dump-resource-usage`; `occupancy` turns those into resident warps per SM.

A stack frame or local memory in a build means ptxas spilled registers: `scripts/aot_kernels.py`
fails on it. The kernels must have been decorated without TRITON_INTERPRET=1 (the interpreter
replaces them with objects that cannot be compiled).
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import subprocess
import tempfile
from dataclasses import dataclass

import torch

KERNEL_MODULES = ("triton_phase1", "triton_phase2", "triton_keygrad", "triton_msar_streams", "triton_msar_streams_bwd")
# Per-SM limits: (max resident warps, max resident blocks, registers, shared memory bytes).
SM_LIMITS = {80: (64, 32, 65536, 167936), 90: (64, 32, 65536, 233472)}
_RESOURCE_RE = re.compile(r"Function (\S+):\s*REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)")


@dataclass(frozen=True)
class Case:
    """One depth-attention shape: `op` "phase1" (N sources, S queries), "phase2" (one partial) or
    "streams" (MSAR's fused conv streams and phase 1: N sources, S queries per stream, one stream
    per kernel size plus the identity)."""

    op: str
    n_tokens: int
    width_d: int
    dtype: str  # "fp32" | "bf16"
    key_mode: str = "values"  # "values" (k = d), "projected" (own [N, T, r] keys), "sliced" (view)
    rank: int = 0
    n_queries: int = 1
    n_sources: int = 1
    kernel_sizes: tuple[int, ...] = (4, 8, 12)  # "streams" only: docs/spec.md section 1.4's default kappa

    def label(self) -> str:
        if self.op == "streams":
            return (f"streams m={len(self.kernel_sizes) + 1} kappa={max(self.kernel_sizes)} S={self.n_queries} "
                    f"N={self.n_sources} T={self.n_tokens} d={self.width_d} {self.dtype}")
        keys = "k=d" if self.key_mode == "values" else f"{self.key_mode} r={self.rank}"
        head = f"S={self.n_queries} N={self.n_sources} " if self.op == "phase1" else ""
        return f"{self.op} {head}T={self.n_tokens} d={self.width_d} {keys} {self.dtype}"


@dataclass(frozen=True)
class Launch:
    """One recorded kernel launch: the kernel, its bound arguments and the launch options."""

    case: Case
    kernel_name: str
    kernel: object
    args: tuple
    kwargs: dict


@dataclass(frozen=True)
class Build:
    kernel_name: str
    arch: int
    num_warps: int
    constexprs: dict
    registers: int
    stack: int
    local: int
    shared: int

    @property
    def spills(self) -> bool:
        return self.stack > 0 or self.local > 0


def tool_path(name: str) -> str | None:
    """Path of a CUDA tool bundled with triton's NVIDIA backend, or None."""
    import triton

    path = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)
    return path if os.access(path, os.X_OK) else None


def unavailable_reason() -> str | None:
    """Why nothing can be built here (no triton, no bundled ptxas/cuobjdump, interpreter mode), or None."""
    try:
        import triton  # noqa: F401
        from triton.backends.compiler import GPUTarget  # noqa: F401
        from triton.compiler import ASTSource  # noqa: F401
    except ImportError as error:
        return f"triton's compiler cannot be imported: {error}"
    missing = [name for name in ("ptxas", "cuobjdump") if tool_path(name) is None]
    if missing:
        return f"triton's NVIDIA backend does not bundle {', '.join(missing)}"
    if os.environ.get("TRITON_INTERPRET", "0") in ("1", "true", "True"):
        return "TRITON_INTERPRET=1 is set: interpreted kernels cannot be compiled; unset it"
    return None


class _Recorder:
    """Stands in for a kernel: `rec[grid](*args, **kwargs)` records the call instead of running it."""

    def __init__(self, name, kernel, case, sink):
        self.name, self.kernel, self.case, self.sink = name, kernel, case, sink

    def __getitem__(self, grid):
        def record(*args, **kwargs):
            self.sink.append(Launch(self.case, self.name, self.kernel, args, kwargs))

        return record


@contextlib.contextmanager
def _recording(case: Case, sink: list):
    import importlib

    modules = [importlib.import_module(f"attnres_pp.kernels.{name}") for name in KERNEL_MODULES]
    saved = []
    for module in modules:
        for attr, value in list(vars(module).items()):
            if attr.endswith("_kernel") and hasattr(value, "arg_names"):
                saved.append((module, attr, value))
                setattr(module, attr, _Recorder(attr.strip("_"), value, case, sink))
        if hasattr(module, "check_device"):  # meta tensors stand in for CUDA ones
            saved.append((module, "check_device", module.check_device))
            module.check_device = lambda tensor: None
    try:
        yield
    finally:
        for module, attr, value in saved:
            setattr(module, attr, value)


def _meta(*shape, dtype):
    return torch.empty(*shape, dtype=dtype, device="meta")


def launches(case: Case) -> list[Launch]:
    """Every kernel launch of the case's forward and backward, recorded from the real launchers."""
    from attnres_pp.kernels import triton_msar_streams, triton_msar_streams_bwd, triton_phase1, triton_phase2

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[case.dtype]
    n, t, d, s, r = case.n_sources, case.n_tokens, case.width_d, case.n_queries, case.rank
    width_k = d if case.key_mode == "values" else r
    sink: list[Launch] = []
    with _recording(case, sink):
        if case.op == "streams":
            # As the model calls it: sources in the activation dtype, fp32 conv taps and queries
            # (parameters); tokens are whole sequences (T / 4 of them here).
            sizes, seq_len = list(case.kernel_sizes), t // 4
            sources = _meta(n, t, d, dtype=dtype)
            taps = _meta(n, len(sizes), max(sizes), d, dtype=torch.float32)
            queries = _meta(len(sizes) + 1, s, d, dtype=torch.float32)
            out, lse = triton_msar_streams.streams_forward(sources, taps, sizes, queries, seq_len)
            triton_msar_streams_bwd.streams_backward(sources, taps, sizes, queries, seq_len, lse,
                                                     torch.empty_like(out), torch.empty_like(lse))
        elif case.op == "phase1":
            values = _meta(n, t, d, dtype=dtype)
            keys = {"values": None, "projected": _meta(n, t, r, dtype=dtype), "sliced": values[..., d - r :]}
            keys = keys[case.key_mode]
            queries = _meta(s, width_k, dtype=dtype)
            out, lse = triton_phase1.phase1_forward(values, queries, keys)
            triton_phase1.phase1_backward(values, queries, keys, lse, torch.empty_like(out), torch.empty_like(lse))
        else:
            partial = _meta(t, d, dtype=dtype)
            key = {"values": None, "projected": _meta(t, r, dtype=dtype), "sliced": partial[:, d - r :]}
            key = key[case.key_mode]
            out1, lse1, query = _meta(t, d, dtype=dtype), _meta(t, dtype=torch.float32), _meta(width_k, dtype=dtype)
            h = triton_phase2.phase2_forward(out1, lse1, partial, query, key)
            triton_phase2.phase2_backward(out1, lse1, partial, query, key, torch.empty_like(h))
    return sink


def _specialize(backend, kernel, args, kwargs):
    """(signature, constexprs, attrs, options) as triton's JIT would derive them for a launch."""
    try:
        from triton.runtime.jit import native_specialize_impl as specialize_impl
    except ImportError:  # older triton: the Python implementation
        from triton.runtime.jit import specialize_impl

    bound = kernel.signature.bind(*args, **{k: v for k, v in kwargs.items() if k in kernel.arg_names})
    bound.apply_defaults()
    signature, constexprs, attrs = {}, {}, {}
    for index, (param, (name, value)) in enumerate(zip(kernel.params, bound.arguments.items(), strict=True)):
        if param.is_constexpr:
            signature[name], constexprs[(index,)] = "constexpr", value
            continue
        kind, attr = specialize_impl(
            backend, value, param.is_const, not param.do_not_specialize, not param.do_not_specialize_on_alignment
        )
        signature[name] = kind
        if kind == "constexpr":  # an int equal to 1
            constexprs[(index,)] = value
        elif isinstance(attr, str) and attr:
            attrs[(index,)] = backend.parse_attr(attr)
    options = {k: v for k, v in kwargs.items() if k not in kernel.arg_names}
    return signature, constexprs, attrs, options


def build_key(launch: Launch, arch: int) -> tuple:
    """Launches with equal keys compile to the same binary."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend

    backend = make_backend(GPUTarget("cuda", arch, 32))
    signature, constexprs, attrs, options = _specialize(backend, launch.kernel, launch.args, launch.kwargs)
    freeze = lambda d: tuple(sorted((k, repr(v)) for k, v in d.items()))  # noqa: E731
    return (launch.kernel_name, arch, freeze(signature), freeze(constexprs), freeze(attrs), freeze(options))


def build(launch: Launch, arch: int) -> Build:
    """Compile one recorded launch for sm_`arch` and read its resource usage."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend

    target = GPUTarget("cuda", arch, 32)
    signature, constexprs, attrs, options = _specialize(make_backend(target), launch.kernel, launch.args, launch.kwargs)
    compiled = triton.compile(ASTSource(launch.kernel, signature, constexprs, attrs), target=target, options=options)
    usage = resource_usage(compiled.asm["cubin"])[compiled.metadata.name]
    named = {launch.kernel.arg_names[path[0]]: value for path, value in constexprs.items()}
    return Build(
        kernel_name=launch.kernel_name,
        arch=arch,
        num_warps=compiled.metadata.num_warps,
        constexprs=named,
        registers=usage["REG"],
        stack=usage["STACK"],
        local=usage["LOCAL"],
        shared=max(usage["SHARED"], compiled.metadata.shared),
    )


def resource_usage(cubin: bytes) -> dict[str, dict[str, int]]:
    """{function: {REG, STACK, SHARED, LOCAL}} from `cuobjdump --dump-resource-usage`."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.cubin")
        with open(path, "wb") as handle:
            handle.write(cubin)
        text = subprocess.run(
            [tool_path("cuobjdump"), "--dump-resource-usage", path], capture_output=True, text=True, check=True
        ).stdout
    return parse_resource_usage(text)


def parse_resource_usage(text: str) -> dict[str, dict[str, int]]:
    """The per-function REG / STACK / SHARED / LOCAL numbers of cuobjdump's resource dump."""
    found = {}
    for match in _RESOURCE_RE.finditer(text):
        name, *numbers = match.groups()
        found[name] = dict(zip(("REG", "STACK", "SHARED", "LOCAL"), map(int, numbers), strict=True))
    if not found:
        raise RuntimeError(f"cuobjdump printed no resource usage:\n{text}")
    return found


def occupancy(registers: int, shared_bytes: int, num_warps: int, arch: int) -> float:
    """Resident warps per SM over the maximum, from registers (allocated per warp in units of 256),
    shared memory (plus 1 KiB reserved per block) and the warp and block limits."""
    max_warps, max_blocks, sm_registers, sm_shared = SM_LIMITS[arch]
    per_warp = math.ceil(max(registers, 1) * 32 / 256) * 256
    blocks = min(
        max_blocks,
        max_warps // num_warps,
        (sm_registers // per_warp) // num_warps,
        sm_shared // (shared_bytes + 1024),
    )
    return blocks * num_warps / max_warps
