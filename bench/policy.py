"""Suite 2: cache policies replayed on routing traces through the real native cache.

The replay itself (`replay`, `belady`, the policies and their rules) is
`engine.replay`, the one the budget advisor runs too; this suite sweeps capacities over
the traces and sets each policy against Belady's MIN.

`acquire_cost` is the policies' per-call cost: the wall time of `ExpertCache.acquire`
over a trace, less the time its demand reads took (`read_seconds`), per call, for each
policy side by side in round-robin rounds. It includes the Python binding (the same for
every policy), so the difference between two policies is what the policy itself costs.
"""

import statistics
import time
from pathlib import Path

import numpy as np

from engine.cache import open_cache, snapshot
from engine.config import StreamConfig
from engine.replay import POLICIES, ROUTER_ONLY, belady, oracle_rows, replay, trace_store
from engine.store import ExpertStore
from engine.trace import Trace

__all__ = [
    "POLICIES",
    "acquire_cost",
    "belady",
    "capacities",
    "policy_suite",
    "replay",
    "trace_store",
]


def capacities(num_experts: int, top_k: int) -> list[int]:
    """Real-region sizes to sweep: every size from top_k to E-1 when that is at most 8
    sizes, else fractions 1/8 .. 3/4 of the experts (never below top_k)."""
    if num_experts - top_k <= 8:
        return list(range(top_k, num_experts))
    fracs = (1 / 8, 3 / 16, 1 / 4, 3 / 8, 1 / 2, 3 / 4)
    return sorted({max(top_k, round(num_experts * f)) for f in fracs} - {num_experts})


def acquire_cost(
    store: ExpertStore,
    trace: Trace,
    capacity: int,
    policies=("lfu", "predictive"),
    rounds: int = 5,
    tokens: int = 2000,
) -> dict:
    """Nanoseconds per `acquire` call, demand reads excluded, for each of `policies`
    replaying the first `tokens` tokens of `trace` at `capacity` (fresh cache per run).

    Returns {policy: {"ns_per_call": median over `rounds`, "spread": [min, max],
    "calls": calls per run}}.
    """
    head = trace.head(tokens)
    ids = np.ascontiguousarray(head.ids, dtype=np.int32)
    calls = head.num_tokens * head.num_layers
    runs: dict[str, list[float]] = {p: [] for p in policies}
    for _ in range(rounds):
        for p in policies:
            cache = open_cache(
                store,
                StreamConfig(expert_slots=capacity, policy=p, uncached_io=False, reader_threads=1),
            )
            acquire = cache.acquire
            t0 = time.perf_counter_ns()
            for row in ids:
                for li in range(head.num_layers):
                    acquire(li, row[li])
            wall = time.perf_counter_ns() - t0
            reads = snapshot(cache).totals()["read_seconds"] * 1e9
            runs[p].append((wall - reads) / calls)
    return {
        p: {"ns_per_call": statistics.median(v), "spread": [min(v), max(v)], "calls": calls}
        for p, v in runs.items()
    }


def policy_suite(
    traces: list[Trace], root: str | Path, caps: dict | None = None, log=print
) -> list[dict]:
    """Hit rate vs capacity for every policy and Belady's MIN on each trace.

    Returns one dict per trace: name, shape, reuse rate, `capacities`, `curves`
    {policy: [replay dicts]}, `belady` [dicts per capacity], `belady_plus_k` (capacity +
    `oracle_rows(top_k)`, the bound of lfu+oracle's fetch hit rate) and `of_belady`
    {policy: [hit rate / Belady's]}.
    """
    from engine.trace import reuse_rate

    out = []
    for trace in traces:
        store = trace_store(trace, root)
        cs = (caps or {}).get(trace.name) or capacities(trace.num_experts, trace.top_k)
        res = {
            "name": trace.name,
            "tokens": trace.num_tokens,
            "layers": trace.num_layers,
            "num_experts": trace.num_experts,
            "top_k": trace.top_k,
            "reuse_rate": reuse_rate(trace),
            "capacities": cs,
            "curves": {},
            "belady": [],
            "belady_plus_k": [],
            "of_belady": {},
        }
        for c in cs:
            res["belady"].append(belady(trace, c))
            res["belady_plus_k"].append(
                belady(trace, min(c + oracle_rows(trace.top_k), trace.num_experts))
            )
        for policy in POLICIES + (ROUTER_ONLY if trace.router_ids is not None else ()):
            res["curves"][policy] = [replay(store, trace, c, policy) for c in cs]
            res["of_belady"][policy] = [
                r["hit_rate"] / b["hit_rate"] if b["hit_rate"] else 0.0
                for r, b in zip(res["curves"][policy], res["belady"], strict=True)
            ]
        log(
            f"{trace.name} ({trace.num_tokens} tokens, {trace.num_layers}x"
            f"{trace.num_experts} top-{trace.top_k}): "
            + ", ".join(
                f"cap {c}: MIN {b['hit_rate']:.1%} LRU {lr['hit_rate']:.1%} "
                f"LFU {lf['hit_rate']:.1%}"
                for c, b, lr, lf in zip(
                    cs, res["belady"], res["curves"]["lru"], res["curves"]["lfu"], strict=True
                )
            )
        )
        out.append(res)
    return out
