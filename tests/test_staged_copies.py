"""Staged pool writes (ext/staged_copies.h) delivered through the acquire mailbox.

On a GPU the acquire kernels copy what an answer delivers into the pools; here the pools
are host memory and `AcquireMailbox.post` performs the delivered copies as those kernels
would (row copies in order, then records). What must hold on any device: a row handed
out holds its expert's record once its answer's copies ran; a write staged for a row
that is written again later never lands over the later one; a promotion that reads a
side row whose fill is still staged copies that fill's bytes; a fill that finds no
staging slot gives up (a cancelled prefetch, never an error); turning staging off
writes everything staged, after which every mapped row holds its expert; and a record
the host tier holds is staged from there, not read again.
"""

import ctypes
import threading
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine._ext import AcquireMailbox, Router
from engine.cache import PLAN_STREAM, PLAN_TABLE, SLOT_LOADING, open_cache
from engine.config import StreamConfig
from engine.memory_plan import tier_slot_bytes, tier_slots

from rowcheck import RowChecker

HIDDEN = 16  # any: the requests here carry no hidden state


def staged_cache(store, fill_slots=4, tier_slots=0, **config):
    # Every prediction filled (a fixed degree): these tests are of the fills' staging, and
    # the adaptive degree of staged fills starts at none until predictions prove useful
    # (tests/test_prefetch_throttle.py).
    config.setdefault("adaptive_prefetch", False)
    cache = open_cache(store, StreamConfig(reader_threads=1, **config))
    mailbox = AcquireMailbox(
        cache, HIDDEN, max_ids=4, fill_slots=fill_slots, tier_slots=tier_slots, x_rows=2
    )
    cache.set_staging(True)
    return cache, mailbox


def test_a_demand_read_lands_with_its_answer_not_before(qwen_store):
    cache, mailbox = staged_cache(qwen_store, expert_slots=2, side_slots=0)
    checker = RowChecker(qwen_store, cache)
    rows, missing = cache.acquire(0, np.array([[3]], np.int32))
    assert missing == []
    row = int(rows[0, 0])
    assert checker.row_bytes(0, row) != checker.records[(0, 3)]  # staged, not written
    assert cache.staged[0] > 0 and cache.staged[1] == 1  # one slot, copies pending
    # The next answer delivers it (with the new request's own read).
    assert mailbox.post(1, np.array([5], np.int32)).tolist() != []
    checker.assert_row(0, row, 3)
    assert cache.staged[0] == 0
    del mailbox  # staging off: nothing left staged
    assert not cache.staging_on and cache.staged == (0, 0)
    checker.assert_all_published()


def test_turning_staging_off_writes_what_is_staged(qwen_store):
    cache, mailbox = staged_cache(qwen_store, expert_slots=2, side_slots=2, sync=True)
    checker = RowChecker(qwen_store, cache)
    cache.prefetch(2, np.array([1, 6], np.int32))  # fills inline, staged
    assert cache.staged[0] > 0
    cache.set_staging(False)
    assert cache.staged[0] == 0 and cache.snapshot(2)["stats"]["loads"] == 2
    assert checker.assert_all_published() == 2
    assert cache.check() == ""


def test_a_promotion_reads_the_fill_still_staged(qwen_store):
    # The side hit is copied into a real slot by a row copy; its fill has not been
    # delivered yet, so the copy must take the staging slot's bytes, not the side row's.
    cache, mailbox = staged_cache(qwen_store, expert_slots=2, side_slots=2, sync=True)
    checker = RowChecker(qwen_store, cache)
    cache.prefetch(1, np.array([7], np.int32))
    rows = mailbox.post(1, np.array([7, 2], np.int32))
    s = cache.snapshot(1)
    assert s["stats"]["side_hits"] == 1 and s["stats"]["promotions"] == 1
    slot = s["slot_expert"].tolist().index(7)
    checker.assert_row(1, slot, 7)  # the promoted copy
    checker.assert_row(1, int(rows[0]), 7)  # the row handed out (the side row)
    checker.assert_row(1, int(rows[1]), 2)


def test_a_fill_without_a_staging_slot_gives_up(qwen_store):
    cache, mailbox = staged_cache(qwen_store, fill_slots=1, expert_slots=2, side_slots=4, sync=True)
    checker = RowChecker(qwen_store, cache)
    cache.prefetch(3, np.array([0, 1, 2, 3], np.int32))
    st_ = cache.snapshot(3)["stats"]
    assert (st_["loads"], st_["prefetch_cancelled"], st_["read_errors"]) == (1, 3, 0)
    cache.set_staging(False)
    assert checker.assert_all_published() == 1
    assert cache.check() == ""


def test_the_host_tier_serves_a_miss_again_without_a_read(qwen_store):
    cache, mailbox = staged_cache(
        qwen_store, tier_slots=2, expert_slots=1, side_slots=0, policy="lru"
    )
    checker = RowChecker(qwen_store, cache)
    stride = qwen_store.manifest.layers[0].stride
    for expert in (3, 5, 3, 5, 6, 3):
        (row,) = mailbox.post(0, np.array([expert], np.int32))
        checker.assert_row(0, int(row), expert)
    s = cache.snapshot(0)["stats"]
    # 3 and 5 read once each, then served from the tier; 6 evicts 3 there (LRU among
    # two), so the last 3 is read again.
    assert (s["loads"], s["host_hits"], s["bytes_read"]) == (6, 2, 4 * stride)
    assert cache.host_tier[:2] == (2, 2)


def test_a_prefetch_fill_comes_from_the_host_tier(qwen_store):
    cache, mailbox = staged_cache(
        qwen_store, tier_slots=4, expert_slots=1, side_slots=2, sync=True, policy="lru"
    )
    checker = RowChecker(qwen_store, cache)
    mailbox.post(2, np.array([4], np.int32))  # read into the real slot and the tier
    mailbox.post(2, np.array([1], np.int32))  # evicts 4 from the real slot
    cache.prefetch(2, np.array([4], np.int32))  # a fill the tier serves
    s = cache.snapshot(2)["stats"]
    assert (s["host_hits"], s["prefetch_issued"]) == (1, 1)
    rows = mailbox.post(2, np.array([4], np.int32))
    checker.assert_row(2, int(rows[0]), 4)
    assert cache.snapshot(2)["stats"]["side_hits"] == 1


def one_hot_router(hidden=HIDDEN, experts=8):
    """A router whose logit for expert e is x[e]: a one-hot x picks the expert it names."""
    return Router(np.eye(experts, hidden, dtype=np.float32), np.zeros(experts, np.float32))


def test_a_batch_prefetches_what_every_row_predicts(qwen_store):
    cache = open_cache(
        qwen_store,
        StreamConfig(
            reader_threads=1, adaptive_prefetch=False, expert_slots=2, side_slots=4, sync=True
        ),
    )
    # Staging for the three fills beside the first request's two demand reads, which may
    # take any slot.
    mailbox = AcquireMailbox(cache, HIDDEN, max_ids=4, fill_slots=8, x_rows=3)
    cache.set_staging(True)
    assert mailbox.x_rows == 3
    # Budget 2: row 0 ranks 5 then 0 (ties go to the lower id), row 1 ranks 3 then 0,
    # row 2 ranks 5 then 0 again: rank by rank, 5, 3, then 0 once.
    mailbox.set_prefetch(0, [1], [one_hot_router()], 2)
    x = np.zeros((3, HIDDEN), np.float32)
    x[0, 5] = x[1, 3] = x[2, 5] = 1.0
    mailbox.post(0, np.array([1, 2], np.int32), x)
    mailbox.wait()
    assert cache.snapshot(1)["stats"]["prefetch_issued"] == 3
    rows = mailbox.post(1, np.array([5, 3, 0], np.int32))
    assert cache.snapshot(1)["stats"]["side_hits"] == 3
    checker = RowChecker(qwen_store, cache)
    for e, r in zip([5, 3, 0], rows, strict=True):
        checker.assert_row(1, int(r), e)
    # One row (a decode step of one reply) predicts from that row only.
    mailbox.set_prefetch(0, [2], [one_hot_router()], 1)
    one = np.zeros(HIDDEN, np.float32)
    one[6] = 1.0
    mailbox.post(0, np.array([1, 2], np.int32), one)
    mailbox.wait()
    assert cache.snapshot(2)["stats"]["prefetch_issued"] == 1
    with pytest.raises(ValueError, match="1 to 3 rows"):
        mailbox.post(0, np.array([1], np.int32), np.zeros((4, HIDDEN), np.float32))
    with pytest.raises(ValueError, match="x_rows must be >= 1"):
        AcquireMailbox(
            open_cache(qwen_store, StreamConfig(reader_threads=1)), HIDDEN, 4, 4, x_rows=0
        )


def test_a_mailbox_is_made_once_per_cache(qwen_store):
    cache, mailbox = staged_cache(qwen_store, expert_slots=2)
    with pytest.raises(RuntimeError, match="already staged"):
        AcquireMailbox(cache, HIDDEN, max_ids=4, fill_slots=4)
    with pytest.raises(ValueError, match="max_ids must be in"):
        AcquireMailbox(open_cache(qwen_store, StreamConfig()), HIDDEN, max_ids=0, fill_slots=4)
    with pytest.raises(ValueError, match="at most 4 ids"):
        mailbox.post(0, np.arange(5, dtype=np.int32))


# Requests as a decode makes them (layers in order, one token's distinct top-2 ids),
# with prefetch fills (inline or on the reader thread) staged between them.
request = st.tuples(st.integers(0, 7), st.integers(0, 7)).filter(lambda p: p[0] != p[1])
token = st.lists(request, min_size=4, max_size=4)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    tokens=st.lists(token, min_size=1, max_size=6),
    fills=st.lists(st.lists(st.integers(0, 7), max_size=3), min_size=24, max_size=24),
    slots=st.integers(2, 8),
    side=st.integers(0, 3),
    sync=st.booleans(),
    side_lfu=st.booleans(),
    fill_slots=st.integers(1, 6),
    tier_slots=st.integers(0, 3),
    host=st.lists(st.booleans(), min_size=6, max_size=6),
    pins=st.lists(st.integers(-1, 7), min_size=6, max_size=6),
    fill_stream=st.booleans(),
    predict=st.booleans(),
)
def test_every_answer_holds_its_experts(
    qwen_store,
    tokens,
    fills,
    slots,
    side,
    sync,
    side_lfu,
    fill_slots,
    tier_slots,
    host,
    pins,
    fill_stream,
    predict,
):
    cache, mailbox = staged_cache(
        qwen_store,
        fill_slots=fill_slots,
        tier_slots=tier_slots,
        expert_slots=slots,
        side_slots=side,
        sync=sync,
        side_lfu=side_lfu,
        io_uring=False,
    )
    checker = RowChecker(qwen_store, cache)
    # With the fill stream (on host memory, the thread copies a batch when it next polls),
    # fills are copied beside the rows being checked, as copy engines run beside the
    # compute.
    mailbox.fill_stream = fill_stream
    # With predict, requests carry hidden states (one row or a batch's two) and the thread
    # prefetches the next layer's top 2 of each row after each answer (random routers),
    # between the answer and its batch.
    rng = np.random.default_rng(len(tokens))
    if predict and side:
        for li in range(3):
            weight = rng.standard_normal((8, HIDDEN)).astype(np.float32)
            mailbox.set_prefetch(li, [li + 1], [Router(weight, np.zeros(8, np.float32))], 2)
    step, pinned = 0, None
    for n, t in enumerate(tokens):
        for li, ids in enumerate(t):
            shape = (HIDDEN,) if step % 2 else (2, HIDDEN)
            x = rng.standard_normal(shape).astype(np.float32) if predict else None
            rows = mailbox.post(li, np.array(ids, np.int32), x)
            for e, r in zip(ids, rows, strict=True):
                checker.assert_row(li, int(r), e)
            if fills[step % len(fills)] and li + 1 < 4:
                cache.prefetch(li + 1, np.array(fills[step % len(fills)], np.int32))
            step += 1
        assert cache.check() == ""
        # A pin between tokens, as the app may make one during a reply: it evicts and
        # stages a read while the thread may still be answering the last request.
        if pinned is not None:
            cache.unpin(1, pinned)
        pinned = pins[n % 6] if pins[n % 6] >= 0 and slots >= 3 else None
        if pinned is not None:
            cache.pin(1, pinned)
        if host[n % 6]:
            # A host path between tokens (a prompt, a reply's end): staging off writes
            # what is staged, the host acquires (the tier serving what it holds).
            cache.set_staging(False)
            checker.assert_all_published()
            ids = t[0]
            rows, _ = cache.acquire(0, np.array([ids], np.int32))
            for e, r in zip(ids, rows[0], strict=True):
                checker.assert_row(0, int(r), e)
            cache.set_staging(True)
    cache.raise_stream_error()
    cache.set_staging(False)
    checker.assert_all_published()
    assert cache.staged[0] == 0 and cache.check() == ""


def test_a_fill_goes_to_the_fill_stream_after_a_request_of_another_layer(qwen_store):
    # Expert 4 of layer 1 is in the host tier, not in a real slot: its fill is staged
    # inline. A request of layer 1 whose rows come from the hit table leaves it pending
    # (kernels may still read layer 1's rows); the next request, of layer 0, queues it on
    # the fill stream, where it lands; layer 1's next request finds it in its side row.
    cache, mailbox = staged_cache(
        qwen_store, tier_slots=8, expert_slots=2, side_slots=2, policy="lru"
    )
    checker = RowChecker(qwen_store, cache)
    mailbox.fill_stream = True
    mailbox.post(1, np.array([4, 5], np.int32))  # into the real slots and the tier
    mailbox.post(1, np.array([6, 7], np.int32))  # evicts 4 and 5
    mailbox.post(0, np.array([1, 2], np.int32))
    mailbox.post(1, np.array([6, 7], np.int32))  # all in the hit table
    mailbox.wait()
    segments = len(cache.pool(1))
    before = mailbox.delivered
    cache.prefetch(1, np.array([4], np.int32))
    assert cache.staged[0] == segments
    mailbox.post(1, np.array([7, 6], np.int32))  # from the table again: layer 1 excluded
    mailbox.wait()
    assert mailbox.fast_answers == 2 and mailbox.fill_batches == (0, 0)
    assert cache.staged[0] == segments
    mailbox.post(0, np.array([2, 1], np.int32))  # from the table: layer 0's request
    mailbox.wait()
    assert mailbox.fill_batches == (1, segments) and cache.staged[0] == 0
    assert mailbox.delivered == before  # no answer delivered the fill's copies
    rows = mailbox.post(1, np.array([4], np.int32))
    checker.assert_row(1, int(rows[0]), 4)
    s = cache.snapshot(1)["stats"]
    assert (s["side_hits"], s["host_hits"]) == (1, 1)


def test_without_the_fill_stream_a_fill_goes_with_the_next_answer(qwen_store):
    # The same fill, the fill stream off: no batch; the next answer that is waited for
    # delivers its copies, and layer 1's request finds it in its side row.
    cache, mailbox = staged_cache(
        qwen_store, tier_slots=8, expert_slots=2, side_slots=2, policy="lru"
    )
    checker = RowChecker(qwen_store, cache)
    assert not mailbox.fill_stream
    mailbox.post(1, np.array([4, 5], np.int32))
    mailbox.post(1, np.array([6, 7], np.int32))
    mailbox.wait()
    segments = len(cache.pool(1))
    records = mailbox.delivered[1]
    cache.prefetch(1, np.array([4], np.int32))
    mailbox.post(0, np.array([1, 2], np.int32))  # waited for: delivers the fill
    mailbox.wait()
    assert mailbox.fill_batches == (0, 0) and cache.staged[0] == 0
    assert mailbox.delivered[1] - records >= segments
    rows = mailbox.post(1, np.array([4], np.int32))
    checker.assert_row(1, int(rows[0]), 4)
    assert cache.snapshot(1)["stats"]["side_hits"] == 1


def test_the_host_tier_is_sized_by_layer_and_record(qwen_store):
    cache = open_cache(qwen_store, StreamConfig(expert_slots=2))
    record = cache.staging_slot_bytes
    assert tier_slot_bytes(qwen_store.manifest.layers) == record  # the cache's own rule
    spec = max(qwen_store.manifest.layers, key=lambda L: L.record_bytes)
    # each segment 16-byte aligned in a 256-byte-aligned slot
    assert record == -(-(spec.record_bytes + 16 * len(spec.segments)) // 256) * 256
    layers, experts = cache.num_layers, cache.num_experts
    left = 10**12
    assert tier_slots(None, layers, experts, record, left) == 0
    assert tier_slots(layers * 3 * record + record - 1, layers, experts, record, left) == 3
    assert tier_slots(10**15, layers, experts, record, left) == experts  # at most every expert
    assert tier_slots("auto", layers, experts, record, left) == experts  # a tiny store fits
    # auto: half of what the rest of the plan leaves
    assert tier_slots("auto", layers, experts, record, 2 * layers * 3 * record) == 3
    assert tier_slots("auto", layers, experts, record, 1000) == 0  # 500 B hold no record


def test_a_layer_completed_while_a_copy_is_staged_takes_an_acquire(qwen_store):
    # Pinning the last absent expert completes layer 0 with its record only staged: the
    # table path would read the row before any answer delivered it.
    cache, mailbox = staged_cache(qwen_store, expert_slots=8, side_slots=0, io_uring=False)
    checker = RowChecker(qwen_store, cache)
    for ids in ([0, 1], [2, 3], [4, 5], [6, 0]):
        mailbox.post(0, np.array(ids, np.int32))
    cache.pin(0, 7)
    assert cache.staged[0] > 0 and cache.plan(0, 2, 2) == PLAN_STREAM
    rows = mailbox.post(0, np.array([7, 1], np.int32))
    checker.assert_row(0, int(rows[0]), 7)
    assert cache.plan(0, 2, 2) == PLAN_TABLE


def test_host_paths_read_from_the_host_tier_and_fill_it(qwen_store):
    # With staging off (prefill, between replies) the tier still serves misses, copied by
    # the host, and keeps what those paths read from disk.
    cache, mailbox = staged_cache(
        qwen_store, tier_slots=8, expert_slots=2, side_slots=0, policy="lru", io_uring=False
    )
    checker = RowChecker(qwen_store, cache)
    stride = qwen_store.manifest.layers[0].stride
    for expert in (1, 2, 3):  # read, kept in the tier; 3 evicts 1 from the real slots
        mailbox.post(0, np.array([expert], np.int32))
    cache.set_staging(False)
    rows, _ = cache.acquire(0, np.array([[1]], np.int32))
    checker.assert_row(0, int(rows[0, 0]), 1)
    s = cache.snapshot(0)["stats"]
    assert (s["host_hits"], s["bytes_read"]) == (1, 3 * stride)
    # The over-capacity path reads into scratch rows: from disk once, then from the tier.
    for _ in range(2):
        rows = cache.load_scratch(1, [4, 5])
        for e, r in zip((4, 5), rows, strict=True):
            checker.assert_row(1, r, e)
    s = cache.snapshot(1)["stats"]
    assert (s["host_hits"], s["bytes_read"], s["loads"]) == (2, 2 * stride, 4)
    assert cache.check() == ""


def test_a_fill_staged_for_another_layer_leaves_a_complete_layer_on_the_table_path(qwen_store):
    cache, mailbox = staged_cache(qwen_store, expert_slots=8, side_slots=2, sync=True)
    cache.set_staging(False)
    cache.fill(0)
    assert cache.plan(0, 2, 2) == PLAN_TABLE
    cache.set_staging(True)
    cache.prefetch(2, np.array([3, 4], np.int32))  # staged, for layer 2
    assert cache.staged[0] > 0 and cache.plan(0, 2, 2) == PLAN_TABLE


def test_a_reset_empties_the_host_tier(qwen_store):
    cache, mailbox = staged_cache(qwen_store, tier_slots=4, expert_slots=2, side_slots=0)
    mailbox.post(0, np.array([1, 2], np.int32))
    assert cache.host_tier[1] == 2
    cache.reset()
    assert cache.host_tier[1] == 0


def fast_answers(mailbox):
    """Requests answered from the hit table so far, once the thread has answered all."""
    mailbox.wait()
    return mailbox.fast_answers


def test_a_layer_of_real_hits_takes_its_rows_from_the_hit_table(qwen_store):
    # The second call of the same experts finds every id in the hit table: its rows come
    # from there, it is not waited for, and the thread still counts it.
    cache, mailbox = staged_cache(qwen_store, expert_slots=4, side_slots=0)
    checker = RowChecker(qwen_store, cache)
    first = mailbox.post(0, np.array([1, 2], np.int32))  # misses: waited for
    assert fast_answers(mailbox) == 0
    again = mailbox.post(0, np.array([2, 1], np.int32))
    assert fast_answers(mailbox) == 1 and mailbox.answered == 2
    assert again.tolist() == first[::-1].tolist()
    for e, r in zip((2, 1), again, strict=True):
        checker.assert_row(0, int(r), e)
    s = cache.snapshot(0)["stats"]
    assert (s["hits"], s["misses"]) == (2, 2)
    # An id the table lacks is waited for, with the ones it has.
    rows = mailbox.post(0, np.array([1, 3], np.int32))
    assert fast_answers(mailbox) == 1
    checker.assert_row(0, int(rows[1]), 3)


def test_an_evicted_expert_leaves_the_hit_table_at_once(qwen_store):
    # A pin from another thread empties a slot and stages a copy into it: the evicted
    # expert's entry is gone before that copy can be delivered, so a request of it asks
    # the host; a reset and staging off empty the table.
    cache, mailbox = staged_cache(qwen_store, expert_slots=2, side_slots=0, policy="lru")
    checker = RowChecker(qwen_store, cache)
    mailbox.post(0, np.array([1, 2], np.int32))
    mailbox.post(0, np.array([2], np.int32))  # 1 is the least recently used
    mailbox.wait()
    cache.pin(0, 5)  # evicts 1, its copy staged into 1's slot
    fast = fast_answers(mailbox)
    (row,) = mailbox.post(0, np.array([1], np.int32))
    assert fast_answers(mailbox) == fast
    checker.assert_row(0, int(row), 1)
    cache.reset()
    mailbox.post(0, np.array([5, 1], np.int32))
    assert fast_answers(mailbox) == fast  # nothing mapped after the reset
    mailbox.post(0, np.array([5, 1], np.int32))
    assert fast_answers(mailbox) == fast + 1
    cache.set_staging(False)
    cache.set_staging(True)
    mailbox.post(0, np.array([5, 1], np.int32))
    assert fast_answers(mailbox) == fast + 1
    cache.raise_stream_error()


def test_the_answers_not_waited_for_come_before_staging_off_and_a_mailbox_closing(qwen_store):
    # Staging off, a reset and closing the mailbox each wait until the thread has answered
    # what was posted without a wait: the last layer's acquire is counted in its forward,
    # and never runs against a host path.
    cache, mailbox = staged_cache(qwen_store, expert_slots=4, side_slots=0)
    for _ in range(2):
        for li in range(4):
            mailbox.post(li, np.array([0, 1], np.int32))
    cache.set_staging(False)
    assert mailbox.sequence[0] == mailbox.sequence[1] and mailbox.answered == 8
    assert sum(cache.snapshot(li)["stats"]["hits"] for li in range(4)) == 8
    cache.set_staging(True)
    for li in range(4):
        mailbox.post(li, np.array([0, 1], np.int32))  # the table was emptied: waited for
    mailbox.post(3, np.array([0, 1], np.int32))
    del mailbox
    assert sum(cache.snapshot(li)["stats"]["hits"] for li in range(4)) == 18
    cache.raise_stream_error()  # no "closed while a forward was running"


def test_a_promotion_beside_a_demand_read_is_copied_with_it_at_once(qwen_store):
    # The promotion reads a side row whose fill an earlier answer delivered and writes a
    # slot no other copy touches: no order is needed, so it goes with the demand read's
    # record to the copy kernel's blocks, not one block after another.
    cache, mailbox = staged_cache(qwen_store, expert_slots=2, side_slots=2, sync=True, policy="lru")
    checker = RowChecker(qwen_store, cache)
    segments = len(qwen_store.manifest.layers[1].segments)
    mailbox.post(1, np.array([3], np.int32))
    cache.prefetch(1, np.array([7], np.int32))
    mailbox.post(0, np.array([5], np.int32))  # a new forward: delivers 7's fill
    before = mailbox.delivered
    rows = mailbox.post(1, np.array([7, 2], np.int32))
    s = cache.snapshot(1)
    assert (s["stats"]["side_hits"], s["stats"]["promotions"]) == (1, 1)
    ordered, at_once = (a - b for a, b in zip(mailbox.delivered, before, strict=True))
    assert (ordered, at_once) == (0, 2 * segments)
    checker.assert_row(1, int(rows[0]), 7)
    checker.assert_row(1, int(rows[1]), 2)
    checker.assert_row(1, s["slot_expert"].tolist().index(7), 7)  # the promoted copy


def test_a_pin_between_hits_is_delivered_by_its_layers_next_request(qwen_store):
    # Every request finds its ids in the hit table, so none is waited for: a pin's read,
    # staged in a demand slot, must still reach the pools with its layer's next request,
    # not wait for a miss that may never come while each further pin takes a slot.
    cache, mailbox = staged_cache(qwen_store, fill_slots=1, expert_slots=8, side_slots=0)
    checker = RowChecker(qwen_store, cache)
    for expert in range(2, 8):
        for li in range(4):
            rows = mailbox.post(li, np.array([0, 1], np.int32))
            checker.assert_row(li, int(rows[0]), 0)
        cache.pin(1, expert)
        assert cache.staged[0] > 0
        fast = fast_answers(mailbox)
        mailbox.post(1, np.array([0, 1], np.int32))
        assert fast_answers(mailbox) == fast and cache.staged[0] == 0  # waited for
        checker.assert_row(1, cache.snapshot(1)["slot_expert"].tolist().index(expert), expert)
        cache.unpin(1, expert)
    cache.raise_stream_error()


def test_a_slot_a_pin_is_loading_is_no_victim(qwen_store):
    # A pin reads with the cache's lock released; an acquire meanwhile must not take the
    # slot it is loading (empty, but not free): both reads would target one slot and the
    # later assignment would leave the other's bytes there.
    cache, mailbox = staged_cache(
        qwen_store, expert_slots=3, side_slots=0, policy="lru", io_uring=False
    )
    checker = RowChecker(qwen_store, cache)
    mailbox.post(1, np.array([0, 1], np.int32))  # slot 2 stays empty
    cache.inject_fault(1, "delay", expert=5, count=1, delay_ms=500)
    pin = threading.Thread(target=cache.pin, args=(1, 5))
    pin.start()
    deadline = time.monotonic() + 30
    while cache.snapshot(1)["slot_state"][2] != SLOT_LOADING:  # the pin's read of 5
        assert time.monotonic() < deadline
        time.sleep(0.001)
    rows = mailbox.post(1, np.array([0, 3], np.int32))
    pin.join()
    assert int(rows[1]) == 1  # 3 evicted 1, not the slot being loaded
    mailbox.post(1, np.array([5, 3], np.int32))
    assert cache.snapshot(1)["slot_expert"].tolist() == [0, 3, 5]
    cache.set_staging(False)
    checker.assert_all_published()
    cache.raise_stream_error()


def test_a_pin_while_every_slot_is_loading_is_refused(qwen_store):
    # Both real slots of layer 1 are being loaded (a pin's read, an acquire's read): a
    # third call has no victim and says so, rather than taking a slot under a read.
    cache, mailbox = staged_cache(
        qwen_store, expert_slots=2, side_slots=0, policy="lru", io_uring=False
    )
    mailbox.post(1, np.array([0], np.int32))  # slot 1 stays empty
    cache.inject_fault(1, "delay", expert=-1, count=2, delay_ms=1000)  # the next 2 reads
    pin = threading.Thread(target=cache.pin, args=(1, 5))
    pin.start()
    deadline = time.monotonic() + 30
    while (cache.snapshot(1)["slot_state"] == SLOT_LOADING).sum() != 1:
        assert time.monotonic() < deadline
        time.sleep(0.001)
    post = threading.Thread(target=mailbox.post, args=(1, np.array([7], np.int32)))
    post.start()
    while (cache.snapshot(1)["slot_state"] == SLOT_LOADING).sum() != 2:
        assert time.monotonic() < deadline
        time.sleep(0.001)
    with pytest.raises(RuntimeError, match="every evictable slot is being loaded"):
        cache.pin(1, 6)
    pin.join()
    post.join()
    assert sorted(cache.snapshot(1)["slot_expert"].tolist()) == [5, 7]
    cache.set_staging(False)
    RowChecker(qwen_store, cache).assert_all_published()
    cache.raise_stream_error()


def predicting_layer_1(store):
    """A cache and mailbox whose thread, after each request of layer 1 with a hidden
    state, prefetches expert 5 of layer 2 (one side row per bank, the host tier holding
    layer 2's experts 4 to 7), its fills on the fill stream."""
    cache, mailbox = staged_cache(
        store, tier_slots=8, expert_slots=2, side_slots=1, policy="lru", side_lfu=False
    )
    bias = np.zeros(8, np.float32)
    bias[5] = 10.0
    mailbox.set_prefetch(1, [2], [Router(np.zeros((8, HIDDEN), np.float32), bias)], 1)
    mailbox.post(2, np.array([4, 5], np.int32))  # into the real slots and the tier
    mailbox.post(2, np.array([6, 7], np.int32))  # evicts 4 and 5; the tier keeps them
    mailbox.fill_stream = True
    return cache, mailbox


class SlowKernels:
    """The acquire kernels' side of the mailbox, as AcquireMailbox.post plays it, on the
    mapped words themselves, with a hook between the reply and the answer's copies: a
    compute stream that runs them after the fill stream's next batch has landed, as two
    streams may."""

    def __init__(self, mailbox):
        self.mailbox = mailbox
        self.words = (ctypes.c_int32 * (AcquireMailbox.HIDDEN + HIDDEN)).from_address(
            mailbox.address
        )

    def post(self, layer, ids, x, before_copies):
        w, box = self.words, AcquireMailbox
        previous = w[box.REQUEST]
        while w[box.REPLY] != previous:
            time.sleep(0)
        w[box.LAYER], w[box.COUNT], w[box.X_ROWS], w[box.FAST] = layer, len(ids), 1, 0
        for i, e in enumerate(ids):
            w[box.IDS + i] = e
        hidden = (ctypes.c_float * HIDDEN).from_address(self.mailbox.address + 4 * box.HIDDEN)
        hidden[:] = [float(v) for v in x]
        w[box.REQUEST] = previous + 1
        while w[box.REPLY] != previous + 1:
            time.sleep(0)
        before_copies()
        n = w[box.ROW_COPIES] + w[box.RECORD_COPIES]
        copies = (ctypes.c_uint64 * (4 * max(n, 1))).from_address(self.mailbox.copies_address)
        for i in range(n):  # one after another: no copy of one answer reads another's target
            ctypes.memmove(copies[4 * i + 1], copies[4 * i], copies[4 * i + 2])


def test_a_batch_never_writes_a_row_the_latest_answer_copies(qwen_store):
    # Layer 1's answer delivers the staged fill of expert 4 into layer 2's side row; its
    # prefetch then takes that row for expert 5. The fill of 5 must not go to the fill stream,
    # which may copy it before the answer's copies run, leaving 4's bytes under 5's name.
    cache, mailbox = predicting_layer_1(qwen_store)
    checker = RowChecker(qwen_store, cache)
    kernels = SlowKernels(mailbox)
    mailbox.post(0, np.array([1, 2], np.int32))
    cache.prefetch(2, np.array([4], np.int32))

    def fill_stream_first():
        deadline = time.monotonic() + 0.5
        while mailbox.fill_batches[0] == 0 and time.monotonic() < deadline:
            time.sleep(0.001)
        mailbox.wait()  # the batch has landed

    kernels.post(1, [0, 3], np.ones(HIDDEN, np.float32), fill_stream_first)
    mailbox.wait()
    assert cache.snapshot(2)["side_expert"].tolist()[:1] == [5]
    cache.set_staging(False)
    checker.assert_all_published()
