"""The eviction policies of the real region, replayed through the native cache: the
predictive policy learns routing structure that recency and frequency cannot see, and a
policy name is checked where it enters."""

import numpy as np
import pytest

from engine.bench.policy import belady, replay, trace_store
from engine.config import EVICTION_POLICIES, StreamConfig
from engine.trace import Trace


def markov_trace(tokens: int, layers: int, num_experts: int, seed: int = 0) -> Trace:
    """Top-1 routing where each layer's expert for token t+1 is one of two fixed
    successors of its expert for token t (45% each), else uniform."""
    rng = np.random.default_rng(seed)
    succ = np.stack([rng.permutation(num_experts) for _ in range(2 * layers)]).reshape(
        layers, 2, num_experts
    )
    ids = np.empty((tokens, layers, 1), np.int32)
    cur = rng.integers(num_experts, size=layers)
    for t in range(tokens):
        for li in range(layers):
            u = rng.random()
            cur[li] = succ[li, int(u < 0.45), cur[li]] if u < 0.9 else rng.integers(num_experts)
        ids[t, :, 0] = cur
    return Trace("markov", ids, num_experts)


def test_predictive_learns_transitions(tmp_path):
    trace = markov_trace(3000, 2, 8)
    store = trace_store(trace, tmp_path)
    rates = {p: replay(store, trace, 3, p)["hit_rate"] for p in EVICTION_POLICIES}
    lru, best = rates["lru"], belady(trace, 3)["hit_rate"]
    print({p: round(r, 3) for p, r in rates.items()}, "MIN", round(best, 3))
    others = max(r for p, r in rates.items() if p != "predictive")
    assert rates["predictive"] > others + 0.03
    assert (rates["predictive"] - lru) / (best - lru) > 0.3


def test_policy_names_are_checked():
    with pytest.raises(ValueError, match="policy.*predictive, lfu, lru, lfu-da, s3-fifo"):
        StreamConfig(policy="arc")
    assert StreamConfig().policy == "predictive"
