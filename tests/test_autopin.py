"""Autopin pins the most frequent experts within its budget, saves them beside the
store's data, and pre-loads them at the next start; a pin that costs hits is dropped and
taken off the budget."""

import json

import mlx.core as mx
import numpy as np

from engine import autopin
from engine.cache import SLOT_PINNED
from engine.config import StreamConfig
from engine.model import load


def test_autopin_pins_top_experts_and_restores_them(model_dirs):
    cfg = StreamConfig(expert_slots=4, autopin_frac=0.5)
    sm = load(model_dirs("qwen3_moe"), cfg)
    sm.model(mx.array([[5, 9, 13, 2, 77, 31, 4, 8]]))
    freq = sm.snapshot().freq
    pins = autopin.repin(sm.cache, sm.autopin_budget())
    autopin.save(sm.store.path / autopin.PIN_FILE, pins, sm.store.manifest.num_experts)
    assert sm.autopin_budget() == 2
    for li, layer_pins in enumerate(pins):
        want = sorted(np.argsort(-freq[li], kind="stable")[:2].tolist())
        assert layer_pins == want
    snap = sm.snapshot()
    for li, layer_pins in enumerate(pins):
        pinned = sorted(snap.slot_expert[li][snap.slot_state[li] == SLOT_PINNED].tolist())
        assert pinned == layer_pins
    saved = json.loads((sm.store.path / autopin.PIN_FILE).read_text())
    assert saved["pins"] == pins

    again = load(model_dirs("qwen3_moe"), cfg)  # a new start pre-loads the pin set
    snap = again.snapshot()
    for li, layer_pins in enumerate(pins):
        pinned = sorted(snap.slot_expert[li][snap.slot_state[li] == SLOT_PINNED].tolist())
        assert pinned == layer_pins
    assert again.cache.check() == ""
    (sm.store.path / autopin.PIN_FILE).unlink()


def test_restore_ignores_a_pin_file_of_another_model(model_dirs):
    sm = load(model_dirs("qwen3_moe"), StreamConfig(expert_slots=4))
    path = sm.store.path / autopin.PIN_FILE
    path.write_text(json.dumps({"num_experts": 64, "pins": [[60]] * 4}))
    try:
        assert autopin.load(path, sm.store.manifest.num_experts, sm.cache.num_layers, 2) == []
    finally:
        path.unlink()


def test_budget_leaves_room_for_one_token():
    assert autopin.budget(expert_slots=8, top_k=2, frac=0.5) == 4
    assert autopin.budget(expert_slots=4, top_k=2, frac=0.9) == 2  # not 3: top_k must fit
    assert autopin.budget(expert_slots=2, top_k=2, frac=0.5) == 0
    assert autopin.budget(expert_slots=16, top_k=1, frac=0.0) == 0


def test_generate_updates_the_pin_file_the_next_load_restores():
    from engine.generate import generate

    cfg = StreamConfig(expert_slots=8, autopin_frac=0.5)
    sm = load(None, cfg)  # the embedded model (generate needs its tokenizer)
    path = sm.store.path / autopin.PIN_FILE
    try:
        generate(sm, [5, 9, 13, 2], max_tokens=4)
        saved = json.loads(path.read_text())["pins"]
        assert all(len(layer) == sm.autopin_budget() == 4 for layer in saved)
        snap = load(None, cfg).snapshot()
        for li, layer_pins in enumerate(saved):
            pinned = sorted(snap.slot_expert[li][snap.slot_state[li] == SLOT_PINNED].tolist())
            assert pinned == layer_pins
    finally:
        path.unlink(missing_ok=True)


def test_pin_and_unpin_refuse_expert_ids_out_of_range(qwen_store):
    """unpin once wrote past the end of the pinned flags for an id >= num_experts."""
    import pytest

    from engine.cache import open_cache

    cache = open_cache(qwen_store, StreamConfig(expert_slots=4))
    for bad in (-1, cache.num_experts, 10**6):
        with pytest.raises(IndexError, match="out of range"):
            cache.unpin(0, bad)
        with pytest.raises(IndexError, match="out of range"):
            cache.pin(0, bad)
    assert cache.check() == ""


def _acquire_all(cache, layer, sequence):
    for e in sequence:
        cache.acquire(layer, np.array([e], np.int32))


def test_a_pin_that_costs_hits_is_dropped_and_one_that_saves_hits_is_kept(qwen_store):
    from engine.cache import open_cache

    # Experts 1 and 2 alternate: with 0 pinned they share one slot and always miss,
    # without the pin both stay: the pin costs hits and goes.
    cache = open_cache(qwen_store, StreamConfig(expert_slots=2, policy="lru"))
    cache.pin(0, 0)
    _acquire_all(cache, 0, [1, 2] * 5)
    snap = cache.snapshot(0)
    assert snap["stats"]["pins_dropped"] == 1 and SLOT_PINNED not in snap["slot_state"]
    assert sorted(snap["slot_expert"].tolist()) == [1, 2]
    assert cache.check() == ""
    # 0, 1, 2 in a cycle: LRU alone misses every time; with 0 pinned, 0 always hits.
    cache = open_cache(qwen_store, StreamConfig(expert_slots=2, policy="lru"))
    cache.pin(0, 0)
    _acquire_all(cache, 0, [0, 1, 2] * 5)
    snap = cache.snapshot(0)
    assert snap["stats"]["pins_dropped"] == 0 and snap["stats"]["hits"] == 5
    assert cache.check() == ""


def _recorded_trace(model_dirs):
    from bench.common import timed_generate
    from engine.trace import record

    sm = load(model_dirs("qwen3_moe"), StreamConfig())
    with record(sm) as rec:
        for prompt in ([5, 9, 13, 2, 77, 31, 4, 8], [7, 8, 1]):
            rec.begin_segment()
            timed_generate(sm.model, prompt, 48)
        return rec.trace("recorded")


def test_autopin_never_costs_more_than_its_dropped_pins(model_dirs, tmp_path):
    """On the recorded trace and the head of every shared HD-MoE trace, with the engine's
    autopin (re-pinning at every generate call), the hit count is at least the policy's
    alone less twice the pins the cache dropped (each costs about one hit before it goes,
    and the runs diverge a little after)."""
    from bench import routing_traces_dir
    from bench.policy import replay, trace_store
    from engine.trace import load_trace

    traces = [_recorded_trace(model_dirs)]
    shared = routing_traces_dir()
    if shared is not None:
        traces += [load_trace(f).head(400) for f in sorted(shared.glob("experts_*.json"))]
    for trace in traces:
        store = trace_store(trace, tmp_path)
        for base in ("lfu", "predictive"):
            alone = replay(store, trace, 4, base)
            pinned = replay(store, trace, 4, base + "+autopin")
            dropped = pinned["pins_dropped"]
            assert pinned["hits"] >= alone["hits"] - 2 * dropped, (trace.name, base)
