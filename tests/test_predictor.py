"""Ahead scheduling: targets, the cutoff, nothing past the last layer, every layer after
the first predicted exactly once per forward; the dense router copy and the prefetch op."""

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import engine.predictor as predictor_mod
from engine._ext import Router
from engine.cache import open_cache
from engine.config import StreamConfig
from engine.predictor import Predictor


class FixedRouter:
    """A router stand-in: fixed logits favouring experts 7, 6, 5, ..."""

    def __call__(self, x):
        return mx.broadcast_to(mx.arange(8, dtype=mx.float32), (x.shape[0], 8))


def predictor(store, **fields):
    config = StreamConfig(expert_slots=2, side_slots=2, prefetch=True, **fields)
    return Predictor(open_cache(store, config), [FixedRouter()] * 4, config)


def test_targets_follow_ahead_lo_then_ahead_hi_and_skip_no_layer(qwen_store):
    # One target per layer (L + 2 from the cutoff on) would never predict layer 2.
    c = predictor(qwen_store, ahead_lo=1, ahead_hi=2, cutoff=1)
    assert [list(c.targets_for(layer)) for layer in range(4)] == [[1], [2, 3], [], []]
    c = predictor(qwen_store, ahead_lo=1, ahead_hi=1)  # cutoff defaults to half: 2
    assert c.cutoff == 2
    assert [list(c.targets_for(layer)) for layer in range(4)] == [[1], [2], [3], []]
    # A shorter distance after a longer one predicts no layer twice.
    c = predictor(qwen_store, ahead_lo=3, ahead_hi=1, cutoff=1)
    assert [list(c.targets_for(layer)) for layer in range(4)] == [[1, 2, 3], [], [], []]


@given(
    num_layers=st.integers(1, 64),
    ahead_lo=st.integers(1, 8),
    ahead_hi=st.integers(1, 8),
    cutoff=st.integers(0, 70),
)
def test_every_layer_but_the_first_is_one_nearer_layers_target(
    num_layers, ahead_lo, ahead_hi, cutoff
):
    ranges = predictor_mod._schedule(num_layers, ahead_lo, ahead_hi, cutoff)
    targets = [(t, layer) for layer, r in enumerate(ranges) for t in r]
    assert sorted(t for t, _ in targets) == list(range(1, num_layers))  # each exactly once
    # what the cache sizes the side rows by (engine.memory_plan.held_rows)
    covered = {t for t, _ in targets}
    assert predictor_mod.prefetch_targets([True] * num_layers) == [
        li in covered for li in range(num_layers)
    ]
    for t, layer in targets:
        assert layer < t <= layer + (ahead_lo if layer < cutoff else ahead_hi)
    assert all(r.step == 1 for r in ranges)  # nearest first


def test_one_op_per_target_chained_into_one_scalar(qwen_store):
    c = predictor(qwen_store, ahead_lo=1, ahead_hi=2, cutoff=1, sync=True)
    x = mx.zeros((1, 1, 64))
    tokens = [c.prefetch_token(layer, x) for layer in range(4)]
    assert [t is not None for t in tokens] == [True, True, False, False]
    mx.eval(tokens[1])  # layer 1's scalar: its predictions for layers 2 and 3
    for target in (2, 3):
        assert sorted(c.cache.snapshot(target)["side_expert"][:2].tolist()) == [6, 7]
    assert c.cache.snapshot(1)["side_expert"][:2].tolist() == [-1, -1]  # not evaluated


def test_prediction_is_the_top_budget_experts_and_prefill_is_skipped(qwen_store):
    c = predictor(qwen_store, sync=True)
    assert c.router(1, 64).top(np.zeros(64, np.float32), c.budget).tolist() == [7, 6]
    assert c.prefetch_token(0, mx.zeros((1, 5, 64))) is None  # prefill: 5 tokens
    token = c.prefetch_token(1, mx.zeros((1, 1, 64)))
    mx.eval(token)
    s = c.cache.snapshot(2)
    assert sorted(s["side_expert"][:2].tolist()) == [6, 7]


def test_router_ranks_experts_highest_first_ties_by_id_nan_last():
    # weights exact in bfloat16, so the ranking is exact
    weight = np.array([[1, 0], [0, 1], [1, 1], [0.5, 0.5], [-1, 0]], np.float32)
    bias = np.array([0, 0, 0, 1, np.nan], np.float32)
    r = Router(weight, bias)
    assert (r.num_experts, r.hidden) == (5, 2)
    assert r.top(np.array([2, 1], np.float32), 5).tolist() == [2, 3, 0, 1, 4]  # 3 2.5 2 1 nan
    assert r.top(np.array([1, 1], np.float32), 3).tolist() == [2, 3, 0]  # 2 = 2 > 1 = 1
    with pytest.raises(ValueError, match="budget 6 not in"):
        r.top(np.zeros(2, np.float32), 6)
    with pytest.raises(ValueError, match="x has 3 values, hidden is 2"):
        r.top(np.zeros(3, np.float32), 1)
    with pytest.raises(ValueError, match="weight has 5 rows, bias 4 values"):
        Router(weight, bias[:4])


@pytest.mark.parametrize("hidden", [16, 37, 300])
def test_router_ranking_equals_numpy_over_whole_and_partial_lanes(hidden):
    # integer weights and inputs: every sum is exact, so the order must be numpy's
    rng = np.random.default_rng(hidden)
    weight = rng.integers(-8, 9, (24, hidden)).astype(np.float32)
    bias = rng.integers(-50, 51, 24).astype(np.float32)
    x = rng.integers(-4, 5, hidden).astype(np.float32)
    logits = weight @ x + bias
    want = sorted(range(24), key=lambda e: (-logits[e], e))
    assert Router(weight, bias).top(x, 24).tolist() == want


@given(
    rows=st.integers(1, 9),
    hidden=st.sampled_from([8, 37, 64]),
    budget=st.integers(1, 12),
    seed=st.integers(0, 2**16),
)
def test_a_ranking_of_rows_merges_each_rows_own_rank_by_rank(rows, hidden, budget, seed):
    # Rows go through the router four at a time; each row's ranking must be the one it
    # has alone (float weights and inputs: near-ties too), merged best ranks first.
    rng = np.random.default_rng(seed)
    r = Router(rng.standard_normal((12, hidden)).astype(np.float32), np.zeros(12, np.float32))
    x = rng.standard_normal((rows, hidden)).astype(np.float32)
    alone = [r.top(row, budget).tolist() for row in x]
    want = []
    for k in range(budget):
        for ranking in alone:
            if ranking[k] not in want:
                want.append(ranking[k])
    assert r.top(x, budget).tolist() == want
    with pytest.raises(ValueError, match="rows 0 < 1"):
        r.top(np.zeros((0, hidden), np.float32), budget)


@pytest.mark.parametrize("kind", ["linear", "bfloat16", "quantized", "gate", "extras"])
def test_dense_router_copies_the_routers_weight_and_bias_exactly(kind, monkeypatch):
    mx.random.seed(3)
    hidden, experts = 96, 12
    if kind in ("gate", "extras"):  # DeepSeek-style x @ weight.T, no bias; LongCat's extras
        w = mx.random.normal((experts + 3 if kind == "extras" else experts, hidden))
        want_w, want_b = w[:experts], mx.zeros((experts,))
        logits = lambda x: (x @ w.T)[..., :experts]  # noqa: E731
    else:
        linear = nn.Linear(hidden, experts, bias=True)
        linear.bias = 4 + linear.bias  # far from 0: no weight + bias - bias rounding
        if kind == "bfloat16":
            linear.set_dtype(mx.bfloat16)
        if kind == "quantized":
            linear.set_dtype(mx.bfloat16)
            linear = nn.QuantizedLinear.from_linear(linear, group_size=32, bits=4)
            f32 = linear.scales.astype(mx.float32), linear.biases.astype(mx.float32)
            want_w = mx.dequantize(linear.weight, *f32, 32, 4)
        else:
            want_w = linear.weight
        logits, want_b = linear, linear.bias
    rows = []  # the router is applied to num_experts rows at most, never to hidden
    made = {}
    monkeypatch.setattr(predictor_mod, "Router", lambda w, b: made.update(w=w, b=b))
    predictor_mod.dense_router(lambda x: rows.append(x.shape[0]) or logits(x), hidden)
    np.testing.assert_array_equal(made["w"], np.asarray(want_w.astype(mx.float32)))
    np.testing.assert_array_equal(made["b"], np.asarray(want_b.astype(mx.float32)))
    assert made["w"].flags.c_contiguous and made["w"].dtype == np.float32
    assert made["w"].shape == (experts, hidden) and max(rows) <= experts


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
def test_prefetch_op_reads_the_last_token_of_any_float_hidden_state(qwen_store, dtype):
    config = StreamConfig(expert_slots=2, side_slots=2, prefetch=True, sync=True)
    cache = open_cache(qwen_store, config)
    weight = np.zeros((8, 4), np.float32)
    weight[3, 0] = weight[5, 1] = weight[1, 2] = weight[2, 3] = 1  # expert e follows x[d]
    router = Router(weight, np.zeros(8, np.float32))
    base = mx.array([[0, -1, 0, -1, 9, -1, 9, -1], [1, -1, 1, -1, 0, -1, 0, -1]], dtype)
    x = base[:, ::2]  # a strided view; two tokens, the first would pick 1 and 2
    mx.eval(cache.prefetch_op(1, x, router, 2))
    assert sorted(e for e in cache.snapshot(1)["side_expert"].tolist() if e >= 0) == [3, 5]
    with pytest.raises(ValueError, match="MoE layer 1: hidden state of dtype int32, expected"):
        cache.prefetch_op(1, mx.zeros((1, 4), mx.int32), router, 2)
    with pytest.raises(ValueError, match=r"shape \(\.\.\., 6\) for a router of hidden size 4"):
        cache.prefetch_op(1, mx.zeros((1, 6)), router, 2)
    with pytest.raises(IndexError, match="MoE layer 4 out of range"):
        cache.prefetch_op(4, mx.zeros((1, 4)), router, 2)
    with pytest.raises(ValueError, match="a router of 9 experts for a cache of 8"):
        cache.prefetch_op(
            1, mx.zeros((1, 4)), Router(np.zeros((9, 4), np.float32), np.zeros(9, np.float32)), 2
        )
    with pytest.raises(ValueError, match="budget 9 not in"):
        cache.prefetch_op(1, mx.zeros((1, 4)), router, 9)


def test_a_decode_step_of_several_replies_prefetches_for_every_row(qwen_store):
    config = StreamConfig(expert_slots=2, side_slots=4, prefetch=True, sync=True)
    cache = open_cache(qwen_store, config)
    weight = np.zeros((8, 4), np.float32)
    weight[3, 0] = weight[5, 1] = weight[1, 2] = weight[2, 3] = 1  # expert e follows x[d]
    router = Router(weight, np.zeros(8, np.float32))
    # Three replies' rows of a step, (3, 1, hidden) as a batch's decode step has them: the
    # last two are predicted (rows=2), the first never.
    x = mx.array([[[0, 0, 0, 7]], [[0, 0, 9, 8]], [[1, 2, 0, 0]]], mx.float32)
    mx.eval(cache.prefetch_op(1, x, router, 1, rows=2))
    # Each row's best: 1 for the second reply, 5 for the third (2, the first's, is not).
    assert sorted(e for e in cache.snapshot(1)["side_expert"].tolist() if e >= 0) == [1, 5]
    # Rank by rank: both rows' best, then both rows' second (2, then 3).
    assert router.top(np.asarray(x[1:, 0]), 2).tolist() == [1, 5, 2, 3]
    assert router.top(np.asarray(x[1:, 0]), 1).tolist() == [1, 5]
    with pytest.raises(ValueError, match="MoE layer 1: rows 0 < 1"):
        cache.prefetch_op(1, x, router, 1, rows=0)
    with pytest.raises(ValueError, match="x must be"):
        router.top(np.zeros((1, 1, 4), np.float32), 1)
