"""Ahead scheduling: targets, the cutoff, nothing past the last layer, one submission
per target per forward."""

import mlx.core as mx

from engine.cache import open_cache
from engine.config import StreamConfig
from engine.predictor import Predictor


class Router:
    """A router stand-in: fixed logits favouring experts 7, 6, 5, ..."""

    def __call__(self, x):
        return mx.broadcast_to(mx.arange(8, dtype=mx.float32), (x.shape[0], 8))


def predictor(store, **fields):
    config = StreamConfig(expert_slots=2, side_slots=2, prefetch=True, **fields)
    return Predictor(open_cache(store, config), [Router()] * 4, config)


def test_targets_follow_ahead_lo_then_ahead_hi(qwen_store):
    c = predictor(qwen_store, ahead_lo=1, ahead_hi=2, cutoff=2)
    assert [c.target_for(layer) for layer in range(4)] == [1, 2, None, None]
    c = predictor(qwen_store, ahead_lo=1, ahead_hi=1)  # cutoff defaults to half: 2
    assert c.cutoff == 2
    assert [c.target_for(layer) for layer in range(4)] == [1, 2, 3, None]


def test_one_submission_per_target_per_forward(qwen_store):
    c = predictor(qwen_store, ahead_lo=3, ahead_hi=1, cutoff=1)
    assert [c.target_for(layer) for layer in range(4)] == [3, 2, 3, None]
    x = mx.zeros((1, 1, 64))
    tokens = [c.prefetch_token(layer, x) for layer in range(4)]
    assert [t is not None for t in tokens] == [True, True, False, False]
    tokens = [c.prefetch_token(layer, x) for layer in range(4)]  # next forward
    assert [t is not None for t in tokens] == [True, True, False, False]


def test_prediction_is_the_top_budget_experts_and_prefill_is_skipped(qwen_store):
    c = predictor(qwen_store, sync=True)
    assert sorted(c.predict(1, mx.zeros((1, 3, 64))).tolist()) == [6, 7]
    assert c.prefetch_token(0, mx.zeros((1, 5, 64))) is None  # prefill: 5 tokens
    token = c.prefetch_token(1, mx.zeros((1, 1, 64)))
    mx.eval(token)
    s = c.cache.snapshot(2)
    assert sorted(s["side_expert"][:2].tolist()) == [6, 7]
