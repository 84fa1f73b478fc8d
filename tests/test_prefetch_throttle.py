"""The prefetch degree: how many of a prediction's experts each layer fills, decided at
run time (ext/prefetch_throttle.h, `StreamConfig.adaptive_prefetch`)."""

import time

import numpy as np

from engine._ext import AcquireMailbox
from engine.cache import open_cache, snapshot
from engine.config import StreamConfig

# Pairs of experts routed to in turn (top-2 of 8): a real region of 2 slots holds the
# last pair, so the next one is never resident when it is predicted. Experts 6 and 7 are
# predicted at ranks 2 and 3 and never routed to.
PAIRS = [(0, 1), (2, 3), (4, 5)]
NEVER = (6, 7)


def landed(cache):
    """Waits until every fill in flight has landed (a drain would cancel queued ones)."""
    while cache.inflight:
        time.sleep(0.001)


def token(cache, layer, pair):
    """One decode step of `layer`: the prediction of `pair` (ranks 0, 1) and NEVER (ranks
    2, 3), then the call routed to `pair`."""
    cache.prefetch(layer, np.array([*pair, *NEVER], np.int32))
    landed(cache)
    rows, missing = cache.acquire(layer, np.array([pair], np.int32))
    assert missing == [] and rows.shape == (1, 2)


def test_a_fixed_degree_fills_every_side_row(qwen_store):
    cache = open_cache(
        qwen_store, StreamConfig(expert_slots=2, side_slots=4, adaptive_prefetch=False)
    )
    for t in range(12):
        token(cache, 1, PAIRS[t % 3])
    s = snapshot(cache)
    assert s.degree.tolist() == [4] * cache.num_layers and s.threshold == 0.0
    # a prediction fills the pair and both experts never routed to
    cache.reset()
    issued = s.stats["prefetch_issued"][1]
    cache.prefetch(1, np.array([2, 3, *NEVER], np.int32))
    landed(cache)
    assert snapshot(cache).stats["prefetch_issued"][1] - issued == 4


def test_ranks_never_routed_to_stop_being_filled(qwen_store):
    """Ranks 0 and 1 are always routed to, ranks 2 and 3 never: after a few predictions
    the layer fills two experts per prediction, not four, and its wasted fills stop."""
    cache = open_cache(qwen_store, StreamConfig(expert_slots=2, side_slots=4))
    assert snapshot(cache).degree.tolist() == [4] * cache.num_layers  # nothing scored yet
    for t in range(12):
        token(cache, 1, PAIRS[t % 3])
    s = snapshot(cache)
    assert s.degree[1] == 2 and s.degree[2] == 4  # layer 2 was never predicted
    assert s.threshold == 0.2  # 11 forwards ended: the sixth block, the neighbour's
    assert s.stats["misses"][1] == 0  # every pair was filled ahead
    # Emptied side rows (what the throttle measured stays): a prediction fills the pair.
    cache.reset()
    issued = s.stats["prefetch_issued"][1]
    cache.prefetch(1, np.array([2, 3, *NEVER], np.int32))
    landed(cache)
    s = snapshot(cache)
    assert s.stats["prefetch_issued"][1] - issued == 2
    assert sorted(e for e in s.side_expert[1].tolist() if e >= 0) == [2, 3]


def test_decode_forwards_alternate_two_at_a_time_with_a_neighbouring_threshold(qwen_store):
    """Each call of one layer begins a forward; the forward's threshold follows the
    blocks: two forwards at the kept one (0.1 on host pools), two at its neighbour."""
    cache = open_cache(qwen_store, StreamConfig(expert_slots=2, side_slots=4))
    seen = []
    for t in range(9):
        cache.acquire(1, np.array([PAIRS[t % 3]], np.int32))
        seen.append(cache.prefetch_threshold)
    # A forward ends when the next begins, and a block is two decode forwards; the first
    # forward of a cache (a prompt's, as a rule) is not compared.
    assert seen == [0.1, 0.1, 0.1, 0.2, 0.2, 0.1, 0.1, 0.2, 0.2]
    assert cache.kept_prefetch_threshold == 0.1
    # a prefill's forward (more ids than top-k) is not compared: the block waits for two
    # decode forwards
    seen = []
    for call in ([[0, 1], [2, 3]], [[4, 5]], [[0, 1]], [[2, 3]]):
        cache.acquire(1, np.array(call, np.int32))
        seen.append(cache.prefetch_threshold)
    assert seen == [0.1, 0.1, 0.1, 0.2]


def test_fills_staged_for_the_compute_stream_start_at_a_higher_threshold(qwen_store):
    """Staged writes (MLX CUDA's mailbox) deliver a fill as a copy on the compute stream,
    which costs about what the miss costs: the threshold starts at 0.6."""
    cache = open_cache(qwen_store, StreamConfig(expert_slots=2, side_slots=4, reader_threads=1))
    hidden = 64
    mailbox = AcquireMailbox(cache, hidden, max_ids=4, fill_slots=4)
    assert cache.prefetch_threshold == cache.kept_prefetch_threshold == 0.6
    del mailbox
