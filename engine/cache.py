"""The typed facade of the native expert cache: opening it, and reading its state as data.

`open_planned` turns an `ExpertStore`, a `StreamConfig` and the load's memory plan
(`engine.memory_plan.MemoryPlan`: real slots, side and scratch rows, reader threads and
read buffers) into an `engine._ext.ExpertCache` (the pools, real regions, side ledgers and
reader pool of docs/architecture.md; its methods are typed and documented in
`engine/_ext.pyi`); `open_cache` plans and opens in one call. `CacheSnapshot` is what the
app polls: numpy arrays copied under the cache's lock, safe to read on any thread;
`pool_bytes` is the memory the pools hold.
Everything outside the engine (the app, the benchmarks) uses this module, never
`engine._ext` itself: the error types, the state codes and the counters' names are here
too.
"""

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import mlx.core  # noqa: F401  (before the extension, which links against it)
import numpy as np

from engine import _ext
from engine.config import PoolMemoryError, StreamConfig
from engine.memory_plan import MemoryPlan, plan_memory
from engine.store import ExpertStore, LayerSpec

ExpertCache = _ext.ExpertCache
ExpertReadError = _ext.ExpertReadError
ChecksumError = _ext.ChecksumError
ExpertReadTimeout = _ext.ExpertReadTimeout

# slot_state / side_state codes of a snapshot, as the native cache defines them.
SLOT_EMPTY = _ext.SLOT_EMPTY
SLOT_RESIDENT = _ext.SLOT_RESIDENT
SLOT_PINNED = _ext.SLOT_PINNED
SLOT_LOADING = _ext.SLOT_LOADING
SLOT_JUST_LOADED = _ext.SLOT_JUST_LOADED
ROW_FREE = _ext.ROW_FREE
ROW_IN_FLIGHT = _ext.ROW_IN_FLIGHT
ROW_PUBLISHED = _ext.ROW_PUBLISHED
# slot_state / side_state of a snapshot where a layer has no pool row: a layer with fewer
# real slots (expert_memory) or side rows (`engine.memory_plan.held_rows`) than the widest.
NO_ROW = _ext.NO_ROW
# Which library checks record checksums: "libdeflate" where the build found it, else "zlib".
CRC32_IMPLEMENTATION = _ext.crc32_implementation()
# What ExpertCache.plan returns: how a layer call gets its pool rows.
PLAN_TABLE = _ext.PLAN_TABLE
PLAN_STREAM = _ext.PLAN_STREAM
PLAN_SYNC = _ext.PLAN_SYNC
# Demand reads in flight through io_uring for (reader threads, top_k, record stride): the
# native cache's rule, documented there.
io_uring_depth = _ext.io_uring_depth

# The per-layer counters of a snapshot, in the native cache's order (`CacheSnapshot.stats`).
STAT_KEYS: tuple[str, ...] = tuple(_ext.STAT_KEYS)
# The rates derived from the counters (`rates`).
RATES = ("hit_rate", "prefetch_accuracy")
# What a reply's or the server's stats report of the cache: counters and rates.
REPORTED_STATS = (
    "hits",
    "misses",
    "hit_rate",
    "bytes_read",
    "side_hits",
    "prefetch_issued",
    "prefetch_used",
    "prefetch_wasted",
    "prefetch_accuracy",
    "evictions",
    "overcap_calls",
    "host_hits",
    "host_bytes",
)


def open_cache(
    store: ExpertStore,
    config: StreamConfig,
    specs: Sequence[LayerSpec] | None = None,
    targets: Sequence[bool] | None = None,
) -> _ext.ExpertCache:
    """`open_planned` with the plan of `config` (`engine.memory_plan.plan_memory` of
    `specs` and `targets`, as there): a cache outside a model load (the benchmarks, the
    replay, tests).

    Raises:
        as `plan_memory` and `open_planned`.
    """
    return open_planned(store, plan_memory(store, config, specs, targets), specs)


def open_planned(
    store: ExpertStore, plan: MemoryPlan, specs: Sequence[LayerSpec] | None = None
) -> _ext.ExpertCache:
    """Allocates the pools of the MoE layers `specs` of `store` (default: all; a pipeline
    stage passes its own) as `plan` sizes them (`engine.memory_plan.MemoryPlan`, checked
    against the memory available when it was made) and opens their blob files; the
    plan's config gives the rest (policy, reads, checksums). The cache's layer i is
    specs[i].

    Pool rows per layer: its real slots + 2 * its side rows + the scratch rows
    (`MemoryPlan.pool_rows`), each one record (`stride` bytes at most) spread over the
    segment arrays. Nothing is read yet (see `fill_whole_layers`).

    Raises:
        engine.cache.ExpertReadError: a blob file cannot be opened or has the wrong size.
        PoolMemoryError: the native allocation failed.
    """
    m, config = store.manifest, plan.config
    specs = m.layers if specs is None else specs
    slots, side = list(plan.layer_slots), list(plan.side_rows)
    layers = [
        {
            "layer": spec.layer,
            "path": str(store.blob_path(spec)),
            "stride": spec.stride,
            "record_bytes": spec.record_bytes,
            "checksums": list(spec.checksums),
            "segments": [
                {
                    "key": s.key,
                    "dtype": s.dtype,
                    "shape": list(s.shape),
                    "offset": s.offset,
                    "nbytes": s.nbytes,
                }
                for s in spec.segments
            ],
        }
        for spec in specs
    ]
    try:
        cache = _ext.ExpertCache(
            layers,
            m.num_experts,
            # a pipeline stage of dense layers only has no MoE layer to size by
            expert_slots=max(slots) if slots else (config.expert_slots or m.num_experts),
            side_slots=config.side_slots,
            scratch_slots=plan.scratch_rows,
            policy=config.policy,
            decay_every=config.decay_every,
            side_lfu=config.side_lfu,
            sync=config.sync,
            verify_checksums=config.verify_checksums,
            uncached_io=config.uncached_io,
            reader_threads=plan.reader_threads,
            read_timeout_s=config.read_timeout_s,
            top_k=m.top_k,
            layer_slots=slots,
            layer_side_slots=side,
            io_uring=config.io_uring,
            io_uring_depth=plan.io_uring_depth,
            adaptive_prefetch=config.adaptive_prefetch,
        )
    except MemoryError as e:  # the native allocation failed after all (see plan_memory)
        raise PoolMemoryError(f"{store.path}: {e}", config) from None
    return cache


def fill_whole_layers(cache: _ext.ExpertCache) -> int:
    """Reads every expert of each MoE layer whose real region holds them all
    (`ExpertCache.fill`), as resident mlx-lm reads every weight at load: such a layer is
    complete from the first token (the table path, no host work) instead of missing once
    per expert first, which a rarely routed expert can put off for a whole conversation.
    Returns the number of experts read (each one record, bytes_read counts them).

    Raises:
        engine.cache.ExpertReadError (and subclasses): a record cannot be read.
    """
    whole = [li for li, n in enumerate(cache.layer_slots) if n == cache.num_experts]
    return sum(cache.fill(li) for li in whole)


@dataclass(frozen=True)
class CacheSnapshot:
    """The cache's state at one instant, stacked over MoE layers (n = MoE layers).

    Attributes:
        slot_expert: (n, expert_slots) int32, expert in each real-region slot, -1 when empty.
        slot_state: (n, expert_slots) uint8, SLOT_* codes (NO_ROW past a layer's slots).
        side_expert: (n, 2 * side_slots) int32, expert of each side row (bank 0 then 1;
            the persistent LFU mode keeps one region over both banks' rows).
        side_state: (n, 2 * side_slots) uint8, ROW_* codes (NO_ROW past a layer's rows:
            a layer that is no prefetch target has none, `engine.memory_plan.held_rows`).
        freq: (n, num_experts) float32, LFU frequency per expert.
        degree: (n,) int32, the experts of a prediction each layer fills now (its
            prefetch degree: at most its side rows, `StreamConfig.adaptive_prefetch`).
        threshold: the usefulness a fill must reach in the forward under way, and
            `kept_threshold` the one the throttle settled on (`ExpertCache.
            prefetch_threshold`; 0 without adaptive prefetch: every side row).
        stats: {key: (n,) array} per-layer counters, keys `STAT_KEYS` (read_seconds and
            acquire_seconds in seconds: time reading records, and time inside acquire
            calls with their demand reads; bytes_read in bytes; the rest counts;
            read_errors: reads that failed or timed out after their retry, demand and
            prefetch; pins_dropped: pins the cache dropped because they cost hits, see
            engine.autopin; promotions: side hits copied into the real region, and
            promotions_declined: side hits left in their side row because no slot was
            free of the call's experts and pins or the policy kept every occupant;
            prefetch_late: misses whose fill was already being read, waited for instead
            of read again, counted among side_hits; io_uring_reads: records demand-read
            through io_uring, counted among loads).
        inflight: side-region fills in flight, all layers.
        forward: forward passes begun so far.
        io_uring: whether demand reads go through io_uring (`StreamConfig.io_uring` and
            the kernel has it), else the reader threads read them.
    """

    slot_expert: np.ndarray
    slot_state: np.ndarray
    side_expert: np.ndarray
    side_state: np.ndarray
    freq: np.ndarray
    degree: np.ndarray
    threshold: float
    kept_threshold: float
    stats: dict
    inflight: int
    forward: int
    io_uring: bool

    def totals(self) -> dict:
        """Counters summed over layers (`STAT_KEYS`: ints, floats for the *_seconds),
        plus `rates` (None where undefined) and `inflight`."""
        t = {
            k: float(v.sum()) if k.endswith("_seconds") else int(v.sum())
            for k, v in self.stats.items()
        }
        return t | rates(t) | {"inflight": self.inflight}


def ratio(num: float, den: float) -> float | None:
    """num / den, or None (JSON null) where den is 0: a rate of nothing (no lookup, no
    prefetch issued, no time), which a 0.0 would report as measured."""
    return num / den if den else None


def rates(counters: Mapping[str, float]) -> dict[str, float | None]:
    """The `RATES` of cache counters (totals or deltas with `STAT_KEYS`' keys): hit_rate
    (hits / lookups, side hits counted among hits) and prefetch_accuracy (used /
    issued), each None where nothing was looked up / prefetched (`ratio`)."""
    return {
        "hit_rate": ratio(counters["hits"], counters["hits"] + counters["misses"]),
        "prefetch_accuracy": ratio(counters["prefetch_used"], counters["prefetch_issued"]),
    }


def pool_bytes(cache: _ext.ExpertCache) -> int:
    """Bytes the pools of `cache` hold, all MoE layers: rows x record bytes each."""
    return sum(a.nbytes for li in range(cache.num_layers) for a in cache.pool(li))


def snapshot(cache: _ext.ExpertCache) -> CacheSnapshot:
    """Copies the state of every layer of `cache` (thread-safe; each layer is copied
    under the cache's lock, so layers may differ by one call in a live run). A layer with
    fewer real slots or side rows than the widest is padded with expert -1 in state
    NO_ROW."""
    per = [cache.snapshot(li) for li in range(cache.num_layers)]

    def padded(key, width, fill):  # a pipeline stage may hold no MoE layer
        rows = [np.pad(p[key], (0, width - len(p[key])), constant_values=fill) for p in per]
        return np.stack(rows) if per else np.full((0, width), fill, np.asarray(fill).dtype)

    slots, side_rows = cache.expert_slots, 2 * cache.side_slots
    return CacheSnapshot(
        slot_expert=padded("slot_expert", slots, np.int32(-1)),
        slot_state=padded("slot_state", slots, np.uint8(NO_ROW)),
        side_expert=padded("side_expert", side_rows, np.int32(-1)),
        side_state=padded("side_state", side_rows, np.uint8(NO_ROW)),
        freq=padded("freq", cache.num_experts, np.float32(0)),
        degree=np.array([p["prefetch_degree"] for p in per], np.int32),
        threshold=cache.prefetch_threshold,
        kept_threshold=cache.kept_prefetch_threshold,
        stats={k: np.array([p["stats"][k] for p in per]) for k in STAT_KEYS},
        inflight=cache.inflight,
        forward=cache.forward,
        io_uring=cache.io_uring,
    )
