"""The over-capacity prefill streamed through two scratch banks.

`ExpertCache.scratch_stream` splits a call's misses into chunks over the banks of the
scratch rows; each chunk's `scratch_step` op, ordered after the previous chunk's output,
releases the next chunk's read into the bank that output has finished with and waits for
its own. These tests pin down the split, that every chunk's rows hold its experts when
the computation after its step runs (while later chunks are read into the same rows),
that nothing is read before the graph is evaluated, that a failed read surfaces with its
type and maps no wrong bytes, and that a prefill through it reads each routed expert once
per layer and gives the resident logits.
"""

import re

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.utils import load_model

from engine.cache import ExpertReadError, open_cache
from engine.config import StreamConfig
from engine.model import load

from rowcheck import RowChecker

EXPERTS = [5, 3, 0, 1, 2, 6, 7]  # a cold layer's misses, in acquire's order (most routed first)
ROUNDS = 5


def chunk_bytes(cache, li, rows: mx.array) -> mx.array:
    """(len(rows), record bytes) uint8: the records in `rows` of each of the layer's
    pools, copied by a gather when evaluated."""
    parts = [mx.take(p, rows, axis=0).view(mx.uint8).reshape(rows.size, -1) for p in cache.pool(li)]
    return mx.concatenate(parts, axis=1)


def stream_and_copy(cache, li, experts):
    """Streams `experts` of layer `li` and copies each chunk's rows right after its step,
    each step after the previous copy; returns (stream, lazy copies)."""
    stream = cache.scratch_stream(li, experts)
    copies, y = [], None
    for c, (_, rows) in enumerate(stream.chunks):
        step = cache.scratch_step(stream, c, mx.array(rows, dtype=mx.int32), after=y)
        y = chunk_bytes(cache, li, step)
        copies.append(y)
    return stream, copies


@pytest.mark.parametrize(
    "scratch, banks, sizes, offsets",
    [
        (3, 2, [2, 1, 2, 1, 1], [0, 2, 0, 2, 0]),
        (4, 2, [2, 2, 2, 1], [0, 2, 0, 2]),
        (1, 1, [1] * 7, [0] * 7),
    ],
)
def test_chunks_alternate_between_two_banks(qwen_store, scratch, banks, sizes, offsets):
    cache = open_cache(qwen_store, StreamConfig(expert_slots=1, scratch_slots=scratch))
    stream = cache.scratch_stream(0, EXPERTS)
    assert (stream.layer, stream.banks) == (0, banks)
    base = cache.rows(0) - scratch
    chunks = [(experts, rows) for experts, rows in stream.chunks]
    assert [e for experts, _ in chunks for e in experts] == EXPERTS  # in order, once each
    assert [len(experts) for experts, _ in chunks] == sizes
    for (experts, rows), first in zip(chunks, offsets, strict=True):
        assert rows == [base + first + i for i in range(len(experts))]


@pytest.mark.parametrize("scratch", [1, 2, 3])
def test_each_chunk_holds_its_experts_when_the_next_op_reads_them(qwen_store, io_uring, scratch):
    """Every chunk is copied out after its step while the next chunks are read into the
    same banks: each copy holds its chunk's records. Building the graph reads nothing;
    evaluating it reads each expert once and leaves the first in the empty real slot."""
    cache = open_cache(
        qwen_store, StreamConfig(expert_slots=1, scratch_slots=scratch, io_uring=io_uring)
    )
    checker = RowChecker(qwen_store, cache)
    ids = np.array(EXPERTS + [5, 5, 3], dtype=np.int32).reshape(-1, 1)
    _, missing = cache.acquire(0, ids)
    assert missing == EXPERTS
    for rnd in range(ROUNDS):  # a read landing in a bank too early shows in some round
        stream, copies = stream_and_copy(cache, 0, missing)
        assert cache.snapshot(0)["stats"]["loads"] == 7 * rnd  # a built graph read nothing
        mx.eval(copies)
        cache.raise_stream_error()
        for (experts, _), copy in zip(stream.chunks, copies, strict=True):
            for e, got in zip(experts, np.array(copy), strict=True):
                assert got.tobytes() == checker.records[(0, e)], f"round {rnd}, expert {e}"
    stats = cache.snapshot(0)["stats"]
    assert (stats["loads"], stats["misses"], stats["read_errors"]) == (7 * ROUNDS,) * 2 + (0,)
    assert cache.snapshot(0)["slot_expert"].tolist() == [5]  # most routed, a row copy
    assert checker.assert_all_published() == 1
    assert cache.check() == ""


def test_a_failed_chunk_read_is_raised_with_its_type_and_maps_nothing(qwen_store, io_uring):
    cache = open_cache(qwen_store, StreamConfig(expert_slots=1, scratch_slots=2, io_uring=io_uring))
    cache.inject_fault(0, "eio", expert=0, count=10**6)
    _, copies = stream_and_copy(cache, 0, EXPERTS)
    mx.eval(copies)
    with pytest.raises(ExpertReadError, match=r"\(layer 0, expert 0\): read failed"):
        cache.raise_stream_error()
    cache.raise_stream_error()  # raised once, then cleared
    stats = cache.snapshot(0)["stats"]
    assert (stats["loads"], stats["read_errors"]) == (6, 1)
    assert RowChecker(qwen_store, cache).assert_all_published() == 1
    assert cache.check() == ""


def test_a_step_is_refused_without_the_previous_chunk_or_out_of_range(qwen_store):
    cache = open_cache(qwen_store, StreamConfig(expert_slots=1, scratch_slots=2))
    stream = cache.scratch_stream(0, EXPERTS)
    rows = mx.array(stream.chunks[1][1], dtype=mx.int32)
    with pytest.raises(ValueError, match="needs `after`"):
        cache.scratch_step(stream, 1, rows)
    with pytest.raises(IndexError, match="scratch chunk 7 out of range"):
        cache.scratch_step(stream, 7, rows, after=rows)
    with pytest.raises(ValueError, match="int32"):
        cache.scratch_step(stream, 0, rows.astype(mx.int64))
    other = open_cache(qwen_store, StreamConfig(expert_slots=1, scratch_slots=2))
    with pytest.raises(ValueError, match="another cache"):
        other.scratch_step(stream, 0, rows)
    with pytest.raises(IndexError, match="expert id 8 out of range"):
        cache.scratch_stream(0, [1, 8])


@pytest.mark.parametrize("layer_scratch", [False, True], ids=["streamed", "layer scratch"])
@pytest.mark.parametrize("scratch", [1, 2, 3, 5])
def test_an_over_capacity_prefill_reads_each_routed_expert_once(model_dirs, scratch, layer_scratch):
    """A cold cache of 2 slots and a 99-token prompt: every layer's call is over
    capacity; each routed expert is read once per layer and the logits are resident's,
    through the scratch stream and through the layer scratch (the path on MLX CUDA)."""
    model_dir = model_dirs("qwen3_moe")
    prompt = mx.array([list(range(1, 100))])
    model, _ = load_model(model_dir)
    want = np.array(model(prompt))
    sm = load(model_dir, StreamConfig(expert_slots=2, scratch_slots=scratch))
    sm.predictor.layer_scratch = layer_scratch
    routed = {}
    sm.predictor.on_acquire = lambda li, ids: routed.setdefault(li, set(ids.reshape(-1).tolist()))
    got = np.array(sm.model(prompt))
    sm.cache.raise_stream_error()
    assert np.array_equal(want, got)
    snap = sm.snapshot()
    assert (snap.stats["overcap_calls"] == 1).all()
    loads = snap.stats["loads"].tolist()
    assert loads == [len(routed[li]) for li in range(sm.cache.num_layers)]
    assert loads == snap.stats["misses"].tolist()
    assert sm.cache.check() == ""


@pytest.mark.parametrize("layer_scratch", [False, True], ids=["streamed", "layer scratch"])
def test_a_failed_read_in_an_over_capacity_prefill_is_raised_naming_the_record(
    model_dirs, layer_scratch
):
    """A record that cannot be read in a prefill over capacity: the forward raises
    ExpertReadError naming the file, layer and expert (from the layer scratch at once, or
    from the stream at the next layer's ids sync or the caller's check)."""
    sm = load(model_dirs("qwen3_moe"), StreamConfig(expert_slots=2, scratch_slots=2))
    sm.predictor.layer_scratch = layer_scratch
    sm.cache.inject_fault(1, "eio", count=10**6)
    where = re.escape(str(sm.store.records_path(sm.store.layer(1))))  # in place: a file in it
    with pytest.raises(
        ExpertReadError, match=rf"{where}(/\S+)? \(layer 1, expert \d+\): read failed"
    ):
        mx.eval(sm.model(mx.array([list(range(1, 100))])))
        sm.cache.raise_stream_error()


def test_a_reply_stopped_mid_prefill_leaves_no_read_for_later():
    """A prompt cache kept after a reply stopped inside its over-capacity prefill holds no
    lazy graph: the chunks its KV depends on were read before generate returned. Read
    later, inside the next reply's forward, they would write scratch rows that forward
    is using (replies over the server's prompt cache then differed)."""
    from mlx_lm.models.cache import make_prompt_cache

    from engine.generate import generate

    sm = load(None, StreamConfig(expert_slots=4, scratch_slots=2))  # the embedded model
    polls = iter(range(10**6))  # polled at every MoE layer call: stops at the fourth
    cache = make_prompt_cache(sm.model)
    r = generate(sm, list(range(1, 100)), 4, stop=lambda: next(polls) >= 3, prompt_cache=cache)
    assert r.stopped and r.tokens == []
    loads = int(sm.snapshot().stats["loads"].sum())
    assert loads > 0
    mx.eval([c.state for c in cache])
    assert int(sm.snapshot().stats["loads"].sum()) == loads
