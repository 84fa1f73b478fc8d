"""The eviction policies of the real region, replayed through the native cache: the
predictive policy learns routing structure that recency and frequency cannot see, and
router hints when they carry information; policy names and hints are checked where they
enter."""

import numpy as np
import pytest

from bench.policy import belady, replay, trace_store
from engine.cache import open_cache
from engine.config import EVICTION_POLICIES, StreamConfig
from engine.trace import Trace, random_trace


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


def foreseeing_trace(tokens: int, num_experts: int = 8, seed: int = 1) -> Trace:
    """Uniform top-2 routing whose router scores rank, after the two chosen experts, the
    experts the next token will choose: a router hint that foresees the next token."""
    base = random_trace(tokens, 2, num_experts, 2, seed=seed)
    ids = base.ids
    router_ids = np.empty((tokens, 2, num_experts), np.int32)
    for t in range(tokens):
        for li in range(2):
            nxt = ids[min(t + 1, tokens - 1), li]
            first = list(dict.fromkeys([*ids[t, li], *nxt]))
            rest = [e for e in range(num_experts) if e not in first]
            router_ids[t, li] = first + rest
    probs = np.linspace(0.3, 0.01, num_experts, dtype=np.float32)
    probs = np.broadcast_to(probs / probs.sum(), router_ids.shape).copy()
    return Trace("foresee", ids, num_experts, router_ids=router_ids, router_probs=probs)


def test_router_hints_are_replayed_and_learned(tmp_path):
    trace = foreseeing_trace(3000)
    store = trace_store(trace, tmp_path)
    hinted = replay(store, trace, 4, "predictive")["hit_rate"]
    blind = replay(store, trace, 4, "predictive-ids")["hit_rate"]
    lru = replay(store, trace, 4, "lru")["hit_rate"]
    print(f"hinted {hinted:.3f} ids only {blind:.3f} lru {lru:.3f}")
    assert abs(blind - lru) < 0.03  # uniform routing: nothing to learn from the ids
    assert hinted > blind + 0.07


def test_bad_router_hints_are_refused(qwen_store):
    cache = open_cache(qwen_store, StreamConfig(expert_slots=3))
    with pytest.raises(ValueError, match="router hint of MoE layer 1 has 5 values"):
        cache.hint(1, np.full(5, 0.2, np.float32))
    with pytest.raises(ValueError, match="probability of expert 3 is nan"):
        probs = np.full(cache.num_experts, 0.1, np.float32)
        probs[3] = np.nan
        cache.hint(1, probs)


def test_a_replay_store_of_an_older_format_is_made_again(tmp_path):
    """The replay's synthetic store is cached across runs (and upgrades): one an older
    build wrote (manifest version 1) is replaced, not refused for its version."""
    import json

    from engine.store import VERSION, store_version

    trace = markov_trace(50, 2, 8)
    path = trace_store(trace, tmp_path).path
    manifest = json.loads((path / "manifest.json").read_text())
    (path / "manifest.json").write_text(json.dumps(manifest | {"version": 1}))
    assert store_version(path) == 1
    store = trace_store(trace, tmp_path)
    assert store.path == path and store_version(path) == VERSION == 2
    assert replay(store, trace, 3, "lru")["hit_rate"] > 0
