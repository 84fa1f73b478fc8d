"""Invariants of the native cache under random operation sequences and concurrency.

After every step: each real region's slot<->expert maps agree (no expert in two slots),
pinned experts are resident (and never evicted, unless the cache dropped the pin because
it cost hits), the eviction policy's counts are consistent (LFU
frequencies, lfu-da keys, s3-fifo queues, the predictive model's tables and totals), and
per side-region ledger (one over both banks in LFU mode, one per bank in the double
buffer) free + in flight + published == its rows with no
row owned twice (ExpertCache.check()). Every row a caller is handed, and every published
side row, holds exactly its expert's record bytes from the blob. Read faults are injected
too: a transient one (one bad read) must be invisible; a persistent one may fail a call,
with an error naming file, layer and expert, and with every invariant intact. The state
machine's layers may be no prefetch target (`engine.memory_plan.held_rows`): no side rows,
their rows real slots.
"""

import os
import random
import re
import threading
import time

import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from engine.cache import ROW_FREE, ExpertReadError, open_cache
from engine.config import EVICTION_POLICIES, StreamConfig

from rowcheck import RowChecker, acquire_and_check

NUM_EXPERTS = 8
FAULTS = ("eio", "short_read", "corrupt")


class CacheMachine(RuleBasedStateMachine):
    steps = 0  # rules run, over all examples
    read_errors = 0  # clean errors from persistent faults

    @initialize(
        cap=st.integers(1, NUM_EXPERTS),
        spec=st.integers(0, 4),
        side_lfu=st.booleans(),
        sync=st.booleans(),
        policy=st.sampled_from(EVICTION_POLICIES),
        io_uring=st.booleans(),
        # which layers prefetch fills (None: all); the others hold their side rows as slots
        prefetched=st.none() | st.lists(st.booleans(), min_size=4, max_size=4),
    )
    def open(self, cap, spec, side_lfu, sync, policy, io_uring, prefetched):
        store = self.store
        self.cache = open_cache(
            store,
            StreamConfig(
                expert_slots=cap,
                side_slots=spec,
                side_lfu=side_lfu,
                sync=sync,
                policy=policy,
                decay_every=3,
                scratch_slots=2,
                io_uring=io_uring,
            ),
            targets=prefetched,
        )
        self.checker = RowChecker(store, self.cache)
        self.hard = [False] * 4  # a fault that can fail a read is armed on the layer
        self.pinned = set()  # (layer, expert) pinned and not unpinned since: never evicted

    def read_failed(self, li, err):
        """A read error is clean only where a persistent fault is armed."""
        assert self.hard[li], f"a transient fault surfaced: {err}"
        CacheMachine.read_errors += 1
        assert re.search(r"layer\d+\.blob \(layer \d+, expert \d+\): ", str(err)), str(err)

    @rule(
        li=st.integers(0, 3), ids=st.lists(st.integers(0, NUM_EXPERTS - 1), min_size=1, max_size=6)
    )
    def acquire(self, li, ids):
        before = self.cache.snapshot(li)["stats"]["pins_dropped"]
        try:
            acquire_and_check(self.checker, self.cache, li, ids)
        except ExpertReadError as err:
            self.read_failed(li, err)
        snap = self.cache.snapshot(li)
        # A pin that cost hits is dropped by the cache (then it may be evicted): exactly
        # as many of ours stopped being pinned as the cache says it dropped.
        gone = {
            (layer, e)
            for layer, e in self.pinned
            if layer == li and snap["slot_state"][snap["slot_expert"] == e].tolist() != [2]
        }
        assert len(gone) == snap["stats"]["pins_dropped"] - before
        self.pinned -= gone

    @rule(
        li=st.integers(0, 3),
        kind=st.sampled_from(FAULTS),
        expert=st.integers(-1, NUM_EXPERTS - 1),
        count=st.sampled_from([1, 1, 2, 50]),
    )
    def inject_fault(self, li, kind, expert, count):
        """count 1: retried or re-read, invisible; 2 and more: fails a read (or a fill)."""
        self.cache.inject_fault(li, kind, expert=expert, count=count)
        self.hard[li] = count >= 2

    @rule(li=st.integers(0, 3))
    def fault_gone(self, li):
        self.cache.inject_fault(li, "none", count=0)
        self.hard[li] = False

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
        self.pinned.clear()

    @rule(li=st.integers(0, 3), e=st.integers(0, NUM_EXPERTS - 1))
    def pin(self, li, e):
        try:
            self.cache.pin(li, e)
        except ExpertReadError as err:
            self.read_failed(li, err)
            return
        except ValueError as err:
            assert "no evictable slot" in str(err)
            return
        slot = int(np.flatnonzero(self.cache.snapshot(li)["slot_expert"] == e)[0])
        self.checker.assert_row(li, slot, e)
        self.pinned.add((li, e))

    @rule(li=st.integers(0, 3), e=st.integers(0, NUM_EXPERTS - 1))
    def unpin(self, li, e):
        self.cache.unpin(li, e)
        self.pinned.discard((li, e))

    @rule(policy=st.sampled_from(EVICTION_POLICIES))
    def switch_policy(self, policy):
        self.cache.set_policy(policy)

    @rule(
        li=st.integers(0, 3),
        weights=st.lists(st.floats(0, 1), min_size=NUM_EXPERTS, max_size=NUM_EXPERTS),
    )
    def hint(self, li, weights):
        probs = np.asarray(weights, np.float32) / max(sum(weights), 1e-6)
        self.cache.hint(li, np.clip(probs, 0, 1).astype(np.float32))

    @invariant()
    def consistent(self):
        CacheMachine.steps += 1
        if hasattr(self, "cache"):
            assert self.cache.check() == ""
            for li in range(self.cache.num_layers):
                slots = self.cache.snapshot(li)["slot_expert"]
                held = slots[slots >= 0]
                assert len(set(held.tolist())) == len(held), f"an expert in two slots: {slots}"
                states = self.cache.snapshot(li)["slot_state"]
                for e in (e for layer, e in self.pinned if layer == li):
                    assert states[slots == e].tolist() == [2], f"pinned expert {e} evicted"

    def teardown(self):
        if hasattr(self, "cache"):
            self.cache.drain()
            assert self.cache.check() == ""
            self.checker.assert_all_published()


def test_cache_state_machine(qwen_store):
    from hypothesis.stateful import run_state_machine_as_test

    CacheMachine.store = qwen_store
    CacheMachine.steps = CacheMachine.read_errors = 0
    run_state_machine_as_test(
        CacheMachine,
        settings=settings(
            # `make soak` runs it longer (scripts/soak.sh)
            max_examples=int(os.environ.get("ES_STATE_MACHINE_EXAMPLES", "60")),
            stateful_step_count=40,
            deadline=None,
            suppress_health_check=list(HealthCheck),
        ),
    )
    print(
        f"state machine: {CacheMachine.steps} steps checked, "
        f"{CacheMachine.read_errors} clean read errors, 0 violations"
    )


def test_concurrent_soak(qwen_store, io_uring):
    """Async prefetch, re-predictions of in-flight experts, transient read faults (which
    must stay invisible), drains and resets on the generation thread while two threads
    poll snapshots; bounded at ~3 s."""
    cache = open_cache(
        qwen_store,
        StreamConfig(
            expert_slots=3, side_slots=3, scratch_slots=2, decay_every=5, io_uring=io_uring
        ),
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
                if free + int((s["side_state"] != ROW_FREE).sum()) != 2 * cache.side_slots:
                    violations.append("side rows do not add up")
            polls[0] += 1
            # A pause without the GIL: two pollers that only wait for it between calls
            # starve the thread under test of it on a two-core machine.
            stop.wait(0.0005)

    pollers = [threading.Thread(target=poll) for _ in range(2)]
    for t in pollers:
        t.start()
    rng = random.Random(0)
    # 3 s and at least 200 operations (the pollers can starve this thread on a loaded
    # machine: a count reached in a fixed time was flaky), at most 60 s
    ops, start = 0, time.monotonic()
    try:
        while (ops < 200 or time.monotonic() < start + 3.0) and time.monotonic() < start + 60:
            li = rng.randrange(4)
            ids = [rng.randrange(NUM_EXPERTS) for _ in range(rng.randint(1, 4))]
            op = rng.random()
            if op < 0.45:
                acquire_and_check(checker, cache, li, ids)
            elif op < 0.85:
                cache.prefetch(li, np.array(ids * 2, dtype=np.int32))  # re-predictions
            elif op < 0.9:
                cache.inject_fault(li, rng.choice(FAULTS), expert=rng.choice([-1, *ids]))
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
    assert ops >= 200 and polls[0] > 10
