"""Demand reads through io_uring (ext/ring_reader.h): the bytes, the read rules and the
timeout, checked on the ring itself (tests/test_faults.py runs its faults both ways).

Every test here needs the kernel's io_uring; where the kernel has none (not Linux,
disabled, refused by seccomp) the cache says so (`io_uring` False) and they are skipped,
except the first, which says where it is expected.
"""

import re
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from engine import memory_plan
from engine.cache import (
    ChecksumError,
    ExpertReadError,
    ExpertReadTimeout,
    io_uring_depth,
    open_cache,
    snapshot,
)
from engine.config import StreamConfig

from rowcheck import RowChecker

NUM_EXPERTS = 8


def kernel_allows_io_uring() -> bool:
    """Linux with io_uring not disabled by sysctl (seccomp can still refuse it)."""
    knob = Path("/proc/sys/kernel/io_uring_disabled")
    return sys.platform.startswith("linux") and (
        not knob.exists() or knob.read_text().strip() == "0"
    )


def ring_cache(store, **kw):
    cache = open_cache(store, StreamConfig(io_uring=True, **kw))
    if not cache.io_uring:
        pytest.skip("no io_uring here: demand reads use the reader threads")
    return cache


def totals(cache):
    return snapshot(cache).totals()


def every_expert_delayed(store, cache, layer: int, delay_ms: int) -> float:
    """Seconds one call of every expert of `layer` takes through the ring with each read
    delayed `delay_ms`; each of its rows must hold its record."""
    cache.inject_fault(layer, "delay", count=NUM_EXPERTS, delay_ms=delay_ms)
    t0 = time.monotonic()
    rows, missing = cache.acquire(layer, np.arange(NUM_EXPERTS, dtype=np.int32).reshape(-1, 1))
    elapsed = time.monotonic() - t0
    assert missing == [] and totals(cache)["io_uring_reads"] == NUM_EXPERTS
    checker = RowChecker(store, cache)
    for e, r in enumerate(rows.reshape(-1).tolist()):
        checker.assert_row(layer, r, e)
    return elapsed


def test_the_ring_is_used_where_the_kernel_has_it(qwen_store):
    cache = open_cache(qwen_store, StreamConfig(expert_slots=2))
    off = open_cache(qwen_store, StreamConfig(expert_slots=2, io_uring=False))
    assert not off.io_uring and not snapshot(off).io_uring
    if not kernel_allows_io_uring():
        pytest.skip("io_uring disabled or not Linux")
    assert cache.io_uring and snapshot(cache).io_uring
    cache.acquire(0, np.array([[1], [2]], dtype=np.int32))
    off.acquire(0, np.array([[1], [2]], dtype=np.int32))
    assert (totals(cache)["io_uring_reads"], totals(cache)["loads"]) == (2, 2)
    assert (totals(off)["io_uring_reads"], totals(off)["loads"]) == (0, 2)


@pytest.mark.parametrize("uncached", [True, False], ids=["o_direct", "buffered"])
def test_ring_reads_every_record_byte_for_byte(qwen_store, uncached, monkeypatch):
    """Every record of every layer, read in one call per layer (more records than the
    ring has buffers, 3 here: they go through in turn), lands in its row unchanged."""
    monkeypatch.setattr(memory_plan, "io_uring_depth", lambda threads, top_k, stride: 3)
    cache = ring_cache(qwen_store, reader_threads=2, uncached_io=uncached)
    checker = RowChecker(qwen_store, cache)
    for li in range(cache.num_layers):
        assert cache.fill(li) == NUM_EXPERTS
    assert checker.assert_all_published() == cache.num_layers * NUM_EXPERTS
    t = totals(cache)
    assert t["io_uring_reads"] == t["loads"] == cache.num_layers * NUM_EXPERTS
    assert t["read_errors"] == 0
    assert t["bytes_read"] == t["loads"] * qwen_store.manifest.layers[0].stride


def test_ring_timeout_gives_up_and_never_writes_late(qwen_store):
    """A read held past read_timeout_s raises ExpertReadTimeout after about the timeout;
    the slot stays empty, its next owner keeps its bytes when the held read completes,
    and the ring keeps reading."""
    timeout_s, hang_ms = 0.2, 2500
    cache = ring_cache(qwen_store, expert_slots=1, read_timeout_s=timeout_s)
    checker = RowChecker(qwen_store, cache)
    cache.inject_fault(0, "delay", expert=3, count=1, delay_ms=hang_ms)
    t0 = time.monotonic()
    with pytest.raises(ExpertReadTimeout, match=r"layer00\.blob \(layer 0, expert 3\): read timed"):
        cache.acquire(0, np.array([[3]], dtype=np.int32))
    waited = time.monotonic() - t0
    # Well before the held read ends; the slack is for a loaded CI machine of few cores.
    assert timeout_s * 0.9 < waited < timeout_s + 1.0
    s = cache.snapshot(0)
    assert s["slot_expert"].tolist() == [-1] and s["stats"]["read_errors"] == 1
    rows, _ = cache.acquire(0, np.array([[4]], dtype=np.int32))
    assert rows.tolist() == [[0]]
    time.sleep(hang_ms / 1000 + 0.2)
    checker.assert_row(0, 0, 4)
    rows, _ = cache.acquire(0, np.array([[3]], dtype=np.int32))
    checker.assert_row(0, int(rows[0, 0]), 3)
    assert totals(cache)["io_uring_reads"] == 2 and cache.check() == ""


def test_ring_delay_shorter_than_the_timeout_is_only_slow(qwen_store):
    cache = ring_cache(qwen_store, expert_slots=2, read_timeout_s=2.0)
    cache.inject_fault(1, "delay", expert=5, count=1, delay_ms=150)
    t0 = time.monotonic()
    rows, _ = cache.acquire(1, np.array([[5], [6]], dtype=np.int32))
    assert time.monotonic() - t0 >= 0.14
    checker = RowChecker(qwen_store, cache)
    for e, r in zip([5, 6], rows.reshape(-1).tolist(), strict=True):
        checker.assert_row(1, r, e)
    assert totals(cache)["io_uring_reads"] == 2


def test_a_calls_misses_are_in_flight_together_whatever_the_reader_threads(qwen_store):
    """With one reader thread the ring still holds io_uring_depth = 8 of these small
    records (threads + 1 = 2 in flight would take four round trips for eight misses), so
    eight reads delayed 300 ms each land in about one delay."""
    small, huge = 61_440, 40 << 20
    assert io_uring_depth(1, 2, small) == 8 and io_uring_depth(8, 2, small) == 9
    assert io_uring_depth(1, 16, small) == 16
    assert io_uring_depth(3, 8, huge) == 4  # 8 buffers of 40 MiB: threads + 1 only
    assert io_uring_depth(1, 8, 16 << 20) == 4  # up to 64 MiB of buffers
    cache = ring_cache(qwen_store, expert_slots=NUM_EXPERTS, reader_threads=1)
    elapsed = every_expert_delayed(qwen_store, cache, 0, delay_ms=300)
    assert 0.29 <= elapsed < 0.9, elapsed  # four batches of two: at least 1.2 s


def test_a_ring_shallower_than_the_misses_reads_them_in_turns(qwen_store, monkeypatch):
    """Eight misses through a ring of 3 buffers: three rounds of delayed reads, and every
    row its record."""
    monkeypatch.setattr(memory_plan, "io_uring_depth", lambda threads, top_k, stride: 3)
    cache = ring_cache(qwen_store, expert_slots=NUM_EXPERTS, reader_threads=1)
    elapsed = every_expert_delayed(qwen_store, cache, 1, delay_ms=200)
    assert elapsed >= 0.59, elapsed  # 3 + 3 + 2


@pytest.mark.parametrize(
    ("kind", "count", "error"),
    [
        ("eio", 1, None),
        ("short_read", 1, None),
        ("corrupt", 1, None),
        ("eio", 2, r"read failed: Input/output error"),
        ("short_read", 2, r"short read: \d+ of \d+ bytes"),
        ("corrupt", 2, r"checksum mismatch: crc32 \d+, the manifest says \d+"),
    ],
)
def test_ring_retries_once(qwen_store, kind, count, error):
    """One bad attempt is retried (a re-read after a checksum mismatch); two fail the
    record with the same error text as the reader threads give, naming file, layer and
    expert, and leave its slot empty while the call's other record lands."""
    cache = ring_cache(qwen_store, expert_slots=3)
    checker = RowChecker(qwen_store, cache)
    cache.inject_fault(2, kind, expert=6, count=count)
    ids = np.array([[6], [1]], dtype=np.int32)
    if error is None:
        rows, _ = cache.acquire(2, ids)
        checker.assert_row(2, int(rows[0, 0]), 6)
        assert totals(cache)["io_uring_reads"] == 2
    else:
        with pytest.raises(ExpertReadError) as info:
            cache.acquire(2, ids)
        assert isinstance(info.value, ChecksumError) == (kind == "corrupt")
        assert re.search(rf"layer02\.blob \(layer 2, expert 6\): {error}", str(info.value))
        s = cache.snapshot(2)
        assert sorted(e for e in s["slot_expert"].tolist() if e >= 0) == [1]
        assert s["stats"]["read_errors"] == 1 and s["stats"]["io_uring_reads"] == 1
    checker.assert_all_published()
    assert cache.check() == ""


def test_demand_reads_of_two_threads_share_the_ring_or_fall_back(qwen_store):
    """acquire on one thread while another pins (both demand reads): whichever finds the
    ring in use reads through the reader threads; every row holds its expert."""
    cache = ring_cache(qwen_store, expert_slots=NUM_EXPERTS, reader_threads=2)
    checker = RowChecker(qwen_store, cache)
    errors = []

    def pin_all(li):
        try:
            for e in range(NUM_EXPERTS // 2):
                cache.pin(li, e)
                cache.unpin(li, e)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    pinner = threading.Thread(target=pin_all, args=(3,))
    pinner.start()
    for li in range(3):
        cache.acquire(li, np.arange(NUM_EXPERTS, dtype=np.int32).reshape(-1, 1))
    pinner.join()
    assert errors == []
    assert checker.assert_all_published() == 3 * NUM_EXPERTS + NUM_EXPERTS // 2
    t = totals(cache)
    assert t["loads"] == 3 * NUM_EXPERTS + NUM_EXPERTS // 2 and t["read_errors"] == 0
    assert 0 < t["io_uring_reads"] <= t["loads"]
