"""The budget advisor: what more (or less) expert memory would buy, from a routing trace.

`sweep` replays a trace (`engine.replay`, the policy benchmark's replay) at a range of
real-region budgets under the session's policy, LRU and Belady's MIN, giving hit rate vs
budget in slots per layer and in bytes. With the figures measured in the session that
recorded the trace (`Measured`), `estimate_tps` turns each budget's misses into decode
tokens/s: per token, the compute time measured at the current budget plus one read of
`record_bytes` at the measured read rate per miss that the host tier does not hold (a
miss the tier holds is a copy, which the measured time per token holds as it does the
compute). `advise` picks a budget and says it in one line. Measured figures are the
session's; everything at another budget is an estimate (the replay models the real
region only: prefetch into the side region is not replayed). `advice_for` is the one
advice session of the front ends (the CLI's `advise`, the app's Advisor tab): sweep,
estimate, advise.
"""

import importlib.util
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path

from engine.config import StreamConfig
from engine.memory import available_bytes, human_bytes
from engine.replay import AUTOPIN_FRAC, POLICIES, belady, replay, trace_store
from engine.safe_io import atomic_write
from engine.store_cache import store_cache_dir
from engine.trace import Trace

BELADY = "belady"
POINTS = 12


@dataclass(frozen=True)
class Budget:
    """What one real-region size costs.

    Attributes:
        slots_per_layer: the current expert_slots.
        pool_bytes: expert memory now: the records of every MoE layer's pool (real
            slots, side rows and scratch rows), bytes, as `engine.cache.pool_bytes`
            counts them (not the tables and read buffers `MemoryPlan.pool_bytes` adds).
        slot_bytes: bytes one more slot per layer costs (the sum of the layers' record
            sizes).
        record_bytes: bytes read per miss (mean record size over layers).
        tier_slots: host-tier slots per layer (`engine.memory_plan.MemoryPlan.
            tier_slots`; 0: no tier): a miss the tier holds is copied from host memory,
            not read.
    """

    slots_per_layer: int
    pool_bytes: int
    slot_bytes: int
    record_bytes: int
    tier_slots: int = 0

    @classmethod
    def of(cls, plan) -> "Budget":
        """The budget of a load's memory plan (`engine.memory_plan.MemoryPlan`): its
        real slots per layer (the largest standing for slots_per_layer where they differ:
        expert_memory) and its pools' records (the layers no layer prefetches for hold
        their side rows as slots, `engine.memory_plan.held_rows`)."""
        records = plan.record_bytes
        row = sum(records)  # a pool row holds one record per layer
        pool = sum(k * r for k, r in zip(plan.pool_rows, records, strict=True))
        return cls(max(plan.real_slots), pool, row, round(row / len(records)), plan.tier_slots)

    def bytes_at(self, slots: int) -> int:
        """Expert memory with `slots` real slots per layer, bytes."""
        return self.pool_bytes + (slots - self.slots_per_layer) * self.slot_bytes


@dataclass(frozen=True)
class Measured:
    """Figures measured in the session that recorded the trace.

    Attributes:
        decode_tps: decode tokens/s over the session's replies.
        read_Bps: bytes/s of one expert read (bytes_read / read_seconds).
        hit_rate: the session's hit rate, its prefill included (side hits count as
            hits). A forward of several tokens (the prompt) looks up each distinct expert
            of a layer once, mostly into a cold cache, where the replay looks up every
            token's experts one token at a time: this is lower than the replayed figure.
        decode_tokens: tokens the decode_tps is measured over.
        decode_hit_rate: the hit rate from the first generated token on (lookups per
            token, as the replay counts them; side hits count as hits); None where not
            measured apart.
    """

    decode_tps: float
    read_Bps: float
    hit_rate: float
    decode_tokens: int
    decode_hit_rate: float | None = None

    @classmethod
    def of(
        cls,
        decode_tps: float | None,
        decode_tokens: int,
        totals: Mapping | None,
        decode_hit_rate: float | None = None,
    ) -> "Measured | None":
        """The figures of a session that decoded `decode_tokens` tokens at `decode_tps`
        tokens/s, its cache counters `totals` (`engine.cache.CacheSnapshot.totals()`, or
        a reply's `cache`); None where nothing was measured: no decode step (a reply of
        one token) or no counters. A session that read nothing (every expert it routed
        was resident) is measured with read_Bps 0.0: its figures stand, and no tokens/s
        is estimated at other budgets (`estimate_tps`)."""
        if not decode_tps or decode_tokens <= 0 or totals is None:
            return None
        seconds = totals["read_seconds"]
        return cls(
            decode_tps=decode_tps,
            read_Bps=totals["bytes_read"] / seconds if seconds > 0 else 0.0,
            hit_rate=totals["hit_rate"],
            decode_tokens=decode_tokens,
            decode_hit_rate=decode_hit_rate,
        )


@dataclass
class Curve:
    """Hit rate vs budget of one trace.

    Attributes:
        slots: budgets swept, real slots per layer, ascending.
        bytes: expert memory at each budget (None without a `Budget`).
        hit_rate: {policy name: [hit rate per budget]}, with "belady" (Belady's MIN); a
            policy's is 1 - expert reads / lookups (its hit rate under demand loading;
            autopin's pin loads count as the reads they are).
        policy: the session's policy (a key of hit_rate).
        current: the session's slots per layer.
        lookups_per_token: lookups (distinct experts, all layers) per trace token.
        tps: estimated decode tokens/s per budget under `policy` (None without
            `Measured`).
        compute_s: the per-token time that is not an expert read, seconds (estimated
            from the measured figures; None without them).
        tokens: trace tokens replayed.
    """

    slots: list[int]
    bytes: list[int] | None
    hit_rate: dict[str, list[float]]
    policy: str
    current: int
    lookups_per_token: float
    tokens: int
    tps: list[float] | None = None
    compute_s: float | None = None
    measured: Measured | None = None
    budget: Budget | None = field(default=None, repr=False)

    def at(self, slots: int, policy: str | None = None) -> float:
        """Hit rate of `policy` (default: the session's) at `slots`."""
        return self.hit_rate[policy or self.policy][self.slots.index(slots)]

    def to_dict(self) -> dict:
        """Plain data (JSON-able)."""
        d = asdict(self)
        d.pop("budget")
        return d


def policy_of(policy: str, decay_every: int, autopin_frac: float) -> str:
    """The replay policy (`engine.replay.POLICIES`) of a StreamConfig's eviction
    settings."""
    if autopin_frac > 0:
        pinned = f"{policy}+autopin"
        return pinned if pinned in POLICIES else "lfu+autopin"
    if policy == "lfu" and decay_every == 0:
        return "lfu-nodecay"
    return policy


def budgets(num_experts: int, top_k: int, current: int | None = None, points: int = POINTS):
    """About `points` real-region sizes from top_k to num_experts, evenly spaced, with
    `current` among them."""
    span = num_experts - top_k
    picked = {top_k + round(span * i / max(1, points - 1)) for i in range(points)}
    if current is not None:
        picked.add(min(max(current, top_k), num_experts))
    return sorted(picked)


def sweep(
    trace: Trace,
    root: str | Path,
    policy: str = "lfu",
    current: int | None = None,
    slots: list[int] | None = None,
    autopin_frac: float = 0.0,
    stop: Callable[[], bool] | None = None,
) -> Curve:
    """Hit rate vs budget of `trace` under `policy`, LRU and Belady's MIN.

    Args:
        root: folder for the replay's tiny synthetic store (made once per trace shape).
        policy: one of `engine.replay.POLICIES`.
        current: the session's slots per layer (added to the budgets).
        slots: budgets to replay (default `budgets(...)`).
        autopin_frac: lfu+autopin's fraction.
        stop: polled during the replays; True ends the sweep (ReplayStopped).

    Raises:
        ValueError: an empty trace, an unknown policy, or a budget outside
            [top_k, num_experts].
        engine.replay.ReplayStopped: `stop()` returned True.
    """
    if trace.num_tokens == 0:
        raise ValueError("the trace has no tokens: generate some first")
    if policy not in POLICIES:
        raise ValueError(f"policy {policy!r} not in {POLICIES}")
    k, e = trace.top_k, trace.num_experts
    slots = sorted(slots or budgets(e, k, current))
    if slots[0] < k or slots[-1] > e:
        raise ValueError(f"budgets {slots}: each must be in [top-k {k}, {e} experts]")
    store = trace_store(trace, root)
    names = list(dict.fromkeys([policy, "lru"]))
    rates: dict[str, list[float]] = {p: [] for p in [*names, BELADY]}
    lookups = 0
    for c in slots:
        for p in names:
            r = replay(store, trace, c, p, autopin_frac or AUTOPIN_FRAC, stop)
            rates[p].append(r["fetch_hit_rate"])
            lookups = r["lookups"]
        rates[BELADY].append(belady(trace, c, stop)["hit_rate"])
    return Curve(
        slots=slots,
        bytes=None,
        hit_rate=rates,
        policy=policy,
        current=current if current in slots else slots[-1],
        lookups_per_token=lookups / trace.num_tokens,
        tokens=trace.num_tokens,
    )


def estimate_tps(curve: Curve, budget: Budget, measured: Measured | None) -> Curve:
    """Adds the budgets' bytes and, with `measured`, the estimated decode tokens/s.

    Per token, the read time at a budget is reads per token x record_bytes / read_Bps:
    the misses of the replayed hit rate at that budget, less those the host tier holds
    (`Budget.tier_slots`: the tier keeps what was read, so with t tier slots a budget
    of c slots reads as a real region of max(c, t) would, its hit rate interpolated
    between the budgets swept); the rest of the measured token time at the current
    budget is compute and copies, the same at every budget (at least a tenth of the
    token time: prefetch may hide reads the replay counts). Returns `curve`.
    """
    curve.budget = budget
    curve.bytes = [budget.bytes_at(c) for c in curve.slots]
    curve.measured = measured
    if measured is None or measured.decode_tps <= 0 or measured.read_Bps <= 0:
        return curve
    per_miss = budget.record_bytes / measured.read_Bps
    rates = curve.hit_rate[curve.policy]
    tier = _hit_at(curve.slots, rates, budget.tier_slots) if budget.tier_slots else 0.0
    reads = [(1.0 - max(h, tier)) * curve.lookups_per_token * per_miss for h in rates]
    token = 1.0 / measured.decode_tps
    compute = max(token - reads[curve.slots.index(curve.current)], 0.1 * token)
    curve.compute_s = compute
    curve.tps = [1.0 / (compute + r) for r in reads]
    return curve


def _hit_at(slots: list[int], rates: list[float], at: int) -> float:
    """The hit rate of a real region of `at` slots, linear between the budgets swept
    (`slots`, ascending; the last one's beyond it, the first one's below)."""
    if at >= slots[-1]:
        return rates[-1]
    if at <= slots[0]:
        return rates[0]
    i = next(i for i, s in enumerate(slots) if s >= at)
    lo, hi = slots[i - 1], slots[i]
    return rates[i - 1] + (rates[i] - rates[i - 1]) * (at - lo) / (hi - lo)


@dataclass(frozen=True)
class Advice:
    """The advisor's suggestion.

    Attributes:
        slots: suggested slots per layer (== the current when it is right).
        line: one sentence saying it.
    """

    slots: int
    line: str


# An estimated tokens/s within this fraction of the measured speed is not told apart
# from it: every estimate scales one measured decode speed, which moves by more than
# this between runs (docs/benchmarks.md, "Machines"), so a smaller change is not advice.
TPS_NOISE = 0.05
# Without an estimate of tokens/s: a hit rate within this fraction of the current one.
HIT_RATE_MARGIN = 0.03
# Memory given back is worth a change of budget from this fraction of the memory
# available on (of the current expert memory where that is unknown).
WORTH_FREEING = 0.01
WORTH_FREEING_OF_POOL = 0.10


def advise(curve: Curve, free_bytes: int | None = None, gain: float = 0.9) -> Advice:
    """The smallest budget that reaches `gain` of the best achievable improvement (in
    estimated tokens/s, or in hit rate without one) among the budgets that fit
    `free_bytes` more memory (`engine.memory.available_bytes`; None: no bound), where
    that improvement is more than the estimate's noise (`TPS_NOISE`; `HIT_RATE_MARGIN`
    of hit rate); else the smallest budget that keeps the speed within that noise, where
    the memory it gives back is worth it (`WORTH_FREEING` of `free_bytes` plus the
    current expert memory; `WORTH_FREEING_OF_POOL` of the current expert memory, or of
    the slots, where one is unknown); else the current budget.
    """
    cur = curve.slots.index(curve.current)
    score = curve.tps or curve.hit_rate[curve.policy]
    margin = TPS_NOISE if curve.tps else HIT_RATE_MARGIN
    fits = [
        i
        for i in range(len(curve.slots))
        if free_bytes is None
        or curve.bytes is None
        or curve.bytes[i] - curve.bytes[cur] <= free_bytes
    ]
    best = max(score[i] for i in fits)
    # The curve need not rise everywhere (a policy can lose a hit with a slot more), so
    # the best may lie below the current budget: then growing buys nothing.
    pick = next(
        (i for i in fits if i >= cur and score[i] >= score[cur] + gain * (best - score[cur])),
        cur,
    )
    if score[pick] <= (1 + margin) * score[cur]:
        pick = next(i for i in range(cur + 1) if score[i] >= (1 - margin) * score[cur])
        if not _worth_freeing(curve, pick, free_bytes):
            pick = cur
    belady_at = curve.hit_rate[BELADY][pick]
    what = "tokens/s" if curve.tps else "hit rate"
    if pick == cur:
        head = f"keep {curve.current} slots per layer"
        if curve.bytes is not None:
            head += f" ({human_bytes(curve.bytes[cur])} of expert memory)"
        rest = f"replayed hit rate {curve.at(curve.current):.0%}"
        if pick + 1 < len(curve.slots):
            rest += f", more memory buys at most {margin:.0%} {what}, within the estimate's noise"
        return Advice(
            curve.current, f"{head}: {rest}; the ceiling at this budget (Belady) is {belady_at:.0%}"
        )
    s = curve.slots[pick]
    head = f"{curve.current} → {s} slots per layer"
    if curve.bytes is not None:
        delta = curve.bytes[pick] - curve.bytes[cur]
        sign = "+" if delta > 0 else "-"
        head = f"{sign}{human_bytes(abs(delta))} of expert memory ({head})"
    line = f"{head}: replayed hit rate {curve.at(curve.current):.0%} → {curve.at(s):.0%}"
    if curve.tps:
        change = curve.tps[pick] / curve.tps[cur] - 1.0
        if abs(change) <= TPS_NOISE:
            line += f", tokens/s the same within the estimate's noise ({TPS_NOISE:.0%})"
        else:
            line += f", about {change:+.0%} tokens/s"
    line += f"; the ceiling at this budget (Belady) is {belady_at:.0%}"
    return Advice(s, line)


def _worth_freeing(curve: Curve, pick: int, free_bytes: int | None) -> bool:
    """Whether budget `pick`, below the current, gives back enough memory to be worth a
    rebuild (see `advise`)."""
    cur = curve.slots.index(curve.current)
    if curve.bytes is None:
        return curve.slots[pick] <= (1 - WORTH_FREEING_OF_POOL) * curve.current
    freed = curve.bytes[cur] - curve.bytes[pick]
    if free_bytes is None:
        return freed >= WORTH_FREEING_OF_POOL * curve.bytes[cur]
    return freed >= WORTH_FREEING * (free_bytes + curve.bytes[cur])


def advice_for(
    trace: Trace,
    config: StreamConfig,
    current: int,
    budget: Budget | None = None,
    measured: Measured | None = None,
    stop: Callable[[], bool] | None = None,
) -> tuple[Curve, Advice]:
    """One advice session: `trace` replayed at a sweep of budgets around `current` (real
    slots per layer) under `config`'s eviction settings (`policy_of`), LRU and Belady's
    MIN (`sweep`, its store in the store cache); with a `budget`, each budget's bytes
    and, with `measured`, its estimated decode tokens/s (`estimate_tps`); then the advice
    for the memory available now (`advise`).

    Raises:
        As `sweep` (ValueError; engine.replay.ReplayStopped when `stop()` returns True).
    """
    policy = policy_of(config.policy, config.decay_every, config.autopin_frac)
    curve = sweep(
        trace, store_cache_dir() / "replay", policy, current, None, config.autopin_frac, stop
    )
    if budget is not None:
        estimate_tps(curve, budget, measured)
    return curve, advise(curve, available_bytes())


def table(curve: Curve) -> str:
    """The curve as a text table: one row per budget, the current one marked."""
    names = [*curve.hit_rate]
    head = ["slots", *(["memory"] if curve.bytes else []), *names]
    if curve.tps:
        head.append("tok/s (est.)")
    rows = []
    for i, c in enumerate(curve.slots):
        row = [f"{c}{' *' if c == curve.current else ''}"]
        if curve.bytes:
            row.append(human_bytes(curve.bytes[i]))
        row += [f"{curve.hit_rate[p][i]:.1%}" for p in names]
        if curve.tps:
            row.append(f"{curve.tps[i]:.1f}")
        rows.append(row)
    widths = [max(len(r[j]) for r in [head, *rows]) for j in range(len(head))]
    lines = ["  ".join(h.rjust(w) for h, w in zip(r, widths, strict=True)) for r in [head, *rows]]
    return "\n".join(lines)


NO_MATPLOTLIB = "--png needs matplotlib: pip install matplotlib (or the 'bench' extra)"


def check_png() -> None:
    """Refuses a plot before any work where `save_png` could not draw it.

    Raises:
        ValueError: matplotlib is not installed (`NO_MATPLOTLIB`).
    """
    if importlib.util.find_spec("matplotlib") is None:
        raise ValueError(NO_MATPLOTLIB)


def save_png(curve: Curve, advice: Advice, path: str | Path) -> Path:
    """Plots hit rate (and the estimated tokens/s, when there is one) vs budget, the
    current and suggested budgets marked and the advice as the title, into the PNG
    `path` (matplotlib, the `bench` extra, imported here only), written atomically
    (`engine.safe_io.atomic_write`).

    Raises:
        ValueError: matplotlib is not installed.
        OSError: the file cannot be written (an older file there is kept).
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ValueError(NO_MATPLOTLIB) from None
    rows = 2 if curve.tps else 1
    fig, axes = plt.subplots(rows, 1, figsize=(8, 3 + 2.4 * rows), sharex=True, squeeze=False)
    hits = axes[0][0]
    for name, rates in curve.hit_rate.items():
        label = "Belady's MIN (ceiling)" if name == BELADY else name.upper()
        if name == curve.policy:
            label += " (the session's policy)"
        style = "--" if name == BELADY else "-"
        hits.plot(curve.slots, [100 * r for r in rates], style, label=label)
    hits.set_ylabel("hit rate %")
    hits.set_ylim(0, 100)
    hits.legend(loc="lower right")
    if curve.bytes:
        top = hits.secondary_xaxis("top")
        top.set_xticks(curve.slots[:: max(1, len(curve.slots) // 6)])
        top.set_xticklabels(
            [human_bytes(b) for b in curve.bytes[:: max(1, len(curve.slots) // 6)]], fontsize=8
        )
    if curve.tps:
        speed = axes[1][0]
        speed.plot(curve.slots, curve.tps, "o-", color="tab:red", label="estimated")
        speed.plot([curve.current], [curve.measured.decode_tps], "k*", ms=12, label="measured")
        speed.set_ylabel("decode tok/s")
        speed.set_ylim(0, 1.1 * max(max(curve.tps), curve.measured.decode_tps))
        speed.legend(loc="lower right")
    for (ax,) in axes:
        ax.axvline(curve.current, color="tab:blue", lw=1)
        if advice.slots != curve.current:
            ax.axvline(advice.slots, color="tab:green", lw=1, ls="--")
        ax.grid(alpha=0.3)
    axes[-1][0].set_xlabel("real slots per MoE layer")
    fig.suptitle(advice.line, fontsize=9, wrap=True)
    fig.tight_layout()
    path = Path(path)
    try:
        with atomic_write(path) as f:
            fig.savefig(f, format="png", dpi=110)
    finally:
        plt.close(fig)
    return path
