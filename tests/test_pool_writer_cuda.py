"""The CUDA write path of ext/pool_writer.h on a machine without a GPU: a stand-in
runtime (tests/fake_cudart.c, built here as libcudart.so.12) is loaded before the native
core, which then writes pools through it. Each case runs in a fresh interpreter, as the
core looks the runtime up once per process."""

import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

SCRIPT = textwrap.dedent(
    """
    import ctypes, sys
    fake = ctypes.CDLL(sys.argv[1], mode=ctypes.RTLD_GLOBAL)
    import numpy as np
    from engine.cache import ExpertReadError, open_cache
    from engine.config import StreamConfig
    from engine.store import ExpertStore

    cache = open_cache(ExpertStore(sys.argv[2]),
                       StreamConfig(expert_slots=2, reader_threads=1,
                                    io_uring=sys.argv[3] == "1"))
    print("writes", cache.pool_writes)
    fake.fake_fail_at(2)  # the second segment of the first record read
    try:
        cache.acquire(0, np.array([[1]], dtype=np.int32))
        print("raised none")
    except ExpertReadError as e:
        print("raised", "invalid argument" in str(e))
    print("pending", fake.fake_pending())
    """
)


@pytest.fixture(scope="module")
def fake_cudart(tmp_path_factory):
    cc = shutil.which("cc")
    if cc is None:
        pytest.skip("no C compiler to build the stand-in CUDA runtime")
    out = tmp_path_factory.mktemp("cudart") / "libcudart.so.12"
    src = __file__.rsplit("/", 1)[0] + "/fake_cudart.c"
    subprocess.run(
        [cc, "-shared", "-fPIC", "-Wl,-soname,libcudart.so.12", "-o", str(out), src, "-lpthread"],
        check=True,
    )
    return out


def run_with(fake_cudart, script: str, *args: str) -> str:
    """Runs `script` in a fresh interpreter with the stand-in runtime's path and `args` as
    its arguments; returns what it printed (the core looks the runtime up once per
    process)."""
    out = subprocess.run(
        [sys.executable, "-c", script, str(fake_cudart), *args],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_a_failed_device_copy_leaves_no_copy_queued(fake_cudart, qwen_store, io_uring):
    """A record whose second segment's copy fails raises ExpertReadError naming the CUDA
    error, and copy() has waited for the first segment's copy before it returns: none is
    left queued to read the read buffer after it is reused, or to write the row after the
    row has another owner."""
    out = run_with(fake_cudart, SCRIPT, str(qwen_store.path), "1" if io_uring else "0")
    assert out.split("\n")[:3] == ["writes cuda", "raised True", "pending 0"]


COALESCED = textwrap.dedent(
    """
    import ctypes, sys
    fake = ctypes.CDLL(sys.argv[1], mode=ctypes.RTLD_GLOBAL)
    from engine.cache import open_cache
    from engine.config import StreamConfig
    from engine.store import ExpertStore

    store = ExpertStore(sys.argv[2])
    cache = open_cache(store, StreamConfig(expert_slots=4, side_slots=0, io_uring=False))
    before = fake.fake_copies()
    fake.fake_sync_delay_us(100000)  # every write waits 100 ms for its stream
    cache.load_whole(1, 0)
    print(fake.fake_copies() - before, len(store.manifest.layers[1].segments), flush=True)
    stats = cache.snapshot(1)["stats"]
    print(float(stats["copy_seconds"]), float(stats["acquire_seconds"]))
    """
)


def test_rows_that_continue_each_other_are_copied_as_one_span(fake_cudart, qwen_store):
    """A whole-layer load into an empty cache reads every expert into the bank's staging
    and fills the four empty slots with experts 0-3 from bank rows 0-3: one runtime copy
    per segment for the upload (consecutive rows) and one per segment for the fill
    (consecutive rows into consecutive slots), not one per expert and segment. The
    upload's write (one wait for its stream) is the load's `copy_seconds`; the fill's,
    made for the real region, is in `acquire_seconds` only."""
    out = run_with(fake_cudart, COALESCED, str(qwen_store.path))
    counts, seconds = out.splitlines()
    copies, segments = map(int, counts.split())
    assert copies == 2 * segments
    copy_s, acquire_s = map(float, seconds.split())
    assert 0.1 <= copy_s < 0.2 and acquire_s >= copy_s + 0.1


TIER = textwrap.dedent(
    """
    import ctypes, sys
    fake = ctypes.CDLL(sys.argv[1], mode=ctypes.RTLD_GLOBAL)
    import numpy as np
    from engine.cache import open_cache
    from engine.config import StreamConfig
    from engine.device_acquire import AcquireMailbox
    from engine.store import ExpertStore

    store = ExpertStore(sys.argv[2])
    layer = store.manifest.layers[1]
    experts = store.manifest.num_experts
    cache = open_cache(store, StreamConfig(expert_slots=2, side_slots=0, io_uring=False))
    mailbox = AcquireMailbox(cache, 16, max_ids=4, fill_slots=4, tier_slots=experts)
    cache.load_whole(1, 0)  # every expert read and kept; 0 and 1 take the real slots
    before = fake.fake_copies()
    cache.load_whole(1, 1)  # 0 and 1 from their slots, the others from the host tier
    after = fake.fake_copies()
    ok = all(
        b"".join(np.array(a[e]).tobytes() for a in cache.layer_scratch(1, 1))
        == store.read_record(layer, e)
        for e in range(experts)
    )
    stats = cache.snapshot(1)["stats"]
    print(after - before, len(layer.segments), int(stats["host_hits"]), experts, ok)
    """
)


def test_experts_that_follow_one_another_in_the_host_tier_are_copied_as_one_span(
    fake_cudart, qwen_store
):
    """With a host tier that holds every expert, a whole-layer load copies the experts
    the real slots do not hold from the tier in one runtime copy per segment (tier slots
    are segment-major, expert e in slot e), as the resident ones from their slots: two
    copies per segment in all, not one per expert and segment, and every row holds its
    expert's record."""
    out = run_with(fake_cudart, TIER, str(qwen_store.path))
    copies, segments, host_hits, experts, ok = out.split()
    assert int(copies) == 2 * int(segments)
    assert int(host_hits) == int(experts) - 2
    assert ok == "True"


def test_rows_of_two_segments_are_never_one_copy(fake_cudart, tmp_path):
    """Two segments' arrays can lie end to end in CUDA memory, and a device copy from one
    into the other fails: the last row of segment 0 and the first of segment 1, continuing
    each other in destination and source, are two runtime copies; the same spans as rows
    of one segment are one. Built from ext/pool_writer.cpp alone with a driver of its own."""
    cxx = shutil.which("c++") or shutil.which("g++")
    if cxx is None:
        pytest.skip("no C++ compiler to build the driver")
    tests = Path(__file__).parent
    driver = tmp_path / "merge"
    subprocess.run(
        [
            cxx,
            "-std=c++17",
            "-O1",
            f"-I{tests.parent / 'ext'}",
            "-o",
            str(driver),
            str(tests / "pool_writer_merge.cpp"),
            str(tests.parent / "ext" / "pool_writer.cpp"),
            "-ldl",
        ],
        check=True,
    )
    out = subprocess.run([str(driver), str(fake_cudart)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["cuda", "2", "1", "1"]


SLOT_ORDER = textwrap.dedent(
    """
    import ctypes, sys
    fake = ctypes.CDLL(sys.argv[1], mode=ctypes.RTLD_GLOBAL)
    import numpy as np
    from engine.cache import open_cache
    from engine.config import StreamConfig
    from engine.store import ExpertStore

    store = ExpertStore(sys.argv[2])
    layer = store.manifest.layers[1]
    cache = open_cache(store, StreamConfig(expert_slots=4, side_slots=0, io_uring=False))
    for e in (3, 2, 1, 0):  # slot 0 takes expert 3, ..., slot 3 expert 0
        cache.acquire(1, np.array([[e]], np.int32))
    slots = [int(cache.acquire(1, np.array([[e]], np.int32))[0][0, 0]) for e in range(4)]
    before = fake.fake_copies()
    rows = cache.load_layer(1, [4, 5], [0, 1, 2, 3], slots)
    after = fake.fake_copies()
    ok = all(
        b"".join(np.array(a[r]).tobytes() for a in cache.layer_scratch(1))
        == store.read_record(layer, e)
        for e, r in zip([4, 5, 0, 1, 2, 3], rows)
    )
    print(after - before, len(layer.segments), slots, ok)
    """
)


def test_resident_experts_in_consecutive_slots_are_copied_as_one_span(fake_cudart, qwen_store):
    """An over-capacity call's resident experts take layer-scratch rows in the order of
    their slots: experts 0-3 in slots 3-0 are one runtime copy per segment, as the two
    misses read into consecutive rows are (two per segment in all, not five), and every
    row holds its expert's record."""
    out = run_with(fake_cudart, SLOT_ORDER, str(qwen_store.path))
    copies, segments, rest = out.strip().split(maxsplit=2)
    slots, ok = rest.rsplit(" ", 1)
    assert slots == "[3, 2, 1, 0]"
    assert int(copies) == 2 * int(segments)
    assert ok == "True"


# A mailbox on the stand-in runtime with the fill stream on: expert 4 of layer 1 in the
# host tier, not in a real slot, a fill of it staged into a side row (`side`); the
# scripts below then queue it with a request of layer 0 from the hit table.
FILL_SETUP = textwrap.dedent(
    """
    import ctypes, sys
    fake = ctypes.CDLL(sys.argv[1], mode=ctypes.RTLD_GLOBAL)
    import numpy as np
    from engine.cache import open_cache
    from engine.config import StreamConfig
    from engine.device_acquire import AcquireMailbox
    from engine.store import ExpertStore

    store = ExpertStore(sys.argv[2])
    layer = store.manifest.layers[1]
    cache = open_cache(store, StreamConfig(expert_slots=2, side_slots=2, policy="lru",
                                           adaptive_prefetch=False, io_uring=False))
    mailbox = AcquireMailbox(cache, 16, max_ids=4, fill_slots=4, tier_slots=8)
    cache.set_staging(True)
    mailbox.fill_stream = True
    mailbox.post(1, np.array([4, 5], np.int32))
    mailbox.post(1, np.array([6, 7], np.int32))  # 4 and 5 evicted; the tier keeps them
    mailbox.post(0, np.array([1, 2], np.int32))
    mailbox.wait()
    cache.prefetch(1, np.array([4], np.int32))
    side = int(cache.snapshot(1)["side_expert"].tolist().index(4)) + 2
    row = lambda r: b"".join(np.array(a[r]).tobytes() for a in cache.pool(1))
    """
)

FILL_STREAM = FILL_SETUP + textwrap.dedent(
    """
    fake.fake_event_delay(3)  # each batch's event answers "not ready" three times
    before = fake.fake_copies()
    mailbox.post(0, np.array([2, 1], np.int32))  # from the hit table: the fill is queued
    mailbox.wait()  # until its event has passed
    print(mailbox.fill_batches[0], fake.fake_copies() - before >= len(layer.segments),
          fake.fake_pending(), row(side) == store.read_record(layer, 4))
    rows = mailbox.post(1, np.array([4], np.int32))
    print(int(rows[0]) == side, int(cache.snapshot(1)["stats"]["side_hits"]))
    """
)


def test_a_fill_batch_lands_through_the_runtime_events(fake_cudart, qwen_store):
    """The fill stream through the runtime: a fill the host tier holds is queued with
    cudaMemcpyAsync on the mailbox's copy stream after a request of another layer, and
    wait() returns only once the batch's event has passed (the stand-in does a stream's
    copies when an event of it passes: none is left queued, and the side row holds the
    expert's record); the layer's next request takes the side row."""
    out = run_with(fake_cudart, FILL_STREAM, str(qwen_store.path))
    assert out.split("\n")[:2] == ["1 True 0 True", "True 1"]


LATE_BATCH = FILL_SETUP + textwrap.dedent(
    """
    fake.fake_event_delay(1 << 30)  # no batch lands until fake_events_ready()
    mailbox.post(0, np.array([2, 1], np.int32))  # from the hit table: the fill is queued
    rows = mailbox.post(1, np.array([4], np.int32))  # its batch has not landed
    s = cache.snapshot(1)["stats"]
    held = row(int(rows[0])) == store.read_record(layer, 4)
    print(mailbox.fill_batches[0], int(rows[0]) < 2, held, int(s["side_hits"]),
          fake.fake_pending() > 0)
    fake.fake_events_ready()
    mailbox.wait()  # landed: the side row is published, holding the record
    print(row(side) == store.read_record(layer, 4), fake.fake_pending(), cache.check() == "")
    """
)


def test_a_side_row_is_handed_out_only_once_its_batch_has_landed(fake_cudart, qwen_store):
    """No kernel waits for the copy stream: a request for an expert whose fill batch has
    not landed (its event never passes here) is a miss, copied from the host tier into a
    real slot by the answer itself, while the batch's copy is still queued; once the
    event passes the side row is published, holding the expert's record."""
    out = run_with(fake_cudart, LATE_BATCH, str(qwen_store.path))
    assert out.split("\n")[:2] == ["1 True True 0 True", "True 0 True"]


FAILED_BATCH = FILL_SETUP + textwrap.dedent(
    """
    fake.fake_fail_at(1)  # the batch's first copy
    mailbox.post(0, np.array([2, 1], np.int32))  # from the hit table: the fill is queued
    mailbox.wait()
    try:
        cache.raise_stream_error()
        print("raised none")
    except RuntimeError as e:
        print("raised", "cudaMemcpyAsync failed: invalid argument" in str(e))
    rows = mailbox.post(1, np.array([4], np.int32))
    s = cache.snapshot(1)["stats"]
    print(int(rows[0]) < 2, row(int(rows[0])) == store.read_record(layer, 4), int(s["side_hits"]),
          4 not in cache.snapshot(1)["side_expert"].tolist(), cache.check() == "")
    """
)


def test_a_failed_fill_batch_frees_its_rows_and_is_raised(fake_cudart, qwen_store):
    """A fill batch whose copy the runtime refuses lands failed: the forward's error names
    the CUDA error, its side row is freed (never published with bytes that did not
    arrive), and the expert's next request is a miss served from the host tier."""
    out = run_with(fake_cudart, FAILED_BATCH, str(qwen_store.path))
    assert out.split("\n")[:2] == ["raised True", "True True 0 True True"]
