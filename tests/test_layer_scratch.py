"""The layer scratch: an over-capacity call's misses in one set of rows per layout.

Where the pools are CUDA memory an over-capacity call puts every miss into the layer
scratch at its one host wait (`load_layer`), the next layer's predicted misses read into
page-locked staging meanwhile (`read_ahead`). On the CPU backend the same code runs on
host memory: these tests pin down that each row holds its expert's record, that a record
read ahead is not read again, that reads a layer did not use cost bytes but no rows, that
a failed read ahead is read again and a failed read is raised, that the host tier serves
it, and that a prefill through it gives the resident logits with the read-ahead on.
"""

import shutil
import time

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.utils import load_model

from engine._ext import AcquireMailbox
from engine.cache import ExpertReadError, open_cache
from engine.config import StreamConfig
from engine.model import load
from engine.store import ExpertStore

from rowcheck import RowChecker


def scratch_bytes(cache, li, row, bank=0):
    """The record in row `row` of layer-scratch bank `bank` of MoE layer `li`, as bytes."""
    return b"".join(np.array(a[row]).tobytes() for a in cache.layer_scratch(li, bank))


def stats(cache, li):
    s = cache.snapshot(li)["stats"]
    return {k: int(s[k]) for k in ("misses", "loads", "bytes_read", "host_hits", "read_errors")}


def test_each_miss_lands_in_its_row_and_fills_the_empty_slots(qwen_store):
    cache = open_cache(qwen_store, StreamConfig(expert_slots=2, io_uring=False))
    checker = RowChecker(qwen_store, cache)
    rows, missing = cache.acquire(1, np.arange(8, dtype=np.int32).reshape(-1, 2))
    assert len(missing) == 8 and (rows == -1).all()
    got = cache.load_layer(1, missing)
    assert sorted(got) == list(range(8))
    for e, r in zip(missing, got, strict=True):
        assert scratch_bytes(cache, 1, r) == checker.records[(1, e)]
    # The two most-routed (acquire's order) fill the empty real slots, as load_scratch does.
    assert sorted(cache.snapshot(1)["slot_expert"].tolist()) == sorted(missing[:2])
    assert checker.assert_all_published() == 2
    stride = qwen_store.manifest.layers[1].stride
    assert stats(cache, 1) == {
        "misses": 8,
        "loads": 8,
        "bytes_read": 8 * stride,
        "host_hits": 0,
        "read_errors": 0,
    }
    assert cache.check() == ""


def test_a_record_read_ahead_is_not_read_again(qwen_store):
    cache = open_cache(qwen_store, StreamConfig(expert_slots=2, io_uring=False))
    checker = RowChecker(qwen_store, cache)
    stride = qwen_store.manifest.layers[2].stride
    assert cache.read_ahead(2, [6, 1, 1, 4]) == 3  # duplicates read once
    got = cache.load_layer(2, [4, 6, 7])  # 1 read but not used; 7 not predicted
    for e, r in zip([4, 6, 7], got, strict=True):
        assert scratch_bytes(cache, 2, r) == checker.records[(2, e)]
    s = stats(cache, 2)
    assert (s["loads"], s["bytes_read"]) == (3, 4 * stride)  # 1 cost its bytes
    # Residents are not read ahead: 4 and 6 took the empty slots.
    assert cache.read_ahead(2, [4, 6, 5]) == 1


def test_a_read_ahead_for_another_layer_is_given_up(qwen_store):
    cache = open_cache(qwen_store, StreamConfig(expert_slots=2, io_uring=False))
    checker = RowChecker(qwen_store, cache)
    stride = qwen_store.manifest.layers[1].stride
    cache.read_ahead(1, [0, 1, 2, 3, 4, 5, 6, 7])
    time.sleep(0.5)  # eight records of a few kB from the page cache: long landed
    got = cache.load_layer(3, [2, 5])  # same layout: layer 1's staging rows are reused
    for e, r in zip([2, 5], got, strict=True):
        assert scratch_bytes(cache, 3, r) == checker.records[(3, e)]
    assert stats(cache, 3)["loads"] == 2
    # What layer 1's read-ahead landed before it was given up was read all the same.
    assert (stats(cache, 1)["bytes_read"], stats(cache, 1)["loads"]) == (8 * stride, 0)


def test_a_failed_read_ahead_is_read_again_and_a_failed_read_is_raised(qwen_store):
    cache = open_cache(qwen_store, StreamConfig(expert_slots=2, io_uring=False))
    checker = RowChecker(qwen_store, cache)
    cache.inject_fault(0, "corrupt", expert=3, count=2)  # the read ahead and its retry
    cache.read_ahead(0, [3, 4])
    got = cache.load_layer(0, [3, 4])
    for e, r in zip([3, 4], got, strict=True):
        assert scratch_bytes(cache, 0, r) == checker.records[(0, e)]
    cache.inject_fault(0, "eio", expert=5, count=10**6)
    with pytest.raises(
        ExpertReadError, match=r"layer00\.blob \(layer \d+, expert 5\): read failed"
    ):
        cache.load_layer(0, [5, 6])
    assert stats(cache, 0)["read_errors"] == 1  # 5's read; 6 landed
    assert cache.check() == ""


def test_a_bad_record_in_a_run_is_read_alone_and_named(qwen_store, tmp_path):
    """A layer's adjacent records are read in runs (BlobFile::read_run); one whose crc32
    fails in its run is read again on its own, and where it is bad on disk the load
    names it while its neighbours in the run land."""
    layer = qwen_store.manifest.layers[1]
    store_dir = shutil.copytree(qwen_store.path, tmp_path / "store")
    with open(store_dir / layer.file, "r+b") as f:
        f.seek(5 * layer.stride + 100)
        byte = f.read(1)[0]
        f.seek(-1, 1)
        f.write(bytes([byte ^ 0xFF]))
    # Two reader threads: runs of four of the eight records.
    config = StreamConfig(expert_slots=2, reader_threads=2, io_uring=False)
    cache = open_cache(ExpertStore(store_dir), config)
    checker = RowChecker(qwen_store, cache)
    assert cache.read_layer(1, 0) == 8
    with pytest.raises(
        ExpertReadError, match=r"layer01\.blob \(layer \d+, expert 5\): checksum mismatch"
    ):
        cache.load_whole(1, 0)
    assert stats(cache, 1)["read_errors"] == 1
    assert stats(cache, 1)["bytes_read"] == 7 * layer.stride  # the other seven landed
    cache.read_layer(2, 0)  # a layer with no bad record: every row holds its record
    cache.load_whole(2, 0)
    for e in range(8):
        assert scratch_bytes(cache, 2, e) == checker.records[(2, e)]
    assert cache.check() == ""


def test_a_fault_in_a_run_takes_one_of_its_records_two_attempts(qwen_store):
    """A record's armed fault takes its attempt in the run (BlobFile::read_run): one
    corrupt attempt is read again alone and lands; two fail the load, naming it."""
    config = StreamConfig(expert_slots=2, reader_threads=2, io_uring=False)
    cache = open_cache(qwen_store, config)
    checker = RowChecker(qwen_store, cache)
    cache.inject_fault(1, "corrupt", expert=5, count=1)
    cache.load_whole(1, 0)  # a load's own reads: runs of four
    for e in range(8):
        assert scratch_bytes(cache, 1, e) == checker.records[(1, e)]
    cache.inject_fault(2, "corrupt", expert=5, count=2)
    with pytest.raises(
        ExpertReadError, match=r"layer02\.blob \(layer \d+, expert 5\): checksum mismatch"
    ):
        cache.load_whole(2, 0)
    assert stats(cache, 2)["read_errors"] == 1
    assert cache.check() == ""


def test_the_host_tier_serves_the_layer_scratch_and_keeps_what_it_read(qwen_store):
    cache = open_cache(qwen_store, StreamConfig(expert_slots=1, side_slots=0, io_uring=False))
    mailbox = AcquireMailbox(cache, 16, max_ids=4, fill_slots=4, tier_slots=8)
    checker = RowChecker(qwen_store, cache)
    stride = qwen_store.manifest.layers[1].stride
    cache.load_layer(1, [4, 5])  # read from disk, kept in the tier; 4 takes the slot
    assert cache.read_ahead(1, [4, 5, 6]) == 1  # 4 resident, 5 in the tier
    got = cache.load_layer(1, [5, 6])
    for e, r in zip([5, 6], got, strict=True):
        assert scratch_bytes(cache, 1, r) == checker.records[(1, e)]
    s = stats(cache, 1)
    assert (s["host_hits"], s["loads"], s["bytes_read"]) == (1, 4, 3 * stride)
    del mailbox


def test_a_whole_layer_copies_every_expert_the_host_tier_holds(qwen_store):
    """A whole-layer load takes every record the tier holds from there, all in one write
    (StagedCopies.copy_cached), reads only the others, and each row holds its expert."""
    cache = open_cache(qwen_store, StreamConfig(expert_slots=1, side_slots=0, io_uring=False))
    mailbox = AcquireMailbox(cache, 16, max_ids=4, fill_slots=4, tier_slots=8)
    checker = RowChecker(qwen_store, cache)
    stride = qwen_store.manifest.layers[1].stride
    cache.load_layer(1, [2, 3, 5, 7])  # read, kept in the tier; 2 takes the slot
    cache.load_whole(1, 0)  # 2 from its slot, 3, 5 and 7 from the tier, 5 others read
    for e in range(8):
        assert scratch_bytes(cache, 1, e) == checker.records[(1, e)]
    s = stats(cache, 1)
    assert (s["host_hits"], s["bytes_read"]) == (3, (4 + 4) * stride)
    assert cache.host_tier[:2] == (8, 8)  # what was read the second time is kept too
    del mailbox


@pytest.fixture(scope="module")
def padded_store(model_dirs, tmp_path_factory):
    """A float olmoe store with expert biases, whose bias segments (136 and 264 bytes) are
    not multiples of 16: the host tier pads each segment to 16 bytes, so there the tier's
    layout and the rows' differ."""
    from engine.convert import convert

    model = model_dirs("olmoe", quantized=False, hidden=66, moe_intermediate=34, expert_bias=True)
    return ExpertStore(convert(model, tmp_path_factory.mktemp("stores") / "padded"))


@pytest.mark.parametrize("tier_slots", [3, 8])
@pytest.mark.parametrize("which", ["qwen", "padded"])
def test_every_row_holds_its_expert_whatever_the_host_tier_holds(request, which, tier_slots):
    """Loads of random misses and whole layers through a host tier of fewer slots than
    experts (placed by its policy) or of one per expert (expert e in slot e), on records
    whose segments are and are not multiples of 16 bytes: every row the loads return holds
    its expert's record, byte for byte."""
    store = request.getfixturevalue("qwen_store" if which == "qwen" else "padded_store")
    cache = open_cache(store, StreamConfig(expert_slots=1, side_slots=0, io_uring=False))
    mailbox = AcquireMailbox(cache, 16, max_ids=4, fill_slots=4, tier_slots=tier_slots)
    checker = RowChecker(store, cache)
    experts = store.manifest.num_experts
    rng = np.random.default_rng(tier_slots)
    for i in range(12):
        missing = rng.choice(experts, int(rng.integers(1, experts)), replace=False).tolist()
        for e, r in zip(missing, cache.load_layer(1, missing), strict=True):
            assert scratch_bytes(cache, 1, r) == checker.records[(1, e)]
        if i % 6 == 5:
            bank = i // 6
            cache.load_whole(1, bank)
            for e in range(experts):
                assert scratch_bytes(cache, 1, e, bank) == checker.records[(1, e)]
    assert int(stats(cache, 1)["host_hits"]) > 0
    assert cache.check() == ""
    del mailbox


@pytest.mark.parametrize("slots", [1, 3])
def test_a_prefill_through_the_layer_scratch_gives_the_resident_logits(model_dirs, slots):
    """Every layer over capacity, the next layer's misses read ahead from the router's
    prediction: the logits are resident's, each routed expert is loaded once per layer,
    and what was read ahead beyond them is counted in bytes only."""
    model_dir = model_dirs("qwen3_moe")
    prompt = mx.array([list(range(1, 100))])
    model, _ = load_model(model_dir)
    want = np.array(model(prompt))
    sm = load(model_dir, StreamConfig(expert_slots=slots))
    sm.predictor.layer_scratch = True
    routed = {}
    sm.predictor.on_acquire = lambda li, ids: routed.setdefault(li, set(ids.reshape(-1).tolist()))
    assert np.array_equal(want, np.array(sm.model(prompt)))
    snap = sm.snapshot()
    assert snap.stats["loads"].tolist() == [len(routed[li]) for li in range(sm.cache.num_layers)]
    stride = sm.store.manifest.layers[0].stride
    read = (snap.stats["bytes_read"] // stride).tolist()
    assert all(r >= len(routed[li]) for li, r in enumerate(read))
    assert sm.cache.check() == ""


def test_the_calls_hits_are_copied_in_beside_its_misses(qwen_store):
    cache = open_cache(qwen_store, StreamConfig(expert_slots=2, io_uring=False))
    checker = RowChecker(qwen_store, cache)
    ids = np.arange(8, dtype=np.int32).reshape(-1, 2)
    _, missing = cache.acquire(1, ids)
    cache.load_layer(1, missing)  # the two most routed take the real slots
    rows, missing = cache.acquire(1, ids)
    resident = [e for e in range(8) if e not in missing]
    hit_rows = [int(rows.reshape(-1)[e]) for e in resident]
    assert len(resident) == 2 and all(r >= 0 for r in hit_rows)
    got = cache.load_layer(1, missing, resident, hit_rows)
    assert sorted(got) == list(range(8))
    for e, r in zip(missing + resident, got, strict=True):
        assert scratch_bytes(cache, 1, r) == checker.records[(1, e)]
    with pytest.raises(IndexError, match="pool row 99 out of range"):
        cache.load_layer(1, [], [0], [99])
    with pytest.raises(ValueError, match="1 resident experts and 0 rows"):
        cache.load_layer(1, [], [0], [])


def greedy(model, prompt, steps=6, step_size=2048):
    """Greedy tokens of mlx-lm's `generate_step` over `prompt`, its prefill in chunks
    of `step_size` tokens."""
    from mlx_lm.generate import generate_step

    out = []
    for token, _ in generate_step(
        mx.array(prompt), model, max_tokens=steps, prefill_step_size=step_size
    ):
        out.append(int(token))
    return out


@pytest.mark.parametrize("slots", [1, 3])
def test_a_long_prompt_takes_whole_layers_and_gives_the_resident_logits(model_dirs, slots):
    """99 tokens of 2 ids each over 8 experts (over WHOLE_LAYER_IDS per expert): each
    layer's call puts its whole layer in a bank without reading the ids, every record
    read once per layer, the empty real slots filled in id order; the logits are
    resident's, cold and warm."""
    model_dir = model_dirs("qwen3_moe")
    prompt = mx.array([[1 + (i * 7) % 127 for i in range(99)]])
    model, _ = load_model(model_dir)
    want = np.array(model(prompt))
    sm = load(model_dir, StreamConfig(expert_slots=slots))
    sm.predictor.layer_scratch = True
    assert sm.predictor.takes_whole(prompt.size * 2)
    assert np.array_equal(want, np.array(sm.model(prompt)))
    snap = sm.snapshot()
    stride = sm.store.manifest.layers[0].stride
    assert snap.stats["overcap_calls"].tolist() == [1] * sm.cache.num_layers
    assert snap.stats["loads"].tolist() == [8] * sm.cache.num_layers
    assert snap.stats["bytes_read"].tolist() == [8 * stride] * sm.cache.num_layers
    assert (snap.stats["hits"] + snap.stats["misses"] == 0).all()  # the ids are not read
    assert [sorted(row) for row in snap.slot_expert] == [list(range(slots))] * sm.cache.num_layers
    # Again, warm: the resident experts are copied into the banks from their slots.
    assert np.array_equal(want, np.array(sm.model(prompt)))
    loads = sm.snapshot().stats["loads"].tolist()
    assert loads == [8 + 8 - slots] * sm.cache.num_layers
    assert sm.cache.check() == ""


def test_whole_layers_across_prefill_chunks_and_a_warm_cache_give_the_resident_tokens(
    model_dirs,
):
    """A prompt prefilled in chunks of 40 tokens (each chunk a forward of whole-layer
    calls, the first of each waiting for its input), then decode, twice on the same cache
    (the second time with the resident experts copied from their slots): mlx-lm's tokens."""
    model_dir = model_dirs("qwen3_moe")
    prompt = [1 + (i * 7) % 127 for i in range(129)]  # ids in the test models' vocabulary
    model, _ = load_model(model_dir)
    want = greedy(model, prompt, step_size=40)
    sm = load(model_dir, StreamConfig(expert_slots=3))
    sm.predictor.layer_scratch = True
    assert greedy(sm.model, prompt, step_size=40) == want
    assert greedy(sm.model, prompt, step_size=40) == want
    assert (sm.snapshot().stats["overcap_calls"] >= 6).all()
    assert sm.cache.check() == ""


def test_a_read_ahead_of_the_other_kind_is_given_up(qwen_store):
    """read_layer stages by expert id and read_ahead in order: each load takes only its
    own kind (a stopped forward may leave either behind), so the rows hold the right
    records either way."""
    cache = open_cache(qwen_store, StreamConfig(expert_slots=2, io_uring=False))
    checker = RowChecker(qwen_store, cache)
    cache.load_layer(1, [0, 1])  # 0 and 1 take the real slots
    assert cache.read_layer(1, 0) == 6  # 2..7, by id, into bank 0's staging
    got = cache.load_layer(1, [6, 2])  # in order: row 0 must hold 6, row 1 expert 2
    for e, r in zip([6, 2], got, strict=True):
        assert scratch_bytes(cache, 1, r) == checker.records[(1, e)]
    cache.read_ahead(2, [5, 3])
    cache.load_whole(2, 0)
    for e in range(8):
        assert scratch_bytes(cache, 2, e) == checker.records[(2, e)]


def test_a_hit_that_was_read_ahead_keeps_one_row(qwen_store):
    """A side hit can have been read ahead too (read_ahead leaves out real slots and the
    tier only): it keeps its staged row, and no two experts share a row."""
    cache = open_cache(
        qwen_store,
        StreamConfig(expert_slots=2, side_slots=2, side_lfu=True, sync=True, io_uring=False),
    )
    checker = RowChecker(qwen_store, cache)
    cache.prefetch(1, np.array([0, 1], np.int32))  # side rows, filled inline (sync)
    cache.read_ahead(1, [0, 1, 2, 3, 4, 5])
    rows, missing = cache.acquire(1, np.arange(8, dtype=np.int32).reshape(-1, 2))
    flat = rows.reshape(-1)
    resident = [e for e in range(8) if flat[e] >= 0]
    assert sorted(resident) == [0, 1] and sorted(missing) == [2, 3, 4, 5, 6, 7]
    got = cache.load_layer(1, missing, resident, [int(flat[e]) for e in resident])
    assert sorted(got) == list(range(8))
    for e, r in zip(missing + resident, got, strict=True):
        assert scratch_bytes(cache, 1, r) == checker.records[(1, e)]
    checker.assert_all_published()
    assert cache.check() == ""
