"""Faults injected into the read path: EIO, short reads, checksum mismatches, hung reads.

Through the real engine (a streamed model generating) and the cache directly. For each
fault: a transient one is retried and the logits stay bit-identical to the resident
model; a persistent one raises an OSError naming the file, the decoder layer and the
expert; no wrong bytes reach a pool row (every mapped slot and published side row is
compared with the blob afterwards); the in-flight counters drain; and once the fault is
gone the next generation matches the resident model again.
"""

import re
import time

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import load_model

from engine.cache import ChecksumError, ExpertReadError, ExpertReadTimeout, open_cache
from engine.config import StreamConfig
from engine.model import load

from rowcheck import RowChecker

PROMPT = [3, 17, 42, 5, 99, 64, 1, 8]
STEPS = 6
# qwen3_moe with decoder layer 1 dense: MoE index i is decoder layer DECODER[i], so a
# message naming the wrong one (the MoE index) is caught.
OPTIONS = {"mlp_only_layers": (1,)}
DECODER = [0, 2, 3]

MESSAGES = {
    "eio": r"read failed: Input/output error",
    "short_read": r"short read: \d+ of \d+ bytes",
    "corrupt": r"checksum mismatch: crc32 \d+, the manifest says \d+",
}


def greedy(model, arm=None, prompt=PROMPT, steps=STEPS):
    """Prefill + `steps` greedy decode logits (numpy); `arm()` runs before each call."""
    cache = make_prompt_cache(model)
    x = mx.array([prompt])
    out = []
    for _ in range(steps + 1):
        if arm:
            arm()
        logits = model(x, cache=cache)[:, -1]
        out.append(np.array(logits))
        x = mx.argmax(logits, axis=-1)[:, None]
    return out


def assert_same(want, got):
    assert len(want) == len(got)
    for step, (a, b) in enumerate(zip(want, got, strict=True)):
        assert np.array_equal(a, b), f"logits differ at step {step}"


@pytest.fixture(scope="module")
def model_dir(model_dirs):
    return model_dirs("qwen3_moe", **OPTIONS)


@pytest.fixture(scope="module")
def resident(model_dir):
    model, _ = load_model(model_dir)
    return greedy(model)


def assert_clean(sm) -> int:
    """Drained, consistent, and every mapped / published row holds its expert's bytes;
    returns how many rows were checked."""
    sm.cache.drain()
    assert sm.cache.inflight == 0
    assert sm.cache.check() == ""
    return RowChecker(sm.store, sm.cache).assert_all_published()


def wait_for_fills(cache, seconds=5.0):
    """Waits up to `seconds` for the fills in flight to finish, cancelling none."""
    deadline = time.monotonic() + seconds
    while cache.inflight and time.monotonic() < deadline:
        time.sleep(0.001)


def settle(cache, seconds=5.0):
    """Waits for the fills in flight to finish (a drain would cancel queued ones)."""
    wait_for_fills(cache, seconds)
    cache.drain()


def stream_config(prefetch, io_uring, **kw):
    if prefetch:
        kw |= {"side_slots": 3, "prefetch": True, "ahead_lo": 1, "ahead_hi": 1}
    return StreamConfig(expert_slots=2, io_uring=io_uring, **kw)


@pytest.mark.parametrize("prefetch", [False, True], ids=["demand", "prefetch"])
@pytest.mark.parametrize("kind", ["eio", "short_read", "corrupt", "delay"])
def test_transient_fault_is_retried_transparently(model_dir, resident, kind, prefetch, io_uring):
    """One bad read per layer before every forward: retried (EIO, short read) or re-read
    (checksum), or merely slow (delay < timeout); the logits do not change."""
    sm = load(model_dir, stream_config(prefetch, io_uring, read_timeout_s=5.0))

    def arm():
        # A fill still reading from the last forward could take this forward's fault on its
        # retry: two bad reads in a row, a persistent fault (CI saw it once the LFU side
        # region spanned both banks and more fills were in flight at forward boundaries).
        wait_for_fills(sm.cache)
        for li in range(sm.cache.num_layers):
            sm.cache.inject_fault(li, kind, count=1, delay_ms=30)

    assert_same(resident, greedy(sm.model, arm))
    totals = sm.snapshot().totals()
    assert totals["read_errors"] == 0
    assert assert_clean(sm) > 0


@pytest.mark.parametrize("prefetch", [False, True], ids=["demand", "prefetch"])
@pytest.mark.parametrize("kind", ["eio", "short_read", "corrupt"])
def test_persistent_fault_names_file_layer_expert(model_dir, resident, kind, prefetch, io_uring):
    sm = load(model_dir, stream_config(prefetch, io_uring))
    assert_same(resident, greedy(sm.model))  # some experts resident, some fills published
    sm.cache.inject_fault(1, kind, count=10**6)
    with pytest.raises(ExpertReadError) as info:
        greedy(sm.model)
    err = info.value
    assert isinstance(err, OSError)
    assert isinstance(err, ChecksumError) == (kind == "corrupt")
    # the blob, or in place the model directory (a failed read: its file in it)
    path = re.escape(str(sm.store.records_path(sm.store.layer(2))))
    assert re.match(rf"{path}(/\S+)? \(layer 2, expert \d+\): {MESSAGES[kind]}", str(err)), err
    assert sm.snapshot().totals()["read_errors"] >= 1
    assert_clean(sm)  # failed loads left their slots empty; no wrong byte is mapped

    sm.cache.inject_fault(1, "none", count=0)
    assert_same(resident, greedy(sm.model))
    assert assert_clean(sm) > 0


def test_partial_batch_failure_maps_only_the_good_loads(qwen_store, io_uring):
    """One of three demand loads fails for good: the other two are mapped with the right
    bytes, the failed one's slot stays empty, and a retry after the fault reads it."""
    cache = open_cache(qwen_store, StreamConfig(io_uring=io_uring, expert_slots=4))
    checker = RowChecker(qwen_store, cache)
    cache.inject_fault(0, "eio", expert=5, count=10**6)
    with pytest.raises(ExpertReadError, match=r"layer00\.blob \(layer 0, expert 5\): read failed"):
        cache.acquire(0, np.array([[1, 5, 3]], dtype=np.int32))
    assert sorted(e for e in cache.snapshot(0)["slot_expert"].tolist() if e >= 0) == [1, 3]
    assert cache.snapshot(0)["stats"]["read_errors"] == 1
    checker.assert_all_published()
    cache.inject_fault(0, "none", count=0)
    rows, missing = cache.acquire(0, np.array([[1, 5, 3]], dtype=np.int32))
    assert missing == []
    for e, r in zip([1, 5, 3], rows.reshape(-1).tolist(), strict=True):
        checker.assert_row(0, r, e)
    assert cache.snapshot(0)["stats"]["loads"] == 3
    assert cache.check() == ""


@pytest.mark.parametrize("sync", [False, True])
@pytest.mark.parametrize("kind", ["eio", "short_read", "corrupt"])
def test_failed_prefetch_becomes_a_demand_read(qwen_store, kind, sync, io_uring):
    """Both attempts of a fill fail: the row is released, nothing is published, the
    counters drain, and the expert is demand-read later with the right bytes."""
    cache = open_cache(
        qwen_store, StreamConfig(io_uring=io_uring, expert_slots=2, side_slots=2, sync=sync)
    )
    checker = RowChecker(qwen_store, cache)
    cache.inject_fault(2, kind, expert=6, count=2)
    cache.prefetch(2, np.array([6, 7], dtype=np.int32))
    settle(cache)
    assert cache.inflight == 0 and cache.check() == ""
    s = cache.snapshot(2)
    published = {int(e) for e, st in zip(s["side_expert"], s["side_state"], strict=True) if st}
    assert published == {7}
    assert s["stats"]["read_errors"] == 1 and s["stats"]["prefetch_wasted"] == 1
    checker.assert_all_published()
    rows, missing = cache.acquire(2, np.array([[6], [7]], dtype=np.int32))
    assert missing == []
    r6, r7 = rows.reshape(-1).tolist()
    assert r6 < cache.expert_slots and r7 >= cache.expert_slots  # 6 demand-loaded, 7 a side hit
    checker.assert_row(2, r6, 6)
    checker.assert_row(2, r7, 7)
    assert cache.snapshot(2)["stats"]["side_hits"] == 1


def test_failed_pin_leaves_the_slot_empty(qwen_store, io_uring):
    cache = open_cache(qwen_store, StreamConfig(io_uring=io_uring, expert_slots=3))
    cache.inject_fault(1, "short_read", expert=4, count=2)
    with pytest.raises(ExpertReadError, match=r"\(layer 1, expert 4\): short read"):
        cache.pin(1, 4)
    s = cache.snapshot(1)
    assert (s["slot_expert"] == -1).all() and s["stats"]["read_errors"] == 1
    cache.pin(1, 4)
    RowChecker(qwen_store, cache).assert_all_published()
    assert cache.check() == ""


def test_verification_off_lets_corruption_through_by_design(qwen_store, io_uring):
    """verify_checksums=False trusts the disk: documented, so the check above is what
    keeps corrupt bytes out of the pool."""
    cache = open_cache(
        qwen_store, StreamConfig(io_uring=io_uring, expert_slots=2, verify_checksums=False)
    )
    cache.inject_fault(0, "corrupt", expert=1, count=1)
    rows, _ = cache.acquire(0, np.array([[1]], dtype=np.int32))
    with pytest.raises(AssertionError):
        RowChecker(qwen_store, cache).assert_row(0, int(rows[0, 0]), 1)


# ---- read timing -------------------------------------------------------------------


def test_reading_seconds_is_the_wall_time_with_a_read_in_flight(qwen_store, io_uring):
    """Two reads delayed 300 ms each: reading_seconds holds at least one delay and never
    more than the call's wall time (reads that overlap count once); hits read nothing and
    add nothing."""
    cache = open_cache(
        qwen_store, StreamConfig(io_uring=io_uring, expert_slots=4, reader_threads=2)
    )
    assert cache.reading_seconds == 0.0
    cache.inject_fault(0, "delay", expert=-1, count=2, delay_ms=300)
    t0 = time.monotonic()
    cache.acquire(0, np.array([[1, 2]], dtype=np.int32))
    wall = time.monotonic() - t0
    assert cache.snapshot(0)["stats"]["loads"] == 2
    reading = cache.reading_seconds
    assert 0.3 <= reading <= wall
    cache.acquire(0, np.array([[2, 1]], dtype=np.int32))
    assert cache.snapshot(0)["stats"]["hits"] == 2 and cache.reading_seconds == reading


# ---- hung reads --------------------------------------------------------------------

HANG_MS = 1500
TIMEOUT_S = 0.2


def test_hung_demand_read_times_out_and_never_writes_late(qwen_store, io_uring):
    """cap 1: the slot a timed-out read was headed for is given to the next expert at
    once; when the hung read returns it must not overwrite that slot."""
    cache = open_cache(
        qwen_store, StreamConfig(io_uring=io_uring, expert_slots=1, read_timeout_s=TIMEOUT_S)
    )
    checker = RowChecker(qwen_store, cache)
    cache.inject_fault(0, "delay", expert=3, count=1, delay_ms=HANG_MS)
    t0 = time.monotonic()
    with pytest.raises(ExpertReadTimeout) as info:
        cache.acquire(0, np.array([[3]], dtype=np.int32))
    waited = time.monotonic() - t0
    assert TIMEOUT_S * 0.9 < waited < HANG_MS / 1000 / 2
    assert isinstance(info.value, ExpertReadError) and isinstance(info.value, OSError)
    assert re.search(r"layer00\.blob \(layer 0, expert 3\): read timed out", str(info.value))
    assert "200 ms" in str(info.value)
    s = cache.snapshot(0)
    assert s["slot_expert"].tolist() == [-1] and s["slot_state"].tolist() == [0]
    assert s["stats"]["read_errors"] == 1

    rows, _ = cache.acquire(0, np.array([[4]], dtype=np.int32))  # the other reader thread
    assert rows.tolist() == [[0]]
    time.sleep(HANG_MS / 1000 + 0.3)  # the hung read has returned by now
    checker.assert_row(0, 0, 4)
    checker.assert_all_published()
    rows, _ = cache.acquire(0, np.array([[3]], dtype=np.int32))
    checker.assert_row(0, int(rows[0, 0]), 3)
    assert cache.check() == "" and cache.inflight == 0


def test_hung_scratch_read_times_out_and_never_writes_late(qwen_store, io_uring):
    cache = open_cache(
        qwen_store,
        StreamConfig(io_uring=io_uring, expert_slots=1, scratch_slots=2, read_timeout_s=TIMEOUT_S),
    )
    checker = RowChecker(qwen_store, cache)
    rows, missing = cache.acquire(0, np.array([[1], [2], [3]], dtype=np.int32))
    assert missing == [1, 2, 3]
    cache.inject_fault(0, "delay", expert=1, count=1, delay_ms=HANG_MS)
    with pytest.raises(ExpertReadTimeout, match=r"\(layer 0, expert 1\): read timed out"):
        cache.load_scratch(0, [1, 2])
    scratch = cache.load_scratch(0, [3, 5])  # the same rows, while the read of 1 hangs
    time.sleep(HANG_MS / 1000 + 0.3)
    checker.assert_row(0, scratch[0], 3)
    checker.assert_row(0, scratch[1], 5)


def test_hung_fill_is_given_up_by_drain_and_never_writes_late(qwen_store, io_uring):
    """A prefetch fill hangs: the drain gives up on it after the timeout (instead of
    freezing the next forward), frees its row, and the row's next owner keeps its bytes
    when the hung read returns."""
    cache = open_cache(
        qwen_store,
        StreamConfig(io_uring=io_uring, expert_slots=1, side_slots=1, read_timeout_s=TIMEOUT_S),
    )
    checker = RowChecker(qwen_store, cache)
    cache.inject_fault(0, "delay", expert=5, count=1, delay_ms=HANG_MS)
    cache.prefetch(0, np.array([5], dtype=np.int32))
    time.sleep(0.05)  # a reader thread has picked the fill up and hangs in it
    t0 = time.monotonic()
    cache.drain()
    assert time.monotonic() - t0 < HANG_MS / 1000 / 2
    assert cache.inflight == 0 and cache.check() == ""
    s = cache.snapshot(0)
    assert s["side_state"].tolist() == [0, 0]
    assert s["stats"]["read_errors"] == 1 and s["stats"]["prefetch_wasted"] == 1

    cache.prefetch(0, np.array([6], dtype=np.int32))  # takes the freed row
    settle(cache)
    assert cache.snapshot(0)["side_expert"].tolist()[0] == 6
    time.sleep(HANG_MS / 1000 + 0.3)
    checker.assert_row(0, cache.expert_slots, 6)
    rows, _ = cache.acquire(0, np.array([[5]], dtype=np.int32))  # later demand read
    checker.assert_row(0, int(rows[0, 0]), 5)
    assert cache.check() == ""


def test_hung_read_in_a_generation(model_dir, resident, io_uring):
    sm = load(model_dir, stream_config(True, io_uring, read_timeout_s=0.25))
    sm.cache.inject_fault(2, "delay", count=1, delay_ms=HANG_MS)
    t0 = time.monotonic()
    with pytest.raises(ExpertReadTimeout) as info:
        greedy(sm.model)
    assert time.monotonic() - t0 < HANG_MS / 1000
    path = re.escape(str(sm.store.records_path(sm.store.layer(3))))
    assert re.match(rf"{path} \(layer 3, expert \d+\): read timed out", str(info.value))
    time.sleep(HANG_MS / 1000)
    assert_clean(sm)
    assert_same(resident, greedy(sm.model))
    assert assert_clean(sm) > 0


def test_no_timeout_waits_for_a_slow_read(qwen_store, io_uring):
    cache = open_cache(
        qwen_store, StreamConfig(io_uring=io_uring, expert_slots=1, read_timeout_s=0)
    )
    cache.inject_fault(0, "delay", expert=2, count=1, delay_ms=300)
    rows, _ = cache.acquire(0, np.array([[2]], dtype=np.int32))
    RowChecker(qwen_store, cache).assert_row(0, int(rows[0, 0]), 2)


def test_read_timeout_is_validated():
    with pytest.raises(ValueError, match="read_timeout_s"):
        StreamConfig(read_timeout_s=-1)
