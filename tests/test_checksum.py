"""Record checksums: zlib's crc32, large records split across helper threads (ext/checksum.h).

The split path must give zlib's value for every size (chunk edges included), under
concurrent callers, and a read of a large record must still catch a flipped byte in any
of its chunks.
"""

import os
import subprocess
import sys
import threading
import zlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine import _ext
from engine.cache import ChecksumError, open_cache
from engine.config import StreamConfig
from engine.store import ExpertStore
from engine.synthetic import tiny_config, write_store

SPLIT, CHUNK = 1 << 20, 256 << 10


@settings(max_examples=60, deadline=None)
@given(
    size=st.one_of(
        st.integers(0, 4096),
        st.integers(SPLIT - 2, SPLIT + 2),
        st.integers(SPLIT, 12 * CHUNK).map(lambda n: n - n % CHUNK),  # whole chunks
        st.integers(SPLIT, 12 * CHUNK),
    ),
    seed=st.integers(0, 2**32 - 1),
)
def test_equals_zlib_at_every_size(size, seed):
    data = np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8).tobytes()
    assert _ext.record_crc32(data) == zlib.crc32(data)


def test_concurrent_callers_each_get_their_own_crc():
    """More callers than helper threads, each with large buffers: every result is its
    own buffer's crc (chunks of one caller never mix with another's)."""
    buffers = [os.urandom(SPLIT + 7 * CHUNK + i) for i in range(8)]
    expected = [zlib.crc32(b) for b in buffers]
    wrong = []

    def check(i):
        for _ in range(20):
            if _ext.record_crc32(buffers[i]) != expected[i]:
                wrong.append(i)

    threads = [threading.Thread(target=check, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert wrong == []


@pytest.fixture(scope="module")
def large_store(tmp_path_factory):
    """2 MoE layers x 4 experts of about 1.5 MB (split in 6 chunks when checked)."""
    out = tmp_path_factory.mktemp("large") / "store"
    write_store(out, tiny_config(2, 4, 2, hidden=1024, moe_intermediate=768), group_size=32)
    return ExpertStore(out)


@pytest.mark.parametrize("io_uring", [True, False], ids=["io_uring", "threads"])
@pytest.mark.parametrize("where", ["first chunk", "last chunk"])
def test_a_flipped_byte_in_any_chunk_of_a_large_record_is_caught(large_store, where, io_uring):
    layer = large_store.manifest.layers[0]
    assert layer.record_bytes >= SPLIT
    expert = 2
    at = expert * layer.stride + (10 if where == "first chunk" else layer.record_bytes - 1)
    blob = large_store.path / "layer00.blob"
    original = blob.read_bytes()
    data = bytearray(original)
    data[at] ^= 0x01
    blob.write_bytes(bytes(data))
    try:
        cache = open_cache(large_store, StreamConfig(expert_slots=2, io_uring=io_uring))
        rows, _ = cache.acquire(0, np.array([0, 1], dtype=np.int32))  # intact records
        assert sorted(cache.snapshot(0)["slot_expert"].tolist()) == [0, 1]
        with pytest.raises(ChecksumError, match=r"layer00\.blob \(layer 0, expert 2\)"):
            cache.acquire(0, np.array([expert], dtype=np.int32))
        assert cache.check() == ""
    finally:
        blob.write_bytes(original)


FORK_CHILDREN = r"""
import os, signal, sys, threading, time, zlib
from engine import _ext

buf = os.urandom(1 << 20)
want = zlib.crc32(buf)
stop = False

def spin():
    while not stop:
        _ext.record_crc32(buf)

threads = [threading.Thread(target=spin) for _ in range(4)]
for t in threads:
    t.start()
hung = wrong = 0
for _ in range(int(sys.argv[1])):
    pid = os.fork()
    if pid == 0:
        os._exit(0 if _ext.record_crc32(buf) == want else 3)
    deadline = time.monotonic() + 3
    while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
        time.sleep(0.001)
    if done[0] == 0:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        hung += 1
        break
    elif os.waitstatus_to_exitcode(done[1]) != 0:
        wrong += 1
stop = True
for t in threads:
    t.join()
print(hung, wrong)
"""


def test_a_forked_child_checks_large_records():
    """fork() copies only the forking thread: a child whose parent had a thread inside the
    helper pool's lock at that instant (posting or taking a chunk) would wait for that lock
    forever. Four threads check 1 MiB buffers without pause while the parent forks
    children that each check one: each finishes with zlib's value (before the fix, 1
    child in 100 to 300 hung)."""
    out = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", FORK_CHILDREN, "500"],
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    )
    assert out.stdout.split() == ["0", "0"]  # children hung, children with a wrong crc
