"""The memory plan of a load: every byte the expert cache and the dense weights take,
sized together against the memory available, once.

`plan_memory(store, config, specs, targets, fit_default)` turns a `StreamConfig` into a
`MemoryPlan` when a model loads (`engine.model.load`): the real slots of each MoE layer
(expert_slots, or expert_memory split by record size: `layer_slots`), the side rows
(`held_rows`), the scratch rows, the reader threads and their read buffers, the layer
scratch where the pools are CUDA memory, the acquire mailbox's staging and the host tier
(`StreamConfig.host_memory`) where the device acquire runs, and the dense weights; each
"auto" by the one rule (`auto_bytes`), and their sum checked once against
`engine.memory.available_bytes`. The cache (`engine.cache.open_planned`),
the predictor and the mailbox are built from the plan, and the front ends word their
messages from it (`MemoryPlan.words`): nothing sizes memory again after it.
"""

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

import mlx.core as mx  # before the extension, which links against it

from engine import _ext
from engine._ext import io_uring_depth
from engine.config import AUTO_MEMORY_FRACTION, ConfigError, PoolMemoryError, StreamConfig
from engine.memory import available_bytes, human_bytes
from engine.store import ExpertStore, LayerSpec


@dataclass(frozen=True)
class MemoryPlan:
    """What one load holds in memory, per MoE layer of the cache (in the order of its
    layer specs) and in all, and the memory it was checked against.

    Attributes:
        config: the StreamConfig planned: the one asked for, or expert_memory "auto" in
            its place where a front end's default did not fit (`fell_back`).
        real_slots: real slots per MoE layer as the config gives them (expert_slots, or
            by expert_memory: `layer_slots`).
        layer_slots: the pool's real slots per MoE layer: real_slots, plus the 2 x side
            rows a layer that no layer prefetches for holds as slots (`held_rows`).
        side_rows: side rows per bank of each MoE layer (0 where no layer prefetches).
        scratch_rows: scratch rows per MoE layer (`scratch_rows`).
        record_bytes: bytes of one record of each MoE layer.
        reader_threads: the reader threads of the cache (`reader_threads`).
        io_uring_depth: demand reads in flight through io_uring (0: io_uring off).
        pool_bytes: the pools, expert tables and read buffers (`engine._ext.planned_bytes`).
        layer_scratch_bytes: the layer scratch where the pools are CUDA memory (two banks
            of every expert of each segment layout), else 0.
        staging_bytes: the acquire mailbox's page-locked staging (`mailbox_ids` slots
            for a request's misses and `mailbox_fill_slots` for prefetch fills, each a
            tier slot's size) where the device acquire runs (MLX CUDA), else 0.
        tier_slots: host-tier slots per MoE layer (0: no tier; only on MLX CUDA with the
            device acquire, where the pools are not host memory).
        tier_bytes: the host tier's page-locked bytes, all layers.
        dense_bytes: the dense weights this load holds (a pipeline stage: its layers'
            share).
        available: the memory available it was checked against, bytes (None: unknown,
            nothing refused).
        asked: where the plan fell back to expert_memory "auto", the plan of the
            default it replaced (which did not fit), else None.
    """

    config: StreamConfig
    real_slots: tuple[int, ...]
    layer_slots: tuple[int, ...]
    side_rows: tuple[int, ...]
    scratch_rows: int
    record_bytes: tuple[int, ...]
    reader_threads: int
    io_uring_depth: int
    pool_bytes: int
    layer_scratch_bytes: int
    staging_bytes: int
    tier_slots: int
    tier_bytes: int
    dense_bytes: int
    available: int | None
    asked: "MemoryPlan | None" = None

    @property
    def expert_bytes(self) -> int:
        """The bytes the plan holds for experts: pools, layer scratch, the mailbox's
        staging and the host tier."""
        return self.pool_bytes + self.layer_scratch_bytes + self.staging_bytes + self.tier_bytes

    @property
    def total(self) -> int:
        """Every byte the plan holds: the experts' and the dense weights'."""
        return self.expert_bytes + self.dense_bytes

    @property
    def fell_back(self) -> bool:
        """Whether a front end's default size did not fit and expert_memory "auto" was
        planned instead (`plan_memory`'s fit_default)."""
        return self.asked is not None

    @property
    def pool_rows(self) -> list[int]:
        """Pool rows of each MoE layer: its real slots, 2 x its side rows and the scratch
        rows, one record each."""
        rows = zip(self.layer_slots, self.side_rows, strict=True)
        return [n + 2 * s + self.scratch_rows for n, s in rows]

    @property
    def mean_slots(self) -> int:
        """The real slots per MoE layer as one count (their mean, rounded; 0 for no
        layer): what the advisor sweeps from where layers differ (expert_memory)."""
        return round(sum(self.real_slots) / len(self.real_slots)) if self.real_slots else 0

    def slots_text(self) -> str:
        """The real slots per MoE layer as a user reads them: "12" or "12–13"."""
        lo, hi = min(self.real_slots, default=0), max(self.real_slots, default=0)
        return str(hi) if lo == hi else f"{lo}–{hi}"

    def words(self, names: Mapping[str, str] | None = None) -> str:
        """What the plan bought, in one line: slots per MoE layer and side rows, the pools'
        bytes, the host tier, the dense weights, and their sum against the memory
        available. With `names` ({StreamConfig field: a front end's name}) the setting
        that sized the real regions is named, e.g. "--expert-memory 6GiB: ..."."""
        names = names or {}
        c = self.config
        head = ""
        if c.expert_memory is not None:
            head = f"{names.get('expert_memory', 'expert_memory')} {c.expert_memory}: "
        elif c.expert_slots is not None:
            head = f"{names.get('expert_slots', 'expert_slots')} {c.expert_slots}: "
        side = max(self.side_rows, default=0)
        parts = [
            f"{self.slots_text()} slots per MoE layer"
            + (f" + 2 × {side} side rows" if side else "")
            + f", pools {human_bytes(self.pool_bytes)}"
        ]
        if self.layer_scratch_bytes:
            parts.append(f"layer scratch {human_bytes(self.layer_scratch_bytes)}")
        if self.staging_bytes:
            parts.append(f"acquire staging {human_bytes(self.staging_bytes)}")
        if self.tier_slots:
            parts.append(
                f"host tier {self.tier_slots} slots per layer {human_bytes(self.tier_bytes)}"
            )
        parts.append(f"dense weights {human_bytes(self.dense_bytes)}")
        tail = f"{human_bytes(self.total)} in all"
        if self.available is not None:
            tail += f" of the {human_bytes(self.available)} available"
        return f"{head}{', '.join(parts)}: {tail}"


def auto_bytes(want: int, left: int | None) -> int:
    """The one "auto" rule of every budget: `want` bytes, up to `AUTO_MEMORY_FRACTION` of
    `left`, the memory not yet planned (the physical memory where the memory available
    is unknown)."""
    if left is None:
        left = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return min(want, int(AUTO_MEMORY_FRACTION * max(0, left)))


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


def check_budget(budget: int, records: Sequence[int], top_k: int) -> None:
    """Refuses an expert-memory `budget` (bytes, all real regions together) below `top_k`
    records of every MoE layer (`records`: each layer's record bytes): a token's top_k
    experts of a layer must fit its real region together.

    Raises:
        ValueError: naming both sizes, top_k and the layers.
    """
    need = top_k * sum(records)
    if budget < need:
        raise ValueError(
            f"{human_bytes(budget)} is below the {human_bytes(need)} that top-k = {top_k} "
            f"experts per MoE layer take ({len(records)} layers)"
        )


def check_counts(config: StreamConfig, num_experts: int) -> None:
    """Refuses slot counts beyond a model's `num_experts` experts per MoE layer
    (checked when the store is known, before any pool is allocated).

    Raises:
        ConfigError: expert_slots, side_slots or scratch_slots > num_experts.
    """
    for name in ("expert_slots", "side_slots", "scratch_slots"):
        value = getattr(config, name)
        if value is not None and value > num_experts:
            raise ConfigError(
                name, value, f"must be <= {num_experts}, the model's experts per MoE layer"
            )


def check_real_slots(config: StreamConfig, top_k: int, records: Sequence[int]) -> None:
    """Refuses real regions below `top_k` experts per MoE layer, however they are sized:
    a token's `top_k` experts of a layer must fit its real region together, or every
    call reads some of them again. `records`: the record bytes of each MoE layer the
    budget covers. An "auto" budget is checked where it is resolved (`plan_memory`).

    Raises:
        ConfigError: expert_slots < top_k, or an expert_memory in bytes below `top_k`
            records of every layer (the message gives both sizes).
    """
    if config.expert_slots is not None and config.expert_slots < top_k:
        raise ConfigError(
            "expert_slots",
            config.expert_slots,
            f"must be >= {top_k}, the experts each token is routed to per MoE layer (top-k)",
        )
    if isinstance(config.expert_memory, int):
        try:
            check_budget(config.expert_memory, records, top_k)
        except ValueError as e:
            raise ConfigError("expert_memory", config.expert_memory, str(e)) from None


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
    `held_rows`): each layer's held real slots + 2 x its side rows + scratch rows
    (`scratch_rows`). A row holds one record of its layer."""
    held, side = held_rows(real, config.side_slots, num_experts, targets)
    scratch = scratch_rows(config, top_k)
    return [n + 2 * s + scratch for n, s in zip(held, side, strict=True)]


def scratch_rows(config: StreamConfig, top_k: int) -> int:
    """Scratch rows per MoE layer under `config`: scratch_slots, or by default top_k, and
    1 (the least a pool has) where the pools are CUDA memory, whose over-capacity calls
    use the layer scratch instead (`cuda_pools`)."""
    return config.scratch_slots or (1 if cuda_pools() else top_k)


def cuda_pools() -> bool:
    """Whether the pools of a cache opened now are CUDA memory (MLX's default device is
    a CUDA GPU): its over-capacity calls then use the layer scratch
    (`Predictor.layer_scratch`), and with the device acquire it may have a host tier."""
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


def tier_slot_bytes(specs: Sequence[LayerSpec]) -> int:
    """Bytes of one host-tier slot of the MoE layers `specs`: the widest record's
    (`engine._ext.staging_slot_size`), 0 for no layer."""
    return max((_ext.staging_slot_size(s.record_bytes, len(s.segments)) for s in specs), default=0)


def mailbox_ids(ids: int) -> int:
    """The most expert ids one request to the acquire mailbox takes, for requests of `ids`
    ids (a decode step's: top_k x max_batch): twice that, at least 16, at most
    `AcquireMailbox.MAX_IDS`. Each takes a staging slot, so that every miss of a request
    finds one."""
    return min(_ext.AcquireMailbox.MAX_IDS, max(2 * ids, 16))


def mailbox_fill_slots(budget: int) -> int:
    """Staging slots of the acquire mailbox for prefetch fills of `budget` experts per
    prediction (`Predictor.budget`): twice that (a layer's fills land while the next
    layer's are staged), at least 16."""
    return max(16, 2 * budget)


def tier_slots(
    host_memory: int | str | None, layers: int, num_experts: int, slot: int, left: int | None
) -> int:
    """Host-tier slots per MoE layer for `StreamConfig.host_memory` (bytes, "auto", or 0
    or None for none) over `layers` MoE layers of `num_experts` experts and `slot` bytes
    per slot: the budget split evenly among the layers, at most every expert; "auto" asks
    for every expert by the one rule (`auto_bytes` of `left`, the memory not yet
    planned). A budget in bytes is checked with the rest of the plan, not here."""
    if not host_memory or layers == 0 or slot == 0:
        return 0
    every = layers * num_experts * slot
    budget = auto_bytes(every, left) if host_memory == "auto" else min(int(host_memory), every)
    return min(num_experts, budget // (layers * slot))


def plan_memory(
    store: ExpertStore,
    config: StreamConfig,
    specs: Sequence[LayerSpec] | None = None,
    targets: Sequence[bool] | None = None,
    fit_default: bool = False,
    strict: bool = False,
    check: bool = True,
) -> MemoryPlan:
    """The memory plan of the MoE layers `specs` of `store` (default: all; a pipeline
    stage passes its own, and its expert_memory is its own) under `config`, checked once
    against the memory available (`engine.memory.available_bytes`, read once here).

    `targets[i]`: whether layer i is a prefetch target (`engine.predictor.
    prefetch_targets`; default: every layer, which holds no fewer bytes than any other
    targets). "auto" budgets take their share by `auto_bytes`: expert_memory of all the
    memory available, the host tier of what the pools, layer scratch and dense weights
    leave. `fit_default`: the pool size is a front end's default, not the user's; where
    the plan does not fit, expert_memory "auto" is planned instead (`MemoryPlan.
    fell_back`) rather than refused. `strict`: a front end's load, which refuses real
    regions below top-k (`check_real_slots`) as the user's mistake (a library caller may
    ask for them: calls then stream their misses through the scratch rows). `check`
    False: nothing is refused for the memory available (the advisor's plan of a budget
    it estimates, not loads).

    Raises:
        ConfigError: expert_slots, side_slots or scratch_slots above the store's expert
            count (`check_counts`), real regions below top-k (`strict`:
            `check_real_slots`), or an expert_memory below top-k records per layer.
        PoolMemoryError: the plan does not fit the memory available, naming the sizes,
            the layers, rows and record size, and the setting to change.
    """
    m = store.manifest
    specs = m.layers if specs is None else specs
    check_counts(config, m.num_experts)
    if strict:
        check_real_slots(config, m.top_k, [s.record_bytes for s in specs])
    available = available_bytes()
    plan = _plan(store, config, specs, targets, available)
    if not check or plan.available is None or plan.total <= plan.available:
        return plan
    if fit_default:
        auto = replace(config, expert_slots=None, expert_memory="auto")
        plan = replace(_plan(store, auto, specs, targets, available), asked=plan)
        if plan.total <= available:
            return plan
    raise PoolMemoryError(_too_large(store, plan, specs), plan.config)


def _plan(store, config, specs, targets, available) -> MemoryPlan:
    """`plan_memory` of one config, unchecked."""
    m = store.manifest
    records = [s.record_bytes for s in specs]
    if config.expert_memory is None:
        real = [m.num_experts if config.expert_slots is None else config.expert_slots] * len(specs)
    elif not specs:
        real = []
    else:
        budget = config.expert_memory
        if budget == "auto":
            budget = auto_bytes(sum(records) * m.num_experts, available)
        try:
            real = layer_slots(records, m.num_experts, m.top_k, budget)
        except ValueError as e:
            raise ConfigError("expert_memory", config.expert_memory, str(e)) from None
    held, side = held_rows(real, config.side_slots, m.num_experts, targets)
    scratch = scratch_rows(config, m.top_k)
    rows = [n + 2 * s + scratch for n, s in zip(held, side, strict=True)]
    stride = max((s.stride for s in specs), default=0)
    threads = reader_threads(store, config)
    depth = io_uring_depth(threads, m.top_k, stride) if config.io_uring else 0
    pools = _ext.planned_bytes(rows, records, m.num_experts, threads, stride, depth)
    cuda = cuda_pools()
    scratch_bytes = layer_scratch_bytes(specs, m.num_experts) if cuda else 0
    dense = m.dense_bytes * len(specs) // max(1, len(m.layers))
    slot = tier_slot_bytes(specs)
    staging = tier = 0
    if cuda and config.device_acquire:
        budget = min(config.side_slots, m.num_experts)
        ids = mailbox_ids(m.top_k * config.max_batch)
        staging = (ids + mailbox_fill_slots(budget)) * slot
    left = None if available is None else available - pools - scratch_bytes - staging - dense
    if cuda and config.device_acquire:
        tier = tier_slots(config.host_memory, len(specs), m.num_experts, slot, left)
    return MemoryPlan(
        config=config,
        real_slots=tuple(real),
        layer_slots=tuple(held),
        side_rows=tuple(side),
        scratch_rows=scratch,
        record_bytes=tuple(records),
        reader_threads=threads,
        io_uring_depth=depth,
        pool_bytes=pools,
        layer_scratch_bytes=scratch_bytes,
        staging_bytes=staging,
        tier_slots=tier,
        tier_bytes=tier * len(specs) * slot,
        dense_bytes=dense,
        available=available,
    )


def _too_large(store: ExpertStore, plan: MemoryPlan, specs: Sequence[LayerSpec]) -> str:
    """What a `PoolMemoryError` says of a plan that does not fit: each part's size and
    why (layers x rows x record size), their sum, and the memory available."""
    largest = max(plan.record_bytes, default=0)
    rows = max(plan.pool_rows, default=0)
    parts = [
        f"the expert pools need {human_bytes(plan.pool_bytes + plan.layer_scratch_bytes)} "
        f"({len(specs)} MoE layers x {rows} rows (expert_slots + 2 x side_slots + "
        f"scratch_slots) x records of up to {human_bytes(largest)}"
        f"{', and the layer scratch' if plan.layer_scratch_bytes else ''})"
    ]
    if plan.staging_bytes:
        parts.append(
            f"the acquire staging {human_bytes(plan.staging_bytes)} (for max_batch x top_k "
            "ids and the prefetch fills)"
        )
    if plan.tier_bytes:
        parts.append(
            f"the host tier {human_bytes(plan.tier_bytes)} ({plan.tier_slots} slots per layer)"
        )
    parts.append(f"the dense weights {human_bytes(plan.dense_bytes)}")
    return (
        f"{store.path}: {', '.join(parts[:-1])} and {parts[-1]}, "
        f"{human_bytes(plan.total)} together, but {human_bytes(plan.available)} of memory "
        "is available"
    )
