"""Suite 4: a Qwen3-30B-A3B-shaped store (about 18 GB, random weights) under a 4 GiB
memory budget.

The store is generated on first use (`engine.synthetic`, QWEN3_30B_A3B preset) into
`<store cache dir>/synthetic-qwen3-30b-a3b` (`$EXPERTSTREAM_CACHE`, else
`~/.cache/expertstream`), or taken from `--model`; delete that directory to reclaim the
disk. Every run is a child process in a memory cgroup of the budget:

- decode: the engine generating from token ids (no tokenizer), real region sized to
  the budget (`slots_for_budget`), prefetch off (the side region's 2 x spec rows do not
  fit next to a useful real region at 4 GiB);
- trace-driven: the same cache, `acquire` per token per layer on expert ids (uniform
  random, and "Mixtral-like": the reuse rate measured on the HD-MoE Mixtral traces),
  without any matmul: the I/O path's own ceiling in tokens/s; with checksums on (the
  engine's default) and off;
- the peers (bench.peers: every routed expert read through the page cache, or
  gathered from an mmap) at the same budget;
- and the raw uncached pread bandwidth of the store's blobs (bench.disk), plus
  raw and engine reads alternated in one process (`paired_bandwidth`) for a ratio that
  holds under changing load.
"""

import os
import time
from pathlib import Path

import numpy as np

from bench.common import vm_hwm_bytes
from bench.disk import (
    best_random,
    blob_paths,
    evict,
    raw_pread,
    raw_sweep,
    resident_fraction,
)
from bench.limits import run_peer, run_worker
from engine.cache import open_cache, snapshot
from engine.config import StreamConfig
from engine.model import store_cache_dir
from engine.store import DENSE_FILE, MANIFEST_FILE, ExpertStore
from engine.synthetic import QWEN3_30B_A3B, ensure_store, store_bytes
from engine.trace import local_trace, random_trace

BUDGET = 4 << 30
SCALE_STORE = "synthetic-qwen3-30b-a3b"
# Process overhead outside the pools and dense weights (Python, MLX, mlx-lm, activations).
OVERHEAD = 640 << 20
MIXTRAL_REUSE = 0.36  # reuse_rate of the HD-MoE Mixtral traces (0.36 on every file)


def scale_store(path: str | Path | None = None, log=print) -> ExpertStore:
    """The scale store at `path` (default: in the store cache dir), written if missing."""
    path = Path(path) if path else store_cache_dir() / SCALE_STORE
    if not (path / MANIFEST_FILE).exists():
        log(
            f"writing the synthetic Qwen3-30B-A3B store to {path} "
            f"({store_bytes(QWEN3_30B_A3B) / 2**30:.1f} GiB of experts)"
        )
        t0 = time.perf_counter()
        ensure_store(path, QWEN3_30B_A3B)
        log(f"  written in {time.perf_counter() - t0:.0f} s")
    return ExpertStore(path)


def slots_for_budget(store: ExpertStore, budget: int, scratch: int) -> int:
    """Real-region slots per layer that fit `budget` next to the dense weights, the
    `scratch` rows and `OVERHEAD`, with 10% headroom (at least top_k)."""
    m = store.manifest
    dense = os.path.getsize(store.path / DENSE_FILE)
    per_row = sum(spec.stride for spec in m.layers)
    rows = int((budget - dense - OVERHEAD) * 0.9) // per_row
    return max(m.top_k, rows - scratch)


def replay_ids(store_path, fields: dict, trace_spec: dict) -> dict:
    """Replays generated expert ids through the native cache of the store (uncached
    reads unless `fields` says otherwise), one acquire per token per layer, no compute.

    trace_spec: {"type": "random" | "local", "tokens", "reuse" (local), "skew", "seed"}.
    """
    store = ExpertStore(store_path)
    m = store.manifest
    n, layers = int(trace_spec["tokens"]), len(m.layers)
    if trace_spec["type"] == "random":
        trace = random_trace(n, layers, m.num_experts, m.top_k, trace_spec.get("seed", 0))
    else:
        trace = local_trace(
            n,
            layers,
            m.num_experts,
            m.top_k,
            trace_spec["reuse"],
            skew=trace_spec.get("skew", 0.1),
            seed=trace_spec.get("seed", 0),
        )
    paths = blob_paths(store)
    evict(paths)
    before = resident_fraction(paths)
    cache = open_cache(store, StreamConfig(**fields))
    ids = np.ascontiguousarray(trace.ids, dtype=np.int32)
    t0 = time.perf_counter()
    for t in range(n):
        for li in range(layers):
            cache.acquire(li, ids[t, li])
    wall = time.perf_counter() - t0
    tot, reading = snapshot(cache).totals(), cache.reading_seconds
    del cache
    return {
        "trace": trace.name,
        "tokens": n,
        "fields": fields,
        "wall_seconds": wall,
        "tokens_per_s": n / wall if wall else 0.0,
        "hit_rate": tot["hit_rate"],
        "bytes_read": tot["bytes_read"],
        "read_seconds": tot["read_seconds"],
        "reading_seconds": reading,
        "MBps_while_reading": tot["bytes_read"] / reading / 1e6 if reading else 0.0,
        "MBps_wall": tot["bytes_read"] / wall / 1e6 if wall else 0.0,
        "bytes_per_token": tot["bytes_read"] / n,
        "resident_before": before,
        "resident_after": resident_fraction(paths),
        "peak_rss_bytes": vm_hwm_bytes(),
    }


def paired_bandwidth(
    store: ExpertStore, fields: dict, rounds: int = 3, tokens: int = 8, log=print
) -> dict:
    """Raw random pread (1 thread, huge-page buffer) and the engine's ids-only replay
    (checksums off, uniform random ids), alternated `rounds` times in this process, so
    that both see the same load: the engine / raw ratio of each round and their median."""
    paths = blob_paths(store)
    stride = store.manifest.layers[0].stride
    pairs = []
    for i in range(rounds):
        raw = raw_pread(paths, stride, "rand", 1, 1 << 30, seed=100 + i)
        eng = replay_ids(
            store.path,
            dict(fields, verify_checksums=False),
            {"type": "random", "tokens": tokens, "seed": 100 + i},
        )
        pairs.append(
            {
                "raw_MBps": raw["MBps"],
                "engine_MBps": eng["MBps_while_reading"],
                "ratio": eng["MBps_while_reading"] / raw["MBps"],
            }
        )
        log(
            f"  pair {i + 1}: raw {raw['MBps']:.0f} MB/s, engine {eng['MBps_while_reading']:.0f}"
            f" MB/s, ratio {pairs[-1]['ratio']:.2f}"
        )
    ratios = sorted(p["ratio"] for p in pairs)
    return {"pairs": pairs, "median_ratio": ratios[len(ratios) // 2]}


def scale_suite(
    store_path=None,
    budget: int = BUDGET,
    prompt_len: int = 8,
    max_tokens: int = 16,
    replay_tokens: int = 24,
    raw_bytes: int = 1 << 30,
    peers: bool = True,
    log=print,
) -> dict:
    """Decode and trace-driven runs of the scale store, each in a `budget` cgroup."""
    store = scale_store(store_path, log)
    m = store.manifest
    scratch = 2
    slots = slots_for_budget(store, budget, scratch)
    fields = {"expert_slots": slots, "scratch_slots": scratch}
    rng = np.random.default_rng(7)
    prompt = [int(t) for t in rng.integers(1, store.config["vocab_size"], prompt_len)]
    pool_bytes = (slots + scratch) * sum(spec.stride for spec in m.layers)
    log(
        f"scale store {store.path}: {len(m.layers)} layers x {m.num_experts} experts, "
        f"top-{m.top_k}, record {m.layers[0].stride / 2**20:.2f} MiB; {slots} slots + "
        f"{scratch} scratch rows per layer = {pool_bytes / 2**30:.2f} GiB of pools"
    )
    paths = blob_paths(store)
    stride = m.layers[0].stride
    raw = raw_sweep(paths, stride, (1, 2, 4), raw_bytes, 3, log)
    evict(paths)
    runs = []
    r = run_worker(
        {
            "kind": "streamed",
            "store": str(store.path),
            "fields": fields,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "reps": 1,
            "name": f"scale decode, {slots} slots",
        },
        limit=budget,
    )
    r["name"] = f"decode, {slots} slots, prefetch off"
    runs.append(r)
    _log_run(r, log)
    for kind, spec in (
        ("random", {"type": "random"}),
        ("mixtral-like", {"type": "local", "reuse": MIXTRAL_REUSE}),
    ):
        for verify in (True, False):
            f = dict(fields, verify_checksums=verify)
            r = run_worker(
                {
                    "kind": "replay",
                    "store": str(store.path),
                    "fields": f,
                    "trace": dict(spec, tokens=replay_tokens),
                },
                limit=budget,
            )
            r["name"] = f"ids only, {kind}, checksums {'on' if verify else 'off'}"
            runs.append(r)
            _log_run(r, log)
    if peers:
        for mode in ("pagecache", "mmap"):
            r = run_peer(store.path, mode, prompt, max_tokens, budget)
            r["name"] = f"peer: {mode} (every routed expert read each call)"
            runs.append(r)
            _log_run(r, log)
    paired = paired_bandwidth(store, fields, log=log)
    ref = best_random(raw)
    for r in runs:
        bw = r.get("MBps_while_reading")
        if bw:
            r["ratio_to_raw"] = bw / ref["MBps"]
    return {
        "paired": paired,
        "raw": raw,
        "reference": {"pattern": "rand", "threads": ref["threads"], "MBps": ref["MBps"]},
        "store": str(store.path),
        "store_bytes": store_bytes(QWEN3_30B_A3B),
        "budget_bytes": budget,
        "slots": slots,
        "scratch": scratch,
        "pool_bytes": pool_bytes,
        "prompt_tokens": prompt_len,
        "runs": runs,
    }


def _log_run(r: dict, log) -> None:
    if "error" in r:
        log(f"  {r['name']}: {r['error']}")
        return
    tps = r.get("decode_tps", r.get("tokens_per_s", 0.0))
    bw = r.get("MBps_while_reading") or (
        r["bytes_read"] / r["read_seconds"] / 1e6 if r.get("read_seconds") else 0.0
    )
    log(
        f"  {r['name']}: {tps:.2f} tok/s, hit rate {r['hit_rate']:.1%}, "
        f"{bw:.0f} MB/s while reading, peak RSS {r['peak_rss_bytes'] / 2**30:.2f} GiB, "
        f"cgroup peak {(r['cgroup_peak_bytes'] or 0) / 2**30:.2f} GiB ({r['bound']})"
    )
