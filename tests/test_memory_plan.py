"""The memory plan of a load: pools, layer scratch, host tier and dense weights sized
together, "auto" by one rule, checked once against the memory available."""

import dataclasses

import pytest

from engine import memory_plan
from engine.config import AUTO_MEMORY_FRACTION, PoolMemoryError, StreamConfig
from engine.flags import flag_names
from engine.memory_plan import auto_bytes, plan_memory, tier_slot_bytes
from engine.model import load
from engine.predictor import prefetch_targets


def test_auto_is_one_rule_with_the_physical_memory_where_none_is_known(monkeypatch):
    assert auto_bytes(10**12, 1000) == int(AUTO_MEMORY_FRACTION * 1000)
    assert auto_bytes(100, 1000) == 100  # never more than wanted
    assert auto_bytes(100, -5) == 0  # nothing left
    monkeypatch.setattr(memory_plan.os, "sysconf", lambda name: 1000)  # pages x page size
    assert auto_bytes(10**12, None) == int(AUTO_MEMORY_FRACTION * 1000 * 1000)


def test_the_plan_is_what_the_cache_allocates(qwen_store):
    """Real slots, side rows and scratch rows as the cache gets them; the pools' bytes
    with the tables and read buffers; the dense weights; no tier on the CPU."""
    m = qwen_store.manifest
    n = len(m.layers)
    config = StreamConfig(expert_slots=3, side_slots=1, prefetch=True, reader_threads=2)
    plan = plan_memory(qwen_store, config, targets=prefetch_targets([True] * n))
    assert plan.real_slots == (3,) * n
    # the first MoE layer, which no layer prefetches for, holds its side rows as slots
    assert plan.layer_slots == (5,) + (3,) * (n - 1)
    assert plan.side_rows == (0,) + (1,) * (n - 1) and plan.scratch_rows == m.top_k
    assert plan.pool_rows == [5 + m.top_k] * n
    assert plan.tier_slots == plan.tier_bytes == plan.layer_scratch_bytes == 0
    assert plan.dense_bytes == m.dense_bytes
    assert plan.total == plan.pool_bytes + m.dense_bytes
    sm = load(qwen_store.path, config)
    assert sm.plan == dataclasses.replace(plan, available=sm.plan.available)
    assert sm.cache.layer_slots == list(plan.layer_slots)
    assert [sm.cache.rows(li) for li in range(n)] == plan.pool_rows


def test_what_expert_memory_bought_is_worded_from_the_plan(qwen_store, monkeypatch):
    m = qwen_store.manifest
    records = sum(s.record_bytes for s in m.layers)
    monkeypatch.setattr(memory_plan, "available_bytes", lambda: 10**9)
    config = StreamConfig(expert_memory=records * 5, reader_threads=2, io_uring=False)
    plan = plan_memory(qwen_store, config)
    assert plan.real_slots == (5,) * len(m.layers) and plan.slots_text() == "5"
    words = plan.words(flag_names())
    assert words.startswith(f"--expert-memory {records * 5}: 5 slots per MoE layer, pools ")
    assert words.endswith("in all of the 1.0 GB available")
    assert "host tier" not in words


def test_a_default_that_does_not_fit_falls_back_to_auto_and_a_size_given_is_refused(
    qwen_store, monkeypatch
):
    config = StreamConfig(reader_threads=2, io_uring=False)  # every expert
    every = plan_memory(qwen_store, config)
    available = every.total - 1
    monkeypatch.setattr(memory_plan, "available_bytes", lambda: available)
    with pytest.raises(PoolMemoryError, match="of memory is available: every expert is cached"):
        plan_memory(qwen_store, config)
    plan = plan_memory(qwen_store, config, fit_default=True)
    assert plan.fell_back and plan.asked == dataclasses.replace(every, available=available)
    assert plan.config.expert_memory == "auto" and plan.config.expert_slots is None
    assert plan.total <= available
    assert sum(n * r for n, r in zip(plan.real_slots, plan.record_bytes, strict=True)) <= int(
        AUTO_MEMORY_FRACTION * available
    )


def test_real_regions_below_top_k_are_refused_only_for_a_front_end(qwen_store):
    config = StreamConfig(expert_slots=1)
    assert plan_memory(qwen_store, config).real_slots[0] == 1  # the over-capacity path's tests
    with pytest.raises(ValueError, match="expert_slots = 1: must be >= 2"):
        plan_memory(qwen_store, config, strict=True)


def test_the_acquire_staging_is_planned_where_the_device_acquire_runs(qwen_store, monkeypatch):
    """The acquire mailbox's page-locked staging (a slot per id of a request, twice a
    decode step's top_k x max_batch and at least 16, plus twice the prefetch budget of
    fills, at least 16) is counted with the pools, before the tier takes its share;
    none without the device acquire or off CUDA."""
    m = qwen_store.manifest
    slot = tier_slot_bytes(m.layers)
    base = StreamConfig(expert_slots=2, reader_threads=2, io_uring=False, host_memory=0)
    assert plan_memory(qwen_store, base).staging_bytes == 0  # the CPU: no mailbox
    monkeypatch.setattr(memory_plan, "cuda_pools", lambda: True)
    one = plan_memory(qwen_store, base)
    assert m.top_k == 2 and one.staging_bytes == (16 + 16) * slot
    assert f"acquire staging {memory_plan.human_bytes(32 * slot)}" in one.words()
    wide = plan_memory(qwen_store, base.replace(max_batch=8, side_slots=3, prefetch=True))
    assert wide.staging_bytes == (2 * 2 * 8 + 16) * slot
    assert wide.total - one.total == wide.pool_bytes - one.pool_bytes + 16 * slot
    off = plan_memory(qwen_store, base.replace(device_acquire=False))
    assert off.staging_bytes == 0


def test_the_host_tier_is_planned_with_the_pools_and_checked_together(qwen_store, monkeypatch):
    """Where the pools are CUDA memory (forced here: only the plan is made), the tier
    takes auto's share of what the pools, layer scratch and dense weights leave, and a
    tier given in bytes that the rest leaves no room for is refused in the one check,
    naming it."""
    m = qwen_store.manifest
    n = len(m.layers)
    monkeypatch.setattr(memory_plan, "cuda_pools", lambda: True)
    slot = tier_slot_bytes(m.layers)
    base = StreamConfig(expert_slots=2, reader_threads=2, io_uring=False, host_memory=0)
    rest = plan_memory(qwen_store, base)
    assert rest.tier_slots == 0 and rest.layer_scratch_bytes > 0 and rest.scratch_rows == 1
    available = rest.total + 2 * 3 * n * slot  # auto's half holds 3 slots per layer
    monkeypatch.setattr(memory_plan, "available_bytes", lambda: available)
    auto = plan_memory(qwen_store, base.replace(host_memory="auto"))
    assert (auto.tier_slots, auto.tier_bytes) == (3, 3 * n * slot)
    assert "host tier 3 slots per layer" in auto.words()
    off = plan_memory(qwen_store, base.replace(host_memory="auto", device_acquire=False))
    assert off.tier_slots == 0  # the tier is the mailbox's: none without the device acquire
    given = base.replace(host_memory=7 * n * slot)
    with pytest.raises(PoolMemoryError) as e:
        plan_memory(qwen_store, given)
    words = e.value.in_words(flag_names())
    assert f", the host tier {memory_plan.human_bytes(7 * n * slot)} (7 slots per layer)" in words
    assert words.endswith("(or lower --host-memory)"), words
