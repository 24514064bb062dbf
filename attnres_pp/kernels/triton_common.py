"""Shared pieces of the Triton depth-attention kernels: the per-tile key-score helper, tile sizing,
buffer allocation (NaN-filled in test mode) and the device check.

Every kernel here runs one program per tile of tokens (and, for wide rows, per chunk of channels).
Offsets that can exceed 2**31 elements (N * T * d at T = 64k, d = 7168) are formed in int64.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

# Register budget per program, in fp32 elements of the live tiles (the [S, T, d-chunk] tile plus,
# where a kernel says so, [T, d-chunk] row tiles and [S, d-chunk] query tiles). A program has at
# most 16 warps (512 threads), and 16 warps cap a thread at 128 registers; THREAD_ELEMS elements
# of the budget per thread leave room for the products, pointers and masks beside the tiles, so no
# build spills (`scripts/aot_kernels.py` checks this for sm_90 and sm_80 at paper-scale shapes; a
# budget of 16384 at 32 elements per thread spilled in 44 of 416 builds). Tests shrink the budget
# to force the chunked code paths on tiny shapes.
DEFAULT_TILE_ELEMS = 8192
THREAD_ELEMS = 16
MAX_BLOCK_T = 64
MAX_WARPS = 16

# When True, every buffer a launcher allocates starts as NaN, so an element that no program writes
# shows up in a test. Tests flip it; production keeps torch.empty.
FILL_BUFFERS_WITH_NAN = False


@dataclass(frozen=True)
class Tiles:
    """Compile-time block sizes for one launch (all powers of two) and the launch geometry."""

    block_s: int
    block_t: int
    block_d: int
    block_k: int
    n_t_tiles: int
    n_d_chunks: int
    num_warps: int

    @property
    def launch_options(self) -> dict:
        """num_warps, and on CUDA the register cap that many warps allow (65536 per SM / threads).
        Stating the cap stops ptxas trading a few spilled registers for a second resident program
        (with `.reqntid` alone it caps itself at 64 and spills; see scripts/aot_kernels.py)."""
        if torch.version.hip is not None:  # ROCm's Triton backend has no maxnreg option
            return {"num_warps": self.num_warps}
        return {"num_warps": self.num_warps, "maxnreg": min(255, 65536 // (32 * self.num_warps))}


def pick_tiles(
    n_queries: int,
    n_tokens: int,
    width_d: int,
    width_k: int,
    tile_elems: int | None,
    *,
    row_tiles: int = 0,
    query_tiles: int = 0,
) -> Tiles:
    """Size one program's tiles so that [S, T, D] + row_tiles x [T, D] + query_tiles x [S, D]
    elements (padded sizes) fit `tile_elems`: the whole query set always sits in one program (so
    each source is read once for all queries); d is chunked across programs only when one row of
    every query does not fit. The key chunk K is sized so that the key-score product [S, T, K] and
    the key tile [T, K] take at most half the budget. Warps: THREAD_ELEMS budget elements each."""
    budget = tile_elems or DEFAULT_TILE_ELEMS
    block_s = triton.next_power_of_2(n_queries)

    def cost(block_t: int, block_d: int) -> int:
        return (block_s * block_t + row_tiles * block_t + query_tiles * block_s) * block_d

    block_d = triton.next_power_of_2(width_d)
    while block_d > 1 and cost(1, block_d) > budget:
        block_d //= 2
    max_t = min(MAX_BLOCK_T, triton.next_power_of_2(n_tokens))
    block_t = 1
    while block_t < max_t and cost(2 * block_t, block_d) <= budget:
        block_t *= 2
    key_room = max(1, budget // (2 * (block_s + 1) * block_t))
    block_k = min(triton.next_power_of_2(width_k), 1 << (key_room.bit_length() - 1))
    threads = max(1, cost(block_t, block_d) // THREAD_ELEMS)
    num_warps = max(4, min(MAX_WARPS, triton.next_power_of_2(threads) // 32))
    return Tiles(
        block_s=block_s,
        block_t=block_t,
        block_d=block_d,
        block_k=block_k,
        n_t_tiles=triton.cdiv(n_tokens, block_t),
        n_d_chunks=triton.cdiv(width_d, block_d),
        num_warps=num_warps,
    )


def new_buffer(shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Uninitialised buffer (NaN-filled when FILL_BUFFERS_WITH_NAN, to catch unwritten elements)."""
    if FILL_BUFFERS_WITH_NAN:
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, device=device)


def check_device(tensor: torch.Tensor) -> None:
    """Triton kernels need CUDA tensors, or CPU tensors under the interpreter (TRITON_INTERPRET=1)."""
    if not tensor.is_cuda and os.environ.get("TRITON_INTERPRET", "0") not in ("1", "true", "True"):
        raise RuntimeError(
            "the Triton backend needs CUDA tensors; for CPU tensors set TRITON_INTERPRET=1 before "
            "importing attnres_pp.kernels.triton_ops, or use backend='torch'"
        )


@triton.jit
def tile_offsets(T, n_chunks, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
    """This program's token tile and channel chunk: (pid_t, pid_c, offs_t64, mask_t, offs_c).

    Programs are numbered chunk-fastest, so those sharing a token tile run side by side; token
    offsets are int64 because T x stride can pass 2^31 at large T and d.
    """
    pid = tl.program_id(0)
    pid_t = pid // n_chunks
    pid_c = pid % n_chunks
    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_c = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    return pid_t, pid_c, offs_t.to(tl.int64), offs_t < T, offs_c


@triton.jit
def key_scores(
    key_ptr,  # base of one source's keys [T, K] (already offset to the source)
    stride_kt,
    stride_kk,
    offs_t64,  # [BLOCK_T] int64 token indices
    mask_t,
    q_ptr,  # queries [S, K]
    stride_qs,
    stride_qk,
    S,
    K,
    eps,
    BLOCK_S: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """scores [BLOCK_S, BLOCK_T] = q . RMSNorm(key) and rstd [BLOCK_T] = 1/sqrt(mean(key^2) + eps).

    The key row is read in BLOCK_K chunks, so any key width works; padded queries and tokens load
    zeros and give finite scores that the callers never store."""
    offs_s = tl.arange(0, BLOCK_S)
    mask_s = offs_s < S
    sumsq_T = tl.zeros([BLOCK_T], tl.float32)
    dots_ST = tl.zeros([BLOCK_S, BLOCK_T], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        key_TK = tl.load(
            key_ptr + offs_t64[:, None] * stride_kt + offs_k[None, :] * stride_kk,
            mask=mask_t[:, None] & mask_k[None, :],
            other=0.0,
        ).to(tl.float32)
        q_SK = tl.load(
            q_ptr + offs_s[:, None] * stride_qs + offs_k[None, :] * stride_qk,
            mask=mask_s[:, None] & mask_k[None, :],
            other=0.0,
        ).to(tl.float32)
        sumsq_T += tl.sum(key_TK * key_TK, axis=1)
        dots_ST += tl.sum(q_SK[:, None, :] * key_TK[None, :, :], axis=2)
    rstd_T = 1.0 / tl.sqrt(sumsq_T / K + eps)
    return dots_ST * rstd_T[None, :], rstd_T
