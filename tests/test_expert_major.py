"""Expert-major compute (`engine.expert_compute`): the tile layout's invariants, the same
bits as mlx-lm's form in every quantization mode, and `ExpertMajor`'s choice of form.

`test_same_bits_on_cuda` is the check for MLX CUDA, skipped elsewhere: run it where MLX
has CUDA (`pytest tests/test_expert_major.py`); CI has no GPU.
"""

from types import SimpleNamespace

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mlx_lm.models.switch_layers import SwiGLU

from engine import expert_compute
from engine.expert_compute import (
    MIN_PAIRS_PER_EXPERT,
    ExpertMajor,
    expert_major_outputs,
    expert_outputs,
    tile_layout,
)

GLU = SimpleNamespace(kind="SwitchGLU", activation=SwiGLU())
MLP = SimpleNamespace(kind="SwitchMLP", activation=mx.sin)
# mode -> (group size, bits); None: unquantized (float32: MLX's CPU gather_mm takes no other).
MODES = {
    "affine4": ("affine", 32, 4),
    "affine8": ("affine", 32, 8),
    "mxfp4": ("mxfp4", 32, 4),
    "mxfp8": ("mxfp8", 32, 8),
    "nvfp4": ("nvfp4", 16, 4),
    "none": None,
}


def make_pool(
    mode: str, kind: str = "SwitchGLU", d=64, width=32, rows=8, bias=False, seed=0, group=None
):
    """A random pool of `rows` experts: (pool, quantization) as the engine keeps them."""
    mx.random.seed(seed)
    names = ("up_proj", "gate_proj", "down_proj") if kind == "SwitchGLU" else ("fc1", "fc2")
    pool, quant = {}, {}
    for name in names:
        out, inp = (d, width) if name in ("down_proj", "fc2") else (width, d)
        w = mx.random.normal((rows, out, inp)) * 0.1
        if MODES[mode] is None:
            pool[f"{name}.weight"], quant[name] = w, None
        else:
            qmode, mode_group, bits = MODES[mode]
            group = group or mode_group
            q = mx.quantize(w, group_size=group, bits=bits, mode=qmode)
            pool[f"{name}.weight"], pool[f"{name}.scales"] = q[0], q[1]
            if qmode == "affine":
                pool[f"{name}.biases"] = q[2]
            quant[name] = {"group_size": group, "bits": bits, "mode": qmode}
        if bias:
            pool[f"{name}.bias"] = mx.random.normal((rows, out)) * 0.1
    return pool, quant


def routed(tokens: int, rows: int, k: int, seed: int = 1) -> mx.array:
    """(tokens, k) int32 distinct pool rows per token."""
    rng = np.random.default_rng(seed)
    return mx.array(np.stack([rng.choice(rows, k, replace=False) for _ in range(tokens)]), mx.int32)


@settings(max_examples=60, deadline=None)
@given(
    pool_rows=st.integers(1, 12),
    tile=st.integers(1, 9),
    data=st.data(),
)
def test_tile_layout_places_every_pair_once_in_a_tile_of_its_row(pool_rows, tile, data):
    rows = np.array(data.draw(st.lists(st.integers(0, pool_rows - 1), min_size=1, max_size=40)))
    source, tile_rows, place = (
        np.asarray(a) for a in tile_layout(mx.array(rows, mx.int32), pool_rows, tile)
    )
    pairs = len(rows)
    tiles = -(-pairs // tile) + min(pool_rows, pairs)
    assert source.shape == (tiles * tile,) and tile_rows.shape == (tiles,)
    # Each pair's output row holds that pair's input, in a tile of the pair's pool row.
    assert sorted(place.tolist()) == sorted(set(place.tolist()))
    assert (source[place] == np.arange(pairs)).all()
    assert (tile_rows[place // tile] == rows).all()
    # The tiles' rows are sorted (gather_qmm's sorted_indices), padding last.
    assert (np.diff(tile_rows.astype(np.int64)) >= 0).all()
    # A row's pairs fill ceil(n / tile) tiles, every one full but the last; the tiles
    # holding no pair (padding) are the last ones.
    used = np.bincount(place // tile, minlength=tiles)
    for r in np.unique(rows):
        n = int((rows == r).sum())
        counts = sorted(used[(tile_rows == r) & (used > 0)], reverse=True)
        assert len(counts) == -(-n // tile) and sum(counts) == n
        assert all(c == tile for c in counts[:-1])
    held = np.flatnonzero(used > 0)
    assert (held == np.arange(len(held))).all()


@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("kind", ["SwitchGLU", "SwitchMLP"])
def test_expert_major_is_mlx_lms_bits(mode, kind):
    pool, quant = make_pool(mode, kind, bias=kind == "SwitchMLP")
    math = GLU if kind == "SwitchGLU" else MLP
    dtype = mx.float32 if MODES[mode] is None else mx.bfloat16
    for tokens in (1, 5, 40):
        x = mx.random.normal((2, tokens, 64)).astype(dtype)
        rows = mx.stack([routed(tokens, 8, 3, seed=s) for s in (1, 2)])
        ref = expert_outputs(x, pool, rows, quant, math)
        for tile in (1, 4, 16, 32):
            y = expert_major_outputs(x, pool, rows, quant, math, tile)
            assert y.shape == ref.shape == (2, tokens, 3, 64)
            assert mx.array_equal(ref, y).item(), (mode, kind, tokens, tile)


def test_the_choice_of_form():
    q4 = {"up_proj": {"group_size": 64, "bits": 4, "mode": "affine"}}
    fp4 = {"up_proj": {"group_size": 32, "bits": 4, "mode": "mxfp4"}}
    n = 128
    # Decode steps and short calls keep mlx-lm's form, whatever the mode.
    assert ExpertMajor("on", False, n).tile(8, q4) is None
    assert ExpertMajor("on", True, n).tile(MIN_PAIRS_PER_EXPERT * n - 1, q4) is None
    # Long calls: tiles of 16 rows, of 32 from 32 pairs per expert.
    on = ExpertMajor("on", False, n)
    assert on.tile(MIN_PAIRS_PER_EXPERT * n, q4) == 16
    assert on.tile(32 * n - 1, q4) == 16
    assert on.tile(32 * n, fp4) == 32
    assert on.tile(2048 * 8, {"up_proj": None}) == 32
    # auto: on MLX CUDA for affine only; never on the CPU or Metal; off: never.
    assert ExpertMajor("auto", True, n).tile(2048 * 8, q4) == 32
    assert ExpertMajor("auto", True, n).tile(2048 * 8, fp4) is None
    assert ExpertMajor("auto", True, n).tile(2048 * 8, {"up_proj": None}) is None
    assert ExpertMajor("auto", False, n).tile(2048 * 8, q4) is None
    assert ExpertMajor("off", True, n).tile(2048 * 8, q4) is None


def test_a_kind_whose_forms_differ_keeps_mlx_lms_form(monkeypatch):
    pool, quant = make_pool("affine4")
    x = mx.random.normal((40, 64)).astype(mx.bfloat16)
    rows = routed(40, 8, 3)
    ref = expert_outputs(x, pool, rows, quant, GLU)
    honest = ExpertMajor("on", False, 8)
    assert mx.array_equal(honest.outputs(x, pool, rows, quant, GLU), ref).item()
    assert list(honest.same_bits.values()) == [True]
    calls = []
    real = expert_compute.expert_major_outputs

    def off_by_a_bit(*args):
        calls.append(1)
        return real(*args) * 1.001

    monkeypatch.setattr(expert_compute, "expert_major_outputs", off_by_a_bit)
    wary = ExpertMajor("on", False, 8)
    for _ in range(3):
        assert mx.array_equal(wary.outputs(x, pool, rows, quant, GLU), ref).item()
    assert list(wary.same_bits.values()) == [False]
    assert len(calls) == 1  # compared once, never used


@pytest.mark.skipif(not expert_compute.mx.cuda.is_available(), reason="needs MLX CUDA")
@pytest.mark.parametrize("mode", ["affine4", "affine8", "mxfp4"])
def test_same_bits_on_cuda(mode):
    """Where the engine computes expert-major on MLX CUDA (and the modes measured beside
    it), every bit equals mlx-lm's form at the shapes of Qwen3-30B-A3B's experts, from
    one token to a 2,048-token prefill chunk, at each tile height `ExpertMajor` picks."""
    group = 64 if mode == "affine4" else None  # Qwen3-30B-A3B's
    pool, quant = make_pool(mode, d=2048, width=768, rows=128, group=group)
    for tokens in (1, 16, 64, 256, 2048):
        x = (mx.random.normal((tokens, 2048)) * 0.5).astype(mx.bfloat16)
        rows = routed(tokens, 128, 8)
        ref = expert_outputs(x, pool, rows, quant, GLU)
        for tile in (16, 32):
            y = expert_major_outputs(x, pool, rows, quant, GLU, tile)
            assert mx.array_equal(ref, y).item(), (mode, tokens, tile)
