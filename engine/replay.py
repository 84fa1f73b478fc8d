"""Replaying a routing trace through the native cache, and Belady's MIN: the one replay
engine of the budget advisor (`engine.advisor`) and the policy benchmark (`bench.policy`).

A trace gets a small synthetic store with its layer and expert counts (records of a few
KB, see `engine.synthetic.tiny_config`); every token's expert ids of every layer go
through `ExpertCache.acquire` of a fresh cache at a given real-region capacity, under:

- the native eviction policies (`engine.config.EVICTION_POLICIES`, see
  ext/real_region.h): `predictive` (the default), `lru`, `lfu` (frequency halving every
  256 calls), `lfu-da`, `s3-fifo`; and `lfu-nodecay` (`decay_every=0`). Where a trace
  holds router scores (recorded from the engine), every call is preceded by a `hint` with
  the token's router probabilities (top m recorded, the rest spread evenly), and
  `predictive-ids` (in `ROUTER_ONLY`) replays the predictive policy without them;
- `lfu+autopin`, `predictive+autopin`: that policy with the engine's autopin
  (`engine.autopin.repin`, pins dropped where they cost hits) between generate calls
  (trace segments; every `REPIN_EVERY` tokens when a trace has one segment), pinning the
  top experts by LFU frequency within the engine's budget (`engine.autopin.budget`:
  min(slots - top_k, floor(autopin_frac x slots))); calls left with fewer evictable slots
  than missing experts stream the misses through the scratch rows (`load_scratch`), as
  the engine does, and count as misses;
- `lfu+oracle`: the side region (`oracle_rows` rows: top_k, rounded up to even since the
  persistent LFU region spans both banks; SYNC fills) fed after each layer's acquire with
  the true ids of the next layer (the perfect predictor); it holds those rows more than
  the others, and its side hits were still reads, so its `hit_rate` may pass Belady's at
  the same capacity: its `fetch_hit_rate` (1 - loads / lookups) is bounded by Belady's at
  capacity + `oracle_rows` instead;
- `belady`: Belady's MIN, offline, in Python (`belady`): per layer, on a miss evict the
  resident expert (not wanted by the current token) whose next use is furthest away. It is
  optimal for any policy with the same capacity, so it is the ceiling of every demand
  policy above.

Lookups are counted as the native cache counts them: distinct experts per (token, layer).
Both replays take a `stop` callable, polled every token (every layer for Belady's), that
ends them early with `ReplayStopped` (the advisor yields to a starting reply).
"""

import math
from collections.abc import Callable
from pathlib import Path

import numpy as np

from engine import autopin
from engine.cache import open_cache, ratio, snapshot
from engine.config import EVICTION_POLICIES, StreamConfig
from engine.store import ExpertStore
from engine.synthetic import ensure_store, tiny_config
from engine.trace import Trace

POLICIES = (
    *EVICTION_POLICIES,
    "lfu-nodecay",
    "lfu+autopin",
    "predictive+autopin",
    "lfu+oracle",
)
ROUTER_ONLY = ("predictive-ids",)  # for traces with router scores
AUTOPIN_FRAC = 0.5
REPIN_EVERY = 256
_INF = math.inf


class ReplayStopped(Exception):
    """A replay's `stop` callable returned True."""


def trace_store(trace: Trace, root: str | Path) -> ExpertStore:
    """The tiny synthetic store for `trace`'s shape under `root` (made once)."""
    name = f"trace-store-{trace.num_layers}x{trace.num_experts}x{trace.top_k}"
    config = tiny_config(trace.num_layers, trace.num_experts, trace.top_k)
    return ExpertStore(ensure_store(Path(root) / name, config, group_size=32))


def oracle_rows(top_k: int) -> int:
    """Side rows of the `lfu+oracle` replay: top_k, rounded up to even (its persistent LFU
    side region is both banks of side_slots rows each)."""
    return 2 * ((top_k + 1) // 2)


def replay(
    store: ExpertStore,
    trace: Trace,
    capacity: int,
    policy: str,
    autopin_frac: float = AUTOPIN_FRAC,
    stop: Callable[[], bool] | None = None,
) -> dict:
    """Replays `trace` through a fresh native cache of `store` with `capacity` real slots
    under `policy` (one of POLICIES, or ROUTER_ONLY for a trace with router scores;
    `autopin_frac` is the +autopin policies' fraction).

    Returns:
        counters hits, misses, loads, side_hits, lookups, overcap_calls, pins_dropped
        (ints) and the rates hit_rate (hits / lookups) and fetch_hit_rate
        (1 - loads / lookups), None without a lookup (`engine.cache.ratio`).

    Raises:
        ValueError: unknown policy, or capacity outside [1, num_experts].
        ReplayStopped: `stop()` returned True.
    """
    if policy not in POLICIES + ROUTER_ONLY:
        raise ValueError(f"policy {policy!r} not in {POLICIES + ROUTER_ONLY}")
    hints = trace.router_ids is not None and policy != "predictive-ids"
    base, _, extra = policy.removesuffix("-ids").partition("+")
    k = trace.top_k
    oracle = extra == "oracle"
    cfg = StreamConfig(
        expert_slots=capacity,
        policy=base if base in EVICTION_POLICIES else "lfu",
        decay_every=0 if policy == "lfu-nodecay" else 256,
        side_slots=oracle_rows(k) // 2 if oracle else 0,
        side_lfu=True,
        sync=True,
        uncached_io=False,
        reader_threads=1,
    )
    cache = open_cache(store, cfg)
    ids = np.ascontiguousarray(trace.ids, dtype=np.int32)
    layers = trace.num_layers
    repin_at = set()
    budget = autopin.budget(capacity, k, autopin_frac)
    if extra == "autopin" and budget > 0:
        starts = trace.segments[trace.segments > 0]
        repin_at = (
            set(starts.tolist())
            if len(starts)
            else set(range(REPIN_EVERY, trace.num_tokens, REPIN_EVERY))
        )
    for t in range(trace.num_tokens):
        if stop is not None and stop():
            raise ReplayStopped(f"replay stopped at token {t}")
        if t in repin_at:
            cache.drain()
            autopin.repin(cache, budget)
        row = ids[t]
        dense = trace.router_dense(t) if hints else None
        for li in range(layers):
            if hints:
                cache.hint(li, dense[li])
            _, missing = cache.acquire(li, row[li])
            for start in range(0, len(missing), cache.scratch_slots):
                cache.load_scratch(li, missing[start : start + cache.scratch_slots])
            if oracle and li + 1 < layers:
                cache.prefetch(li + 1, row[li + 1])
    cache.drain()
    t = snapshot(cache).totals()
    lookups = t["hits"] + t["misses"]
    return {
        "hits": t["hits"],
        "misses": t["misses"],
        "loads": t["loads"],
        "side_hits": t["side_hits"],
        "lookups": lookups,
        "overcap_calls": t["overcap_calls"],
        "pins_dropped": t["pins_dropped"],
        "hit_rate": t["hit_rate"],
        "fetch_hit_rate": ratio(lookups - t["loads"], lookups),
    }


def belady(trace: Trace, capacity: int, stop: Callable[[], bool] | None = None) -> dict:
    """Belady's MIN per layer with each token's experts requested together (none of
    them may be evicted for another). Returns hits, lookups, misses and hit_rate (None
    without a lookup).

    Raises:
        ValueError: capacity below the distinct experts of one token.
        ReplayStopped: `stop()` returned True.
    """
    hits = lookups = 0
    for li in range(trace.num_layers):
        if stop is not None and stop():
            raise ReplayStopped(f"Belady's MIN stopped at layer {li}")
        steps = [list(dict.fromkeys(r.tolist())) for r in trace.ids[:, li]]
        h, n = _belady_layer(steps, capacity)
        hits += h
        lookups += n
    return {
        "hits": hits,
        "lookups": lookups,
        "misses": lookups - hits,
        "hit_rate": ratio(hits, lookups),
    }


def _belady_layer(steps: list[list[int]], capacity: int) -> tuple[int, int]:
    nxt: list[list[float]] = [[] for _ in steps]
    last: dict[int, float] = {}
    for t in range(len(steps) - 1, -1, -1):
        nxt[t] = [last.get(e, _INF) for e in steps[t]]
        for e in steps[t]:
            last[e] = t
    cache: dict[int, float] = {}  # expert -> its next use
    hits = lookups = 0
    for t, step in enumerate(steps):
        lookups += len(step)
        new = []
        for e, n in zip(step, nxt[t], strict=True):
            if e in cache:
                hits += 1
            else:
                new.append(e)
            cache[e] = n
        over = len(cache) - capacity
        if over > 0:
            wanted = set(step)
            victims = sorted((e for e in cache if e not in wanted), key=lambda e: -cache[e])
            if len(victims) < over:
                raise ValueError(f"capacity {capacity} < distinct experts of one token")
            for e in victims[:over]:
                del cache[e]
    return hits, lookups
