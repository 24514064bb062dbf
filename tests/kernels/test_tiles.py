"""Tile sizing of the Triton launchers: every program's live tiles fit the register budget, d is
chunked only when a row of every query does not fit, and CUDA launches state their register cap.
(scripts/aot_kernels.py and tests/kernels/test_aot_kernels.py check the resulting builds for spills.)"""

import os

import torch

if not torch.cuda.is_available():  # before any kernel module is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from attnres_pp.kernels import triton_common  # noqa: E402
from attnres_pp.kernels.triton_common import pick_tiles  # noqa: E402

SHAPES = [(1, 16384, 7168, 7168), (16, 16384, 7168, 128), (8, 16384, 4096, 64), (4, 5, 20, 20), (3, 70, 12, 6)]


def _pow2(x):
    return x & (x - 1) == 0


@pytest.mark.parametrize("row_tiles,query_tiles", [(0, 0), (1, 0), (3, 2)])
@pytest.mark.parametrize("shape", SHAPES)
def test_live_tiles_fit_the_budget(shape, row_tiles, query_tiles):
    n_queries, n_tokens, width_d, width_k = shape
    tiles = pick_tiles(*shape, None, row_tiles=row_tiles, query_tiles=query_tiles)
    live = (tiles.block_s * tiles.block_t + row_tiles * tiles.block_t + query_tiles * tiles.block_s) * tiles.block_d
    assert live <= triton_common.DEFAULT_TILE_ELEMS
    assert (tiles.block_s + 1) * tiles.block_t * tiles.block_k <= triton_common.DEFAULT_TILE_ELEMS // 2
    assert all(_pow2(b) for b in (tiles.block_s, tiles.block_t, tiles.block_d, tiles.block_k))
    assert tiles.block_s >= n_queries and tiles.n_t_tiles * tiles.block_t >= n_tokens
    assert tiles.n_d_chunks * tiles.block_d >= width_d
    # Budget elements per thread stay at THREAD_ELEMS or fewer (16 warps at most).
    assert live <= tiles.num_warps * 32 * triton_common.THREAD_ELEMS
    assert 4 <= tiles.num_warps <= triton_common.MAX_WARPS


def test_d_is_chunked_only_when_a_row_of_every_query_does_not_fit():
    assert pick_tiles(4, 1000, 1024, 1024, None).n_d_chunks == 1
    assert pick_tiles(16, 1000, 7168, 7168, None).n_d_chunks == 14  # 16 x 512 per program


def test_launch_options_state_the_register_cap():
    options = pick_tiles(16, 16384, 7168, 7168, None).launch_options
    if torch.version.hip is None:
        assert options == {"num_warps": 16, "maxnreg": 128}
    small = pick_tiles(1, 4, 8, 8, None)
    assert small.launch_options["num_warps"] == 4
    assert small.launch_options.get("maxnreg", 255) == 255
