"""Checking pool rows against the blob files, byte for byte.

Shared by the cache invariant, fault and stress tests: a row handed out by the cache,
every mapped real-region slot and every published side row must hold exactly its
expert's record as the plain-Python reference reader (`ExpertStore.read_record`) sees it.
"""

import numpy as np

from engine.cache import ROW_PUBLISHED


class RowChecker:
    """Compares pool rows with the records of the store's blob files."""

    def __init__(self, store, cache):
        self.store, self.cache = store, cache
        self.specs = store.manifest.layers
        self.records = {
            (li, e): store.read_record(spec, e)
            for li, spec in enumerate(self.specs)
            for e in range(store.manifest.num_experts)
        }

    def row_bytes(self, li, row):
        pools = self.cache.pool(li)
        return b"".join(np.array(p[row]).tobytes() for p in pools)

    def assert_row(self, li, row, expert):
        want = self.records[(li, expert)]
        assert self.row_bytes(li, row) == want, f"layer {li} row {row} != expert {expert}"

    def assert_all_published(self):
        """Every mapped real slot and every published side row holds its expert.
        Returns how many rows were checked."""
        checked = 0
        for li in range(self.cache.num_layers):
            s = self.cache.snapshot(li)
            cap = len(s["slot_expert"])  # this layer's real slots: its side rows follow
            for slot, e in enumerate(s["slot_expert"]):
                if e >= 0:
                    self.assert_row(li, slot, int(e))
                    checked += 1
            for i, (e, state) in enumerate(zip(s["side_expert"], s["side_state"], strict=True)):
                if state == ROW_PUBLISHED:
                    self.assert_row(li, cap + i, int(e))
                    checked += 1
            assert len(s["side_expert"]) == 2 * self.cache.layer_side_slots[li]
        return checked


def acquire_and_check(checker, cache, li, ids):
    """acquire, stream the over-capacity misses, and check every row handed out."""
    arr = np.array(ids, dtype=np.int32).reshape(-1, 1)
    rows, missing = cache.acquire(li, arr)
    rows = rows.reshape(-1)
    for e, r in zip(ids, rows, strict=True):
        if r >= 0:
            checker.assert_row(li, int(r), e)
        else:
            assert e in missing
    placed = {e: int(r) for e, r in zip(ids, rows, strict=True) if r >= 0}
    assert len(set(placed.values())) == len(placed), "two experts share a row"
    for start in range(0, len(missing), cache.scratch_slots):
        chunk = missing[start : start + cache.scratch_slots]
        for e, r in zip(chunk, cache.load_scratch(li, chunk), strict=True):
            checker.assert_row(li, r, e)
