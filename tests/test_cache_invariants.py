"""Invariants of the native cache under random operation sequences and concurrency.

After every step: each real region's slot<->expert maps agree, pinned experts are
resident, and per (layer, generation) free + in flight + published == side rows with no
row owned twice (ExpertCache.check()). Every row a caller is handed, and every published
side row, holds exactly its expert's record bytes from the blob.
"""

import random
import threading
import time

import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from engine.cache import ROW_PUBLISHED, open_cache
from engine.config import StreamConfig

NUM_EXPERTS = 8


class RowChecker:
    """Compares pool rows with the records of the store's blob files."""

    def __init__(self, store, cache):
        self.store, self.cache = store, cache
        self.specs = store.manifest.layers
        self.records = {
            (li, e): store.read_record(spec, e)
            for li, spec in enumerate(self.specs)
            for e in range(NUM_EXPERTS)
        }

    def row_bytes(self, li, row):
        pools = self.cache.pool(li)
        return b"".join(np.array(p[row]).tobytes() for p in pools)

    def assert_row(self, li, row, expert):
        want = self.records[(li, expert)]
        assert self.row_bytes(li, row) == want, f"layer {li} row {row} != expert {expert}"

    def assert_all_published(self):
        cap, spec = self.cache.cap, self.cache.spec
        snap = [self.cache.snapshot(li) for li in range(self.cache.num_layers)]
        for li, s in enumerate(snap):
            for slot, e in enumerate(s["slot_expert"]):
                if e >= 0:
                    self.assert_row(li, slot, int(e))
            for i, (e, state) in enumerate(zip(s["side_expert"], s["side_state"], strict=True)):
                if state == ROW_PUBLISHED:
                    self.assert_row(li, cap + i, int(e))
            assert i + 1 == 2 * spec if spec else True


def acquire_and_check(checker, cache, li, ids):
    """acquire, stream the over-capacity misses, and check every row handed out."""
    arr = np.array(ids, dtype=np.int32).reshape(-1, 1)
    rows, missing = cache.acquire(li, arr)
    rows = rows.reshape(-1)
    for e, r in zip(ids, rows, strict=True):
        if r >= 0:
            checker.assert_row(li, int(r), e)
        else:
            assert e in missing
    placed = {e: int(r) for e, r in zip(ids, rows, strict=True) if r >= 0}
    assert len(set(placed.values())) == len(placed), "two experts share a row"
    for start in range(0, len(missing), cache.scratch):
        chunk = missing[start : start + cache.scratch]
        for e, r in zip(chunk, cache.load_scratch(li, chunk), strict=True):
            checker.assert_row(li, r, e)


class CacheMachine(RuleBasedStateMachine):
    @initialize(
        cap=st.integers(1, NUM_EXPERTS),
        spec=st.integers(0, 4),
        side_lfu=st.booleans(),
        sync=st.booleans(),
        policy=st.sampled_from(["lfu", "lru"]),
    )
    def open(self, cap, spec, side_lfu, sync, policy):
        store = self.store
        self.cache = open_cache(
            store,
            StreamConfig(
                expert_slots=cap,
                spec_slots=spec,
                side_lfu=side_lfu,
                sync=sync,
                policy=policy,
                decay_every=3,
                prefill_chunk=2,
            ),
        )
        self.checker = RowChecker(store, self.cache)

    @rule(
        li=st.integers(0, 3), ids=st.lists(st.integers(0, NUM_EXPERTS - 1), min_size=1, max_size=6)
    )
    def acquire(self, li, ids):
        acquire_and_check(self.checker, self.cache, li, ids)

    @rule(
        li=st.integers(0, 3), ids=st.lists(st.integers(0, NUM_EXPERTS - 1), min_size=1, max_size=6)
    )
    def prefetch(self, li, ids):
        self.cache.prefetch(li, np.array(ids, dtype=np.int32))

    @rule()
    def drain(self):
        self.cache.drain()
        assert self.cache.inflight == 0
        self.checker.assert_all_published()

    @rule(on=st.booleans())
    def switch_side_mode(self, on):
        self.cache.side_lfu = on

    @rule(on=st.booleans())
    def switch_sync(self, on):
        self.cache.sync = on

    @rule()
    def reset(self):
        self.cache.reset()
        assert self.cache.inflight == 0

    @rule(li=st.integers(0, 3), e=st.integers(0, NUM_EXPERTS - 1))
    def pin(self, li, e):
        try:
            self.cache.pin(li, e)
        except ValueError as err:
            assert "no evictable slot" in str(err)
            return
        slot = int(np.flatnonzero(self.cache.snapshot(li)["slot_expert"] == e)[0])
        self.checker.assert_row(li, slot, e)

    @rule(li=st.integers(0, 3), e=st.integers(0, NUM_EXPERTS - 1))
    def unpin(self, li, e):
        self.cache.unpin(li, e)

    @invariant()
    def consistent(self):
        if hasattr(self, "cache"):
            assert self.cache.check() == ""

    def teardown(self):
        if hasattr(self, "cache"):
            self.cache.drain()
            assert self.cache.check() == ""
            self.checker.assert_all_published()


def test_cache_state_machine(qwen_store):
    from hypothesis.stateful import run_state_machine_as_test

    CacheMachine.store = qwen_store
    run_state_machine_as_test(
        CacheMachine,
        settings=settings(
            max_examples=60,
            stateful_step_count=40,
            deadline=None,
            suppress_health_check=list(HealthCheck),
        ),
    )


def test_concurrent_soak(qwen_store):
    """Async prefetch, re-predictions of in-flight experts, drains and resets on the
    generation thread while two threads poll snapshots; bounded at ~3 s."""
    cache = open_cache(
        qwen_store, StreamConfig(expert_slots=3, spec_slots=3, prefill_chunk=2, decay_every=5)
    )
    checker = RowChecker(qwen_store, cache)
    stop = threading.Event()
    violations, polls = [], [0]

    def poll():
        while not stop.is_set():
            msg = cache.check()
            if msg:
                violations.append(msg)
            for li in range(cache.num_layers):
                s = cache.snapshot(li)
                free = int((s["side_state"] == 0).sum())
                if free + int((s["side_state"] != 0).sum()) != 2 * cache.spec:
                    violations.append("side rows do not add up")
            polls[0] += 1

    pollers = [threading.Thread(target=poll) for _ in range(2)]
    for t in pollers:
        t.start()
    rng = random.Random(0)
    ops, deadline = 0, time.monotonic() + 3.0
    try:
        while time.monotonic() < deadline:
            li = rng.randrange(4)
            ids = [rng.randrange(NUM_EXPERTS) for _ in range(rng.randint(1, 4))]
            op = rng.random()
            if op < 0.45:
                acquire_and_check(checker, cache, li, ids)
            elif op < 0.9:
                cache.prefetch(li, np.array(ids * 2, dtype=np.int32))  # re-predictions
            elif op < 0.95:
                cache.side_lfu = rng.random() < 0.5
            elif op < 0.98:
                cache.drain()
            else:
                cache.reset()
            ops += 1
    finally:
        stop.set()
        for t in pollers:
            t.join()
    cache.drain()
    checker.assert_all_published()
    print(f"soak: {ops} operations, {polls[0]} polls, {len(violations)} violations")
    assert violations == []
    assert cache.check() == ""
    assert ops > 100 and polls[0] > 10
