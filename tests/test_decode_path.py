"""The decode path needs no host synchronisation on the router's ids.

Each MoE layer call takes one of three paths (engine.streamed_layer): the device-side
table of a complete layer, the stream-ordered acquire primitive, or the synchronous path
with host ids (prefill over capacity). These tests pin down which path each call takes,
that building a decode step's graph does no cache work until MLX evaluates it (so no
host read of the ids happened), and that every path gives the resident logits.
"""

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import load_model

from engine.cache import open_cache
from engine.config import StreamConfig
from engine.model import load, resolve_store
from engine.streamed_layer import PLAN_STREAM, PLAN_SYNC, PLAN_TABLE

from rowcheck import RowChecker
from test_equality import PROMPT, assert_same, greedy_logits

NUM_EXPERTS, TOP_K = 8, 2  # the factories' models


@pytest.fixture(scope="module")
def model_dir(model_dirs):
    return model_dirs("qwen3_moe")


@pytest.fixture(scope="module")
def resident(model_dir):
    model, _ = load_model(model_dir)
    return greedy_logits(model)


def lookups(sm) -> int:
    t = sm.snapshot().totals()
    return t["hits"] + t["misses"]


def test_plan_per_call_shape_and_residency(model_dir):
    cache = open_cache(resolve_store(model_dir), StreamConfig())  # load() would fill it
    assert cache.plan(0, TOP_K, TOP_K) == PLAN_STREAM  # nothing resident yet
    assert cache.plan(0, len(PROMPT) * TOP_K, TOP_K) == PLAN_SYNC  # may exceed the slots
    for e in range(NUM_EXPERTS):
        cache.acquire(0, np.array([[e]], dtype=np.int32))
    before = cache.snapshot(0)["stats"]["hits"]
    assert cache.plan(0, TOP_K, TOP_K) == PLAN_TABLE  # complete: one token uses the table
    assert cache.snapshot(0)["stats"]["hits"] == before + TOP_K
    # Any call of a complete layer takes the table; a longer one's lookups go uncounted.
    assert cache.plan(0, len(PROMPT) * TOP_K, TOP_K) == PLAN_TABLE
    assert cache.snapshot(0)["stats"]["hits"] == before + TOP_K
    slots = cache.snapshot(0)["slot_expert"]
    table = np.array(cache.table(0))
    assert [int(slots[table[e]]) for e in range(NUM_EXPERTS)] == list(range(NUM_EXPERTS))
    assert np.array(cache.table(1)).tolist() == [-1] * NUM_EXPERTS  # layer 1 not complete

    cache.reset()
    assert cache.plan(0, TOP_K, TOP_K) == PLAN_STREAM


def test_a_layer_with_a_slot_for_every_expert_is_filled_at_load(model_dir):
    """Every expert is read at load, as resident mlx-lm reads its weights: the first
    decode step already takes the table, and decode never misses. With fewer slots
    nothing is read at load."""
    sm = load(model_dir, StreamConfig())
    t = sm.snapshot().totals()
    stride = sm.store.manifest.layers[0].stride
    layers = sm.cache.num_layers
    assert (t["loads"], t["misses"], t["hits"]) == (layers * NUM_EXPERTS, 0, 0)
    assert t["bytes_read"] == layers * NUM_EXPERTS * stride
    assert all(sm.cache.plan(li, TOP_K, TOP_K) == PLAN_TABLE for li in range(layers))
    greedy_logits(sm.model)  # a prefill and decode steps
    assert sm.snapshot().totals()["misses"] == 0
    t = load(model_dir, StreamConfig(expert_slots=NUM_EXPERTS - 1)).snapshot().totals()
    assert t["loads"] == t["bytes_read"] == 0


def test_the_first_layer_takes_its_side_rows_as_slots_and_can_become_complete(model_dir, resident):
    """Layer 0 is no prefetch target: with 2 x 1 side rows added to its 6 real slots it
    holds all 8 experts, is read at load and decodes from the table, while the layers
    prefetch predicts for keep 6 slots and stream; the logits stay the resident ones."""
    config = StreamConfig(expert_slots=NUM_EXPERTS - 2, side_slots=1, prefetch=True)
    sm = load(model_dir, config)
    layers = sm.cache.num_layers
    assert sm.cache.layer_slots == [NUM_EXPERTS] + [NUM_EXPERTS - 2] * (layers - 1)
    assert sm.cache.layer_side_slots == [0] + [1] * (layers - 1)
    assert sm.snapshot().totals()["loads"] == NUM_EXPERTS  # layer 0, at load
    assert_same(greedy_logits(sm.model), resident)
    per_layer = sm.snapshot().stats
    assert per_layer["misses"][0] == 0 and per_layer["misses"][1:].sum() > 0
    assert sm.cache.is_complete(0) and not any(map(sm.cache.is_complete, range(1, layers)))


def test_records_reach_the_pools_by_host_copy_without_a_gpu(model_dir):
    """Without MLX CUDA in the process the pools are host memory: plain memcpy, and
    each filled slot holds its expert's record byte for byte."""
    sm = load(model_dir, StreamConfig())
    assert sm.cache.pool_writes == "memcpy"
    assert (
        RowChecker(sm.store, sm.cache).assert_all_published() == sm.cache.num_layers * NUM_EXPERTS
    )


def test_plan_counts_pinned_slots(model_dir):
    sm = load(model_dir, StreamConfig(expert_slots=3))
    assert sm.cache.plan(0, 3, TOP_K) == PLAN_STREAM
    sm.cache.pin(0, 5)
    assert sm.cache.plan(0, 3, TOP_K) == PLAN_SYNC  # 2 evictable slots for 3 ids
    assert sm.cache.plan(0, 2, TOP_K) == PLAN_STREAM


def test_acquire_op_reads_ids_where_they_lie(model_dir):
    """The primitive reads the router's ids as they are: a strided slice of an
    argpartition (uint32), a transposed int64 array, a broadcast. Each maps to the rows
    the host acquire gives the same ids, in the shape of the ids; a non-integer dtype
    is refused when the op is built."""
    cache = open_cache(resolve_store(model_dir), StreamConfig(expert_slots=NUM_EXPERTS))
    scores = mx.array([[0.1, 0.9, 0.3, 0.8, 0.2, 0.7, 0.0, 0.5]])
    cases = {
        "argpartition slice": mx.argpartition(scores, kth=NUM_EXPERTS - 3, axis=-1)[:, -3:],
        "transposed int64": mx.array([[5, 0], [2, 7], [1, 1]], dtype=mx.int64).T,
        "broadcast": mx.broadcast_to(mx.array([[4], [6]], dtype=mx.uint8), (2, 3)),
    }
    for name, ids in cases.items():
        host_ids = np.array(ids).astype(np.int32)
        rows = cache.acquire_op(0, ids)
        mx.eval(rows)
        cache.raise_stream_error()
        assert rows.shape == ids.shape and rows.dtype == mx.int32, name
        expected, missing = cache.acquire(0, host_ids)
        assert not missing
        assert np.array(rows).tolist() == expected.tolist(), name
        slots = cache.snapshot(0)["slot_expert"]
        assert slots[np.array(rows)].tolist() == host_ids.tolist(), name
    with pytest.raises(ValueError, match="integer"):
        cache.acquire_op(0, mx.array([1.0, 2.0]))


@pytest.mark.parametrize("io_uring", [True, False], ids=["io_uring", "threads"])
def test_a_prompt_over_capacity_leaves_its_busiest_experts_in_a_cold_cache(model_dir, io_uring):
    """An over-capacity call lists its misses most-routed first, and the experts read into
    scratch rows fill the empty real slots (a row copy, not a second read): decode then
    starts with the prompt's busiest experts resident instead of an empty region."""
    store = resolve_store(model_dir)
    cache = open_cache(store, StreamConfig(expert_slots=2, scratch_slots=1, io_uring=io_uring))
    checker = RowChecker(store, cache)
    ids = np.array([[5], [5], [5], [3], [3], [1], [0], [7]], dtype=np.int32)
    rows, missing = cache.acquire(0, ids)
    assert missing == [5, 3, 0, 1, 7]  # 3 tokens, 2, then one each by id
    assert rows.reshape(-1).tolist() == [-1] * 8
    for e in missing:
        (row,) = cache.load_scratch(0, [e])
        checker.assert_row(0, row, e)
    s = cache.snapshot(0)
    assert sorted(s["slot_expert"].tolist()) == [3, 5]
    assert s["stats"]["loads"] == 5 and s["stats"]["misses"] == 5  # no read of its own
    assert checker.assert_all_published() == 2  # the two real slots hold their records
    rows, missing = cache.acquire(0, np.array([[5], [3]], dtype=np.int32))
    assert missing == [] and cache.snapshot(0)["stats"]["hits"] == 2
    assert cache.check() == ""


@pytest.mark.parametrize("slots", [2, 8], ids=["top_k", "all"])
def test_decode_step_graph_is_built_without_cache_work(model_dir, slots):
    """Building a decode step's graph reads no ids on the host: the cache has seen none
    of the step's lookups until the graph is evaluated."""
    sm = load(model_dir, StreamConfig(expert_slots=slots))
    kv = make_prompt_cache(sm.model)
    logits = sm.model(mx.array([PROMPT]), cache=kv)[:, -1]
    mx.eval(logits)
    if slots == NUM_EXPERTS:  # layers 0 and 1 complete, the others as the routing goes
        for li in (0, 1):
            sm.cache.acquire(li, np.arange(NUM_EXPERTS, dtype=np.int32))
    for _ in range(6):
        token = mx.argmax(logits, axis=-1)
        before = lookups(sm)
        logits = sm.model(token[:, None], cache=kv)[:, -1]
        at_build = lookups(sm) - before
        # Only table calls count their hits when planned (their layers' tables are
        # filled); a stream-ordered call does nothing until evaluated.
        tables = sum(int(np.array(sm.cache.table(li))[0]) >= 0 for li in range(4))
        assert at_build == tables * TOP_K, "a decode step read the router's ids before eval"
        mx.eval(logits)
        assert lookups(sm) - before == sm.cache.num_layers * TOP_K
        assert tables >= (2 if slots == NUM_EXPERTS else 0)


@pytest.mark.parametrize("slots", [1, 2, 3, 8])
def test_every_path_gives_the_resident_logits(model_dir, resident, slots):
    """Slots 1 (every decode call synchronous, over capacity), 2 and 3 (stream-ordered),
    8 (stream-ordered until each layer is complete, then the table)."""
    sm = load(model_dir, StreamConfig(expert_slots=slots))
    assert_same(resident, greedy_logits(sm.model))
    assert sm.cache.check() == ""


def test_read_error_in_the_stream_surfaces_on_the_host(model_dir):
    """A demand read that fails inside the stream-ordered acquire leaves valid rows and
    its error, with its own type, for the host: raise_stream_error() after the eval, or
    the next forward's first MoE layer. The cache stays consistent and works on."""
    from engine.cache import ExpertReadError

    sm = load(model_dir, StreamConfig(expert_slots=2))
    kv = make_prompt_cache(sm.model)
    logits = sm.model(mx.array([PROMPT]), cache=kv)[:, -1]
    mx.eval(logits)
    sm.cache.raise_stream_error()  # nothing pending
    sm.cache.inject_fault(1, "eio", count=10**6)
    match = r"\(layer 1, expert \d+\): read failed"  # naming the blob, or the file in place
    with pytest.raises(ExpertReadError, match=match):
        for _ in range(8):  # until layer 1 misses
            logits = sm.model(mx.argmax(logits, axis=-1)[:, None], cache=kv)[:, -1]
            mx.eval(logits)
            sm.cache.raise_stream_error()
    sm.cache.raise_stream_error()  # raised once, then cleared
    sm.cache.inject_fault(1, "eio", count=10**6)
    with pytest.raises(ExpertReadError, match=match):  # raised by the next forward instead
        for _ in range(8):
            logits = sm.model(mx.argmax(logits, axis=-1)[:, None], cache=kv)[:, -1]
            mx.eval(logits)
    sm.cache.inject_fault(1, "none", count=0)
    assert sm.cache.check() == ""


def test_generation_raises_a_stream_read_error_with_its_type():
    """The embedded model at top-k slots: the prompt's reads succeed, then layer 2 fails
    for good mid-reply. The reply ends with ExpertReadError naming the file (not MLX's
    RuntimeError), and every token yielded before it is the fault-free run's."""
    from engine.cache import ExpertReadError
    from engine.generate import prompt_tokens, stream_generate

    ref_sm = load(None, StreamConfig())
    prompt = prompt_tokens(ref_sm, "Once upon a time", chat=False)
    ref = [r.token for r in stream_generate(ref_sm, prompt, 24)]
    sm = load(None, StreamConfig(expert_slots=4))
    got = []
    # the blob, or in place the checkpoint's file
    with pytest.raises(ExpertReadError, match=r"(layer02\.blob|model\.safetensors) \(layer 2, "):
        for r in stream_generate(sm, prompt, max_tokens=24):
            got.append(r.token)
            if len(got) == 2:
                sm.cache.inject_fault(2, "eio", count=10**6)
    assert 2 <= len(got) < 24
    assert got == ref[: len(got)]
