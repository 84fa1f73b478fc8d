"""The typed facade of the native expert cache: opening it, and reading its state as data.

`open_cache` turns an `ExpertStore` and a `StreamConfig` into an `engine._ext.ExpertCache`
(the pools, real regions, side ledgers and reader pool of docs/architecture.md; its
methods are typed and documented in `engine/_ext.pyi`), sized here: real slots, side and
scratch rows, reader threads and read buffers (`real_slots`, `pool_rows`,
`planned_pool_bytes`). `CacheSnapshot` is what the app polls: numpy arrays copied under
the cache's lock, safe to read on any thread; `pool_bytes` is the memory the pools hold.
Everything outside the engine (the app, the benchmarks) uses this module, never
`engine._ext` itself: the error types, the state codes and the counters' names are here
too.
"""

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import mlx.core as mx  # before the extension, which links against it
import numpy as np

from engine import _ext
from engine.config import (
    AUTO_MEMORY_FRACTION,
    ConfigError,
    PoolMemoryError,
    StreamConfig,
    check_budget,
)
from engine.memory import available_bytes, human_bytes
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
# real slots (expert_memory) or side rows (`layer_rows`) than the widest.
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


def default_reader_threads(top_k: int) -> int:
    """Reader threads when `StreamConfig.reader_threads` is None: min(8, 2 x usable CPUs)
    (reads wait on the disk far more than they compute, and uncached random reads gain
    bandwidth from several readers in flight), and never fewer than
    top_k - 1, so that one token's misses of a layer are all in flight together (the
    pool adds a demand-only thread). At most 16."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return min(16, max(min(8, 2 * (cpus or 1)), top_k - 1))


def reader_threads(store: ExpertStore, config: StreamConfig) -> int:
    """The reader threads the cache of `store` gets: `config.reader_threads`, or by
    default `default_reader_threads(top_k)`."""
    return config.reader_threads or default_reader_threads(store.manifest.top_k)


def layer_slots(records: list[int], num_experts: int, top_k: int, budget: int) -> list[int]:
    """Real-region slots per MoE layer for `budget` bytes of records in all layers
    together, each layer's slot costing its record size (records differ per layer in
    mixed-quantization models): top_k slots each first, then, round after round, one
    more slot for every layer that still fits it, smaller records first, up to every
    expert: every layer caches about the same share of its experts (a slot saves reads
    of its own record size, so a byte buys as much in every layer), and the bytes left
    over go to the layers of smaller records.

    Raises:
        ValueError: `budget` is below top_k records per layer (`check_budget`).
    """
    check_budget(budget, records, top_k)
    slots = [top_k] * len(records)
    left = budget - top_k * sum(records)
    order = sorted(range(len(records)), key=lambda li: (records[li], li))
    grew = True
    while grew:
        grew = False
        for li in order:
            if slots[li] < num_experts and records[li] <= left:
                slots[li] += 1
                left -= records[li]
                grew = True
    return slots


def real_slots(
    store: ExpertStore, config: StreamConfig, specs: Sequence[LayerSpec] | None = None
) -> list[int]:
    """Real-region slots of each of the MoE layers `specs` of `store` (default: all; a
    pipeline stage passes its own, and its expert_memory is its own) under `config`:
    expert_slots (every expert when None), or by expert_memory (`layer_slots`; "auto":
    `AUTO_MEMORY_FRACTION` of `engine.memory.available_bytes`, or of the physical memory
    where that is unknown).

    Raises:
        ConfigError: expert_slots, side_slots or scratch_slots exceed the store's expert
            count (`StreamConfig.check_experts`), or expert_memory is below top-k records
            per layer.
    """
    m = store.manifest
    specs = m.layers if specs is None else specs
    config.check_experts(m.num_experts)
    if config.expert_memory is None:
        return [m.num_experts if config.expert_slots is None else config.expert_slots] * len(specs)
    if not specs:
        return []
    budget = config.expert_memory
    if budget == "auto":
        known = available_bytes()
        if known is None:
            known = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        budget = int(AUTO_MEMORY_FRACTION * known)
    try:
        return layer_slots([s.record_bytes for s in specs], m.num_experts, m.top_k, budget)
    except ValueError as e:
        raise ConfigError("expert_memory", config.expert_memory, str(e)) from None


def layer_rows(
    store: ExpertStore,
    config: StreamConfig,
    specs: Sequence[LayerSpec] | None = None,
    targets: Sequence[bool] | None = None,
    real: Sequence[int] | None = None,
) -> tuple[list[int], list[int]]:
    """(real slots, side rows per bank) of each of the MoE layers `specs` of `store`
    (default: all) under `config`: `real` (default: `real_slots`), and side_slots for
    each prefetch target (`targets[i]`, from `engine.predictor.prefetch_targets`;
    default: every layer); `held_rows` says how.

    Raises:
        ConfigError: as `real_slots`.
    """
    real = real_slots(store, config, specs) if real is None else real
    return held_rows(real, config.side_slots, store.manifest.num_experts, targets)


def held_rows(
    real: Sequence[int],
    side_slots: int,
    num_experts: int,
    targets: Sequence[bool] | None = None,
) -> tuple[list[int], list[int]]:
    """(real slots, side rows per bank) the cache gives MoE layers of `real[i]` real
    slots under `side_slots`: side_slots rows per bank for each prefetch target
    (`targets[i]`; default: every layer).

    A layer that no layer prefetches for (the first, or one without a router) holds its
    2 x side_slots rows as real slots instead, up to every expert: no more memory, and
    fewer misses where no prediction can help (side rows nobody fills would sit empty).
    """
    side = [side_slots if targets is None or t else 0 for t in targets or real]
    held = [min(n + 2 * (side_slots - s), num_experts) for n, s in zip(real, side, strict=True)]
    return held, side


def pool_rows(
    real: Sequence[int],
    config: StreamConfig,
    num_experts: int,
    top_k: int,
    targets: Sequence[bool] | None = None,
) -> list[int]:
    """Pool rows of MoE layers of `real[i]` real slots under `config` (`targets` as
    `held_rows`): each layer's held real slots + 2 x its side rows + scratch_slots
    (`scratch_rows`). A row holds one record of its layer."""
    held, side = held_rows(real, config.side_slots, num_experts, targets)
    scratch = scratch_rows(config, top_k)
    return [n + 2 * s + scratch for n, s in zip(held, side, strict=True)]


def scratch_rows(config: StreamConfig, top_k: int) -> int:
    """Scratch rows per MoE layer under `config`: scratch_slots, or by default top_k, and
    1 (the least a pool has) where the pools are CUDA memory, whose over-capacity calls
    use the layer scratch instead (`cuda_pools`)."""
    return config.scratch_slots or (1 if cuda_pools() else top_k)


def planned_pool_bytes(
    store: ExpertStore,
    config: StreamConfig,
    specs: Sequence[LayerSpec] | None = None,
    targets: Sequence[bool] | None = None,
    real: Sequence[int] | None = None,
) -> tuple[int, int]:
    """(bytes, rows of the largest layer) the native cache will allocate for the MoE
    layers `specs` of `store` (default: all) under `config` (`engine._ext.planned_bytes`):
    every layer's pool (`pool_rows`; `targets` as there, `real` as `layer_rows`) and its
    expert table, plus one read buffer (a record's stride) per reader thread, and with
    `io_uring` one per demand read in flight (`io_uring_depth`); where the pools are CUDA
    memory, also the layer scratch of a long prompt (`layer_scratch_bytes`). More than
    `pool_bytes` of the opened cache, which counts the pools' records only."""
    m = store.manifest
    specs = m.layers if specs is None else specs
    real = real_slots(store, config, specs) if real is None else real
    rows = pool_rows(real, config, m.num_experts, m.top_k, targets)
    largest = max((s.stride for s in specs), default=0)
    threads = reader_threads(store, config)
    depth = io_uring_depth(threads, m.top_k, largest) if config.io_uring else 0
    records = [s.record_bytes for s in specs]
    total = _ext.planned_bytes(rows, records, m.num_experts, threads, largest, depth)
    if cuda_pools():
        total += layer_scratch_bytes(specs, m.num_experts)
    return total, max(rows, default=0)


def cuda_pools() -> bool:
    """Whether the pools of a cache opened now are CUDA memory (MLX's default device is
    a CUDA GPU): its over-capacity calls then use the layer scratch
    (`Predictor.layer_scratch`)."""
    cuda = getattr(mx, "cuda", None)
    return mx.default_device() != mx.cpu and cuda is not None and cuda.is_available()


def layer_scratch_bytes(specs: Sequence[LayerSpec], num_experts: int) -> int:
    """Bytes of device memory the layer scratch of `specs` takes (`ExpertCache.
    layer_scratch`: two banks of num_experts records for each segment layout), and as
    many of page-locked host staging."""
    layouts = {
        tuple(
            (g.key, g.dtype, tuple(g.shape), g.offset, g.nbytes) for g in s.segments
        ): s.record_bytes
        for s in specs
    }
    return 2 * num_experts * sum(layouts.values())


def check_pool_fits(
    store: ExpertStore,
    config: StreamConfig,
    available: int | None,
    specs: Sequence[LayerSpec] | None = None,
    targets: Sequence[bool] | None = None,
    real: Sequence[int] | None = None,
) -> None:
    """Refuses pools that, with the dense weights the load holds beside them, exceed
    `available` bytes (None: unknown, nothing refused), for the MoE layers `specs` of
    `store` (default: all) sized as `layer_rows` sizes them (`targets`, `real` as
    there; by default every layer a prefetch target: no fewer bytes than any other
    targets give). The dense weights are `manifest.dense_bytes`; a pipeline
    stage (`specs` a part of the layers) counts its MoE layers' share of them, as it
    loads only its layers' weights.

    Raises:
        PoolMemoryError: naming the size asked for, the layers, rows and record size, the
            dense weights, and the flag to change (the sizing one the user gave).
    """
    need, rows = planned_pool_bytes(store, config, specs, targets, real)
    m = store.manifest
    specs = m.layers if specs is None else specs
    dense = m.dense_bytes * len(specs) // max(1, len(m.layers))
    if available is None or need + dense <= available:
        return
    largest = max((s.record_bytes for s in specs), default=0)
    what = (
        f"{store.path}: the expert pools need {human_bytes(need)} ({len(specs)} MoE "
        f"layers x {rows} rows (expert_slots + 2 x side_slots + scratch_slots) x records of "
        f"up to {human_bytes(largest)}{', and the layer scratch' if cuda_pools() else ''}) "
        f"and the dense weights {human_bytes(dense)}, "
        f"{human_bytes(need + dense)} together, but {human_bytes(available)} of memory "
        "is available"
    )
    raise PoolMemoryError(what, config)


def open_cache(
    store: ExpertStore,
    config: StreamConfig,
    specs: Sequence[LayerSpec] | None = None,
    targets: Sequence[bool] | None = None,
    real: Sequence[int] | None = None,
) -> _ext.ExpertCache:
    """Allocates the pools of the MoE layers `specs` of `store` (default: all; a pipeline
    stage passes its own) and opens their blob files. The cache's layer i is specs[i];
    `targets[i]`: whether layer i is a prefetch target (default: every layer); `real`:
    the real slots the config gives each (default: `real_slots`; a caller that keeps
    them passes its own, as expert_memory "auto" reads the memory available each time).

    Pool rows per layer: its real slots + 2 * its side rows (`layer_rows`: expert_slots
    or by expert_memory, side_slots where prefetch fills them) + scratch_slots, each one
    record (`stride` bytes at most) spread over the segment arrays. Nothing is read yet
    (see `fill_whole_layers`). An in-place store's layers read their segments from the
    checkpoint's files (`ExpertStore.segment_sources`).

    Raises:
        engine.cache.ExpertReadError: a blob file (or a file an in-place store reads)
            cannot be opened or has the wrong size.
        ConfigError: as `real_slots`.
        PoolMemoryError: the pools do not fit in the memory available (checked before
            anything is allocated; also when the native allocation itself fails).
    """
    m = store.manifest
    specs = m.layers if specs is None else specs
    if real is None:
        real = real_slots(store, config, specs)  # "auto": the memory available once
    slots, side = layer_rows(store, config, specs, targets, real)
    check_pool_fits(store, config, available_bytes(), specs, targets, real)
    layers = [
        {
            "layer": spec.layer,
            "path": str(store.records_path(spec)),
            "sources": [
                {"path": str(path), "offset": offset, "nbytes": nbytes}
                for path, offset, nbytes in store.segment_sources(spec)
            ],
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
            scratch_slots=scratch_rows(config, m.top_k),
            policy=config.policy,
            decay_every=config.decay_every,
            side_lfu=config.side_lfu,
            sync=config.sync,
            verify_checksums=config.verify_checksums,
            uncached_io=config.uncached_io,
            reader_threads=reader_threads(store, config),
            read_timeout_s=config.read_timeout_s,
            top_k=m.top_k,
            layer_slots=slots,
            layer_side_slots=side,
            io_uring=config.io_uring,
            io_uring_depth=io_uring_depth(
                reader_threads(store, config), m.top_k, max((s.stride for s in specs), default=0)
            ),
        )
    except MemoryError as e:  # the native allocation failed after all (see check_pool_fits)
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
            a layer that is no prefetch target has none, `layer_rows`).
        freq: (n, num_experts) float32, LFU frequency per expert.
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
        stats={k: np.array([p["stats"][k] for p in per]) for k in STAT_KEYS},
        inflight=cache.inflight,
        forward=cache.forward,
        io_uring=cache.io_uring,
    )
