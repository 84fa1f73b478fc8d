"""The side region's rules, one scenario each, on the native cache.

Each test states one rule of the side region's ledgers or modes.
"""

import time

import numpy as np
import pytest

from engine.cache import (
    NO_ROW,
    ROW_FREE,
    ROW_IN_FLIGHT,
    ROW_PUBLISHED,
    open_cache,
    pool_bytes,
    snapshot,
)
from engine.config import StreamConfig
from engine.memory_plan import plan_memory
from engine.predictor import prefetch_targets


def ids(*experts):
    return np.array(experts, dtype=np.int32)


def side(cache, layer=0):
    """{expert: state} of the persistent LFU side region's rows (both banks' 2 x
    side_slots rows), and the count of free rows."""
    s = cache.snapshot(layer)
    experts, states = s["side_expert"], s["side_state"]
    assert len(experts) == 2 * cache.side_slots
    owned = {int(e): int(st) for e, st in zip(experts, states, strict=True) if st != ROW_FREE}
    return owned, int((states == ROW_FREE).sum())


def acquire(cache, layer, *experts):
    rows, missing = cache.acquire(layer, ids(*experts).reshape(-1, 1))
    assert missing == []
    return rows.reshape(-1).tolist()


def test_repredicting_an_in_flight_expert_takes_no_second_row(qwen_store):
    """A re-predicted expert whose fill is in flight keeps its one row; no row leaks."""
    cache = open_cache(qwen_store, StreamConfig(expert_slots=2, side_slots=3))
    cache.inject_fault(0, "delay", expert=5, count=1, delay_ms=300)
    cache.prefetch(0, ids(5))
    cache.prefetch(0, ids(5, 5))
    owned, free = side(cache)
    assert owned == {5: ROW_IN_FLIGHT} and free == 5
    assert cache.inflight == 1
    cache.drain()  # waits for the fill if it started, else cancels it
    owned, free = side(cache)
    s = cache.snapshot(0)["stats"]
    assert s["prefetch_issued"] == 1
    if s["prefetch_cancelled"]:
        assert owned == {} and free == 6
    else:
        assert owned == {5: ROW_PUBLISHED} and free == 5
    assert cache.check() == "" and cache.inflight == 0


def test_a_row_read_by_the_current_forward_is_not_reused(qwen_store):
    """A fill never overwrites a row that this forward's gather still reads."""
    cache = open_cache(qwen_store, StreamConfig(expert_slots=1, side_slots=1, sync=True))
    cache.prefetch(0, ids(3, 5))  # LFU: one region of both banks' 2 rows
    rows = acquire(cache, 0, 3, 5)  # side hits, read by the current forward
    assert rows == [cache.expert_slots + 0, cache.expert_slots + 1]
    cache.prefetch(0, ids(4))  # ledger full, both rows fenced
    assert side(cache)[0] == {3: ROW_PUBLISHED, 5: ROW_PUBLISHED}
    acquire(cache, 1, 0)
    acquire(cache, 0, 0)  # layer index wrapped: a new forward, the old one evaluated
    cache.prefetch(0, ids(4))  # 3 and 5 predicted once each: the tie goes to 3
    assert side(cache)[0] == {4: ROW_PUBLISHED, 5: ROW_PUBLISHED}
    assert cache.check() == ""


def test_each_store_has_its_own_state(qwen_store):
    """Two caches keep their own state: nothing lives in process globals keyed by layer."""
    a = open_cache(qwen_store, StreamConfig(expert_slots=2, side_slots=2, sync=True))
    b = open_cache(qwen_store, StreamConfig(expert_slots=2, side_slots=2, sync=True))
    a.prefetch(0, ids(6))
    acquire(a, 0, 1)
    assert side(a)[0] == {6: ROW_PUBLISHED} and side(b)[0] == {}
    assert (b.snapshot(0)["slot_expert"] == -1).all()


def test_lfu_reuses_the_least_frequently_predicted_row(qwen_store):
    cache = open_cache(qwen_store, StreamConfig(expert_slots=1, side_slots=1, sync=True))
    cache.prefetch(0, ids(2, 5))
    cache.prefetch(0, ids(5))  # 5 predicted again: frequency 2, 2 stays at 1
    cache.prefetch(0, ids(7))
    assert side(cache)[0] == {5: ROW_PUBLISHED, 7: ROW_PUBLISHED}
    cache.prefetch(0, ids(1, 7))  # 7 is wanted now, so 5 (not 7) goes despite its frequency
    assert side(cache)[0] == {1: ROW_PUBLISHED, 7: ROW_PUBLISHED}
    cache.prefetch(0, ids(3))  # tie between 1 and 7 (both 1, 7 re-predicted -> 2): 1 goes
    assert side(cache)[0] == {3: ROW_PUBLISHED, 7: ROW_PUBLISHED}


def test_resident_experts_are_not_prefetched(qwen_store):
    cache = open_cache(qwen_store, StreamConfig(expert_slots=2, side_slots=2, sync=True))
    acquire(cache, 0, 4)
    cache.prefetch(0, ids(4, 6))
    assert side(cache)[0] == {6: ROW_PUBLISHED}


def bank_rows(cache, layer, bank):
    s = cache.snapshot(layer)
    spec = cache.side_slots
    part = slice(bank * spec, (bank + 1) * spec)
    return {
        int(e): int(st)
        for e, st in zip(s["side_expert"][part], s["side_state"][part], strict=True)
        if st != ROW_FREE
    }


def test_legacy_mode_reads_the_bank_filled_by_the_previous_forward(qwen_store):
    cache = open_cache(
        qwen_store, StreamConfig(expert_slots=2, side_slots=2, sync=True, side_lfu=False)
    )
    # Forward 0 fills bank 0 and reads bank 1.
    acquire(cache, 0, 0)
    cache.prefetch(1, ids(6))
    assert bank_rows(cache, 1, 0) == {6: ROW_PUBLISHED}
    assert acquire(cache, 1, 6) == [0]  # not readable by the forward that filled it
    acquire(cache, 1, 1)  # the second slot was free
    acquire(cache, 1, 2)  # evicts 6: LFU tie with 1, 6 was used less recently
    assert sorted(cache.snapshot(1)["slot_expert"].tolist()) == [1, 2]
    # Forward 1 reads bank 0 and fills bank 1.
    acquire(cache, 0, 0)
    assert acquire(cache, 1, 6) == [cache.expert_slots + 0]  # side hit: bank 0, row 0
    assert cache.snapshot(1)["stats"]["side_hits"] == 1
    # Forward 2 fills bank 0 again: rows outside the new prediction are released.
    acquire(cache, 0, 0)
    cache.prefetch(1, ids(3))
    assert bank_rows(cache, 1, 0) == {3: ROW_PUBLISHED}
    assert cache.check() == ""


def test_mode_switch_applies_at_the_forward_boundary(qwen_store):
    cache = open_cache(qwen_store, StreamConfig(expert_slots=1, side_slots=2, sync=True))
    cache.prefetch(0, ids(6))
    cache.side_lfu = False
    assert side(cache)[0] == {6: ROW_PUBLISHED}  # nothing changes mid-forward
    acquire(cache, 0, 0)
    acquire(cache, 0, 0)  # boundary: the switch drains and clears the side region
    assert side(cache)[0] == {} and cache.check() == ""


def test_drain_cancels_queued_fills_and_waits_for_started_ones(qwen_store):
    cache = open_cache(qwen_store, StreamConfig(expert_slots=1, side_slots=4, reader_threads=1))
    cache.inject_fault(0, "delay", expert=-1, count=1, delay_ms=200)
    cache.prefetch(0, ids(2, 3, 4, 5))
    time.sleep(0.05)  # the first fill has started and sleeps; three are queued
    cache.drain()
    assert cache.inflight == 0
    owned, free = side(cache)
    stats = cache.snapshot(0)["stats"]
    assert len(owned) + stats["prefetch_cancelled"] == 4
    assert stats["prefetch_cancelled"] >= 1
    assert all(st == ROW_PUBLISHED for st in owned.values())
    assert cache.check() == ""


def test_a_side_hit_is_promoted_into_the_real_region_without_a_read(qwen_store):
    """Issue 12: an expert served from a side row is copied into a real slot, so its next
    use is a real hit even once the side region has moved on; none is promoted when no
    slot is free of the call's experts."""
    from rowcheck import RowChecker

    cache = open_cache(qwen_store, StreamConfig(expert_slots=2, side_slots=2, sync=True))
    checker = RowChecker(qwen_store, cache)
    acquire(cache, 0, 1)
    cache.prefetch(0, ids(3))
    read = cache.snapshot(0)["stats"]["bytes_read"]
    assert acquire(cache, 0, 3) == [cache.expert_slots + 0]  # served from the side row
    s = cache.snapshot(0)
    slot = int(np.flatnonzero(s["slot_expert"] == 3)[0])
    checker.assert_row(0, slot, 3)
    assert s["stats"]["promotions"] == 1 and s["stats"]["bytes_read"] == read
    acquire(cache, 1, 0)  # next forward
    assert acquire(cache, 0, 3) == [slot]
    # One slot, held by the call's other expert: nowhere to promote to.
    cache = open_cache(qwen_store, StreamConfig(expert_slots=1, side_slots=2, sync=True))
    acquire(cache, 0, 1)
    cache.prefetch(0, ids(3))
    rows, missing = cache.acquire(0, ids(1, 3).reshape(1, 2))
    s = cache.snapshot(0)
    assert missing == [] and s["stats"]["promotions_declined"] == 1
    assert s["slot_expert"].tolist() == [1]


def test_a_miss_whose_fill_is_being_read_waits_for_it(qwen_store):
    """Issue 11: a miss on an expert whose prefetch fill a reader has started is not read a
    second time; the call waits for the fill and maps its side row (prefetch_late)."""
    from rowcheck import RowChecker

    cache = open_cache(qwen_store, StreamConfig(expert_slots=2, side_slots=2))
    checker = RowChecker(qwen_store, cache)
    cache.inject_fault(0, "delay", expert=5, count=1, delay_ms=300)
    cache.prefetch(0, ids(5))
    time.sleep(0.05)  # the fill has started and sleeps in its read
    assert side(cache)[0] == {5: ROW_IN_FLIGHT}
    rows = acquire(cache, 0, 5)
    s = cache.snapshot(0)["stats"]
    assert rows == [cache.expert_slots + 0]
    checker.assert_row(0, rows[0], 5)
    assert (s["misses"], s["side_hits"], s["prefetch_late"], s["loads"]) == (0, 1, 1, 1)
    assert s["bytes_read"] == qwen_store.manifest.layers[0].stride
    assert cache.check() == ""


def test_lfu_keeps_both_banks_rows_and_the_double_buffer_fills_one_bank(qwen_store):
    cache = open_cache(qwen_store, StreamConfig(expert_slots=1, side_slots=2, sync=True))
    cache.prefetch(0, ids(1, 2, 3, 4, 5))  # LFU: one region of 2 x 2 rows, 5 does not fit
    assert side(cache) == ({e: ROW_PUBLISHED for e in (1, 2, 3, 4)}, 0)
    cache.side_lfu = False
    acquire(cache, 0, 0)
    acquire(cache, 0, 0)  # boundary: the double buffer, its banks empty
    cache.prefetch(0, ids(1, 2, 3))  # the bank this forward fills has 2 rows
    banks = [bank_rows(cache, 0, b) for b in (0, 1)]
    assert sorted(banks, key=len) == [{}, {1: ROW_PUBLISHED, 2: ROW_PUBLISHED}]
    cache.side_lfu = True
    acquire(cache, 0, 0)  # boundary: LFU again, over both banks' rows
    cache.prefetch(0, ids(6, 7, 3, 4))
    assert side(cache) == ({e: ROW_PUBLISHED for e in (3, 4, 6, 7)}, 0)
    assert cache.check() == ""


def test_layers_no_layer_prefetches_for_hold_their_side_rows_as_slots(qwen_store):
    """The first MoE layer, and one whose router is not found, are no prefetch target:
    their 2 x side_slots rows are real slots instead, in the same memory."""
    m = qwen_store.manifest
    n, scratch = len(m.layers), m.top_k
    config = StreamConfig(expert_slots=2, side_slots=1, prefetch=True)
    targets = prefetch_targets([True, True, False] + [True] * (n - 3))
    assert targets == [False, True, False] + [True] * (n - 3)
    cache = open_cache(qwen_store, config, targets=targets)
    assert cache.layer_slots == [4, 2, 4] + [2] * (n - 3)
    assert cache.layer_side_slots == [0, 1, 0] + [1] * (n - 3)
    assert [cache.rows(li) for li in range(n)] == [4 + scratch] * n
    uniform = open_cache(qwen_store, config)  # every layer a target: the old layout
    assert uniform.layer_slots == [2] * n and uniform.layer_side_slots == [1] * n
    assert pool_bytes(cache) == pool_bytes(uniform)
    planned = plan_memory(qwen_store, config, targets=targets)
    assert planned.pool_bytes == plan_memory(qwen_store, config).pool_bytes
    assert planned.layer_slots == tuple(cache.layer_slots)
    assert planned.real_slots == (2,) * n  # as the config gives them

    # A layer without side rows prefetches nothing, and its snapshot pads them as NO_ROW.
    cache.prefetch(0, ids(5, 6))
    s = snapshot(cache)
    assert s.stats["prefetch_issued"][0] == 0 and cache.inflight == 0
    assert (s.side_state[0] == NO_ROW).all() and (s.side_expert[0] == -1).all()
    assert (s.side_state[1] == ROW_FREE).all()
    assert (s.slot_state[1:2, 2:] == NO_ROW).all() and (s.slot_state[0] != NO_ROW).all()
    # Layer 0 caches four experts with no eviction: the rows it took are real slots.
    assert sorted(acquire(cache, 0, 0, 1, 2, 3)) == [0, 1, 2, 3]
    assert acquire(cache, 0, 0, 1, 2, 3) == acquire(cache, 0, 0, 1, 2, 3)
    assert cache.snapshot(0)["stats"]["evictions"] == 0 and cache.check() == ""

    # Never more real slots than experts: the rows beyond are not allocated.
    near_all = StreamConfig(expert_slots=m.num_experts - 1, side_slots=2, prefetch=True)
    capped = open_cache(qwen_store, near_all, targets=targets)
    assert capped.layer_slots[0] == m.num_experts and capped.rows(0) == m.num_experts + scratch
    assert capped.rows(1) == m.num_experts - 1 + 2 * 2 + scratch


def test_memory_figures_count_a_capped_layer_as_allocated(qwen_store, monkeypatch):
    """Layer 0 at 7 of 8 experts with 2 x 2 side rows holds 8 slots, not 11: the figures
    a user sees before and after the load (the plan's, which the pools' refusal
    and the advisor's budget read) are what the cache allocates, not 3 rows more."""
    from engine import memory_plan
    from engine.advisor import Budget

    m = qwen_store.manifest
    n = len(m.layers)
    config = StreamConfig(expert_slots=m.num_experts - 1, side_slots=2, prefetch=True)
    targets = prefetch_targets([True] * n)
    cache = open_cache(qwen_store, config, targets=targets)
    assert cache.layer_slots[0] == m.num_experts  # 7 + 2 x 2, capped
    record = m.layers[0].record_bytes
    plan = plan_memory(qwen_store, config, targets=targets)
    planned = plan.pool_bytes
    assert plan_memory(qwen_store, config).pool_bytes == planned + 3 * record  # all targets
    assert Budget.of(plan).pool_bytes == pool_bytes(cache)
    assert plan.total == planned + m.dense_bytes and plan.tier_bytes == 0  # no tier on CPU
    # Memory for exactly these pools and the dense weights is enough to open them.
    monkeypatch.setattr(memory_plan, "available_bytes", lambda: planned + m.dense_bytes)
    assert open_cache(qwen_store, config, targets=targets).layer_slots == cache.layer_slots


def test_side_rows_wider_than_side_slots_are_refused(qwen_store, monkeypatch):
    """Snapshots are padded to side_slots, and a prediction fills that many rows: the
    native cache refuses a layer given more, naming the bound."""
    from engine import memory_plan

    n = len(qwen_store.manifest.layers)
    wide = ([2] * n, [2] + [1] * (n - 1))
    monkeypatch.setattr(memory_plan, "held_rows", lambda *a, **k: wide)
    with pytest.raises(ValueError, match=r"side rows per layer must be in \[0, 1\], got 2"):
        open_cache(qwen_store, StreamConfig(expert_slots=2, side_slots=1))


def test_a_rate_of_nothing_is_none_and_counts_give_their_ratio(qwen_store):
    """`CacheSnapshot.totals()` reports no hit rate before any lookup and no prefetch
    accuracy before any prefetch (None, not 0.0); then the counters' ratios."""
    cache = open_cache(qwen_store, StreamConfig(expert_slots=2, side_slots=2, sync=True))
    t = snapshot(cache).totals()
    assert (t["hit_rate"], t["prefetch_accuracy"]) == (None, None)
    assert acquire(cache, 0, 1) == [0]  # a miss, loaded into slot 0
    assert acquire(cache, 0, 1) == [0]  # a hit
    t = snapshot(cache).totals()
    assert (t["hits"], t["misses"], t["hit_rate"]) == (1, 1, 0.5)
    assert t["prefetch_accuracy"] is None
