"""Suite 1: decode and prefill against mlx-lm with the model fully resident.

In one process and on one prompt: mlx-lm resident, then the streamed engine with the
real region at several fractions of the experts, each in every prefetch mode (`MODES`).
Each configuration runs `reps` times, each from a freshly loaded model (cold cache), in
round-robin order (round 1 runs every configuration once, then round 2, ..., each round
starting one configuration later) after one discarded warm-up run of each path, so that
load from other processes, and the place right after the peers, fall on all
configurations alike; the median and the spread (min..max) are reported.

The peers' approaches (bench.peers) run in the same rounds at the same memory
budget, each repetition a child process bounded by a memory cgroup (bench.limits):
the budget at a fraction is the peak RSS (VmHWM) of a child that ran the streamed engine
at that fraction (LFU prefetch mode) first. Before every repetition of a peer the blob
files are dropped from the page cache.
"""

import gc
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx_lm.utils import load_model as mlx_load_model

from bench.common import (
    blob_store,
    disk_read_bytes,
    med_spread,
    reset_vm_hwm,
    timed_generate,
    vm_hwm_bytes,
)
from bench.limits import run_peer, run_worker
from bench.peers import PEER_MODES
from engine.cache import ratio
from engine.config import StreamConfig
from engine.generate import cache_delta
from engine.model import load
from engine.store import is_store

# Prefetch modes: name -> StreamConfig fields (side_slots is set per run: 2 x top_k).
MODES = {
    "off": {"prefetch": False},
    "legacy": {"prefetch": True, "side_lfu": False},
    "lfu": {"prefetch": True, "side_lfu": True},
    "lfu+sync": {"prefetch": True, "side_lfu": True, "sync": True},
}
FRACTIONS = (1.0, 0.5, 0.25, 0.125)


def stream_fields(mode: str, fraction: float, num_experts: int, top_k: int) -> dict:
    """StreamConfig fields of the streamed run `mode` at `fraction` of the experts. A
    mode may end in `@POLICY` (e.g. `off@lfu`) to run with that eviction policy instead
    of the default."""
    mode, _, policy = mode.partition("@")
    fields = dict(MODES[mode])
    if policy:
        fields["policy"] = policy
    fields["expert_slots"] = max(1, round(fraction * num_experts))
    fields["side_slots"] = 2 * top_k if fields["prefetch"] else 0
    return fields


def _summary(name: str, kind: str, timings: list, extra: dict) -> dict:
    dec, dlo, dhi = med_spread([t.decode_tps for t in timings])
    pre, plo, phi = med_spread([t.prefill_tps for t in timings])
    return {
        "name": name,
        "kind": kind,
        "reps": len(timings),
        "decode_tps": dec,
        "decode_tps_spread": [dlo, dhi],
        "prefill_tps": pre,
        "prefill_tps_spread": [plo, phi],
        "prompt_tokens": timings[0].prompt_tokens if timings else 0,
        "generated_tokens": len(timings[0].tokens) if timings else 0,
        "tokens": timings[0].tokens if timings else [],
        **extra,
    }


def _resident_once(model_dir: str | Path, prompt: list[int], max_tokens: int) -> dict:
    reset_vm_hwm()
    model, _ = mlx_load_model(Path(model_dir))
    mx.eval(model.parameters())
    mx.reset_peak_memory()
    t = timed_generate(model, prompt, max_tokens)
    once = {"timing": t, "peak_mlx": mx.get_peak_memory(), "hwm": vm_hwm_bytes()}
    del model
    gc.collect()
    mx.clear_cache()
    return once


def _resident_summary(onces: list[dict]) -> dict:
    return _summary(
        "resident (mlx-lm)",
        "resident",
        [o["timing"] for o in onces],
        {
            "fraction": None,
            "mode": None,
            "hit_rate": 1.0,
            "decode_hit_rate": 1.0,
            "side_hit_rate": 0.0,
            "prefetch_accuracy": None,  # no prefetch issued
            "bytes_per_token": 0.0,
            "decode_bytes_per_token": 0.0,
            "disk_bytes_per_token": 0.0,
            "peak_mlx_bytes": int(max(o["peak_mlx"] for o in onces)),
            "peak_rss_bytes": max(o["hwm"] for o in onces),
        },
    )


def resident_run(model_dir: str | Path, prompt: list[int], max_tokens: int, reps: int) -> dict:
    """mlx-lm's own model, every weight in memory, loaded afresh per repetition."""
    return _resident_summary([_resident_once(model_dir, prompt, max_tokens) for _ in range(reps)])


def _streamed_once(
    store_path, fields: dict, prompt: list[int], max_tokens: int, warm: bool = False
) -> dict:
    """One timed generation from a freshly loaded model; `warm`: after one untimed token
    of the same prompt (the caches it fills kept: the host tier, the real regions)."""
    reset_vm_hwm()
    sm = load(store_path, StreamConfig(**fields))
    if warm:
        timed_generate(sm.model, prompt, 1)
    mx.reset_peak_memory()
    before = sm.snapshot().totals()
    mid = {}
    d0, r0 = disk_read_bytes(), sm.cache.reading_seconds
    t = timed_generate(
        sm.model,
        prompt,
        max_tokens,
        on_first_token=lambda sm=sm: mid.update(sm.snapshot().totals()),
    )
    disk = disk_read_bytes() - d0
    after = sm.snapshot().totals()
    once = {
        "timing": t,
        "whole": cache_delta(before, after),
        "decode": cache_delta(mid or before, after),
        "disk": disk,
        "reading_s": sm.cache.reading_seconds - r0,
        "peak_mlx": mx.get_peak_memory(),
        "hwm": vm_hwm_bytes(),
    }
    del sm
    gc.collect()
    return once


def _streamed_summary(name: str, fields: dict, onces: list[dict]) -> dict:
    """Timings over all repetitions; cache figures of the median (by decode tok/s) one."""
    timings = [o["timing"] for o in onces]
    o = sorted(onces, key=lambda o: o["timing"].decode_tps)[len(onces) // 2]
    whole, dec, t = o["whole"], o["decode"], o["timing"]
    n_tok = t.prompt_tokens + len(t.tokens)
    n_dec = max(1, len(t.tokens) - 1)
    lookups = whole["hits"] + whole["misses"]
    return _summary(
        name,
        "streamed",
        timings,
        {
            "config": fields,
            "hit_rate": whole["hit_rate"],
            "decode_hit_rate": dec["hit_rate"],
            "side_hit_rate": whole["side_hits"] / lookups if lookups else 0.0,
            "prefetch_accuracy": ratio(whole["prefetch_used"], whole["prefetch_issued"]),
            "bytes_per_token": whole["bytes_read"] / n_tok,
            "decode_bytes_per_token": dec["bytes_read"] / n_dec,
            "disk_bytes_per_token": o["disk"] / n_tok if o["disk"] >= 0 else -1,
            "read_seconds": whole["read_seconds"],
            "reading_seconds": o["reading_s"],
            "bytes_read": whole["bytes_read"],
            "wall_seconds": t.wall_s,
            "MBps_while_reading": whole["bytes_read"] / o["reading_s"] / 1e6
            if o["reading_s"]
            else 0.0,
            "MBps_wall": whole["bytes_read"] / t.wall_s / 1e6,
            "overcap_calls": whole["overcap_calls"],
            "peak_mlx_bytes": int(max(x["peak_mlx"] for x in onces)),
            "peak_rss_bytes": max(x["hwm"] for x in onces),
        },
    )


def streamed_run(
    store_path, fields: dict, prompt: list[int], max_tokens: int, reps: int, name: str = "streamed"
) -> dict:
    """The engine with StreamConfig(**fields), a fresh model per repetition."""
    onces = [_streamed_once(store_path, fields, prompt, max_tokens) for _ in range(reps)]
    return _streamed_summary(name, fields, onces)


def peer_run(store_path, mode: str, prompt: list[int], max_tokens: int, reps: int) -> dict:
    """A peer approach (bench.peers), page cache of the blobs dropped before each
    repetition. `hit_rate` is the page cache's: 1 - bytes fetched from storage / bytes
    requested (from /proc/self/io, so it includes any other file this process read)."""
    from bench.disk import blob_paths, evict
    from bench.peers import load_peer

    reset_vm_hwm()
    timings, rows, peaks = [], [], []
    for _ in range(reps):
        sm, counters = load_peer(store_path, mode)
        evict(blob_paths(sm.store))
        mx.reset_peak_memory()
        d0, r0 = disk_read_bytes(), counters.bytes
        mid = {}
        t = timed_generate(
            sm.model,
            prompt,
            max_tokens,
            on_first_token=lambda mid=mid, c=counters: mid.update(
                disk=disk_read_bytes(), req=c.bytes
            ),
        )
        disk, req = disk_read_bytes() - d0, counters.bytes - r0
        timings.append(t)
        rows.append(
            (
                disk,
                req,
                disk_read_bytes() - mid.get("disk", d0),
                counters.bytes - mid.get("req", r0),
            )
        )
        peaks.append(mx.get_peak_memory())
        del sm
        gc.collect()
    order = sorted(range(reps), key=lambda i: timings[i].decode_tps)
    i = order[reps // 2]
    disk, req, ddisk, dreq = rows[i]
    n_tok = timings[i].prompt_tokens + len(timings[i].tokens)
    n_dec = max(1, len(timings[i].tokens) - 1)
    return _summary(
        f"peer: {mode}",
        mode,
        timings,
        {
            "hit_rate": max(0.0, 1 - disk / req) if req else 0.0,
            "decode_hit_rate": max(0.0, 1 - ddisk / dreq) if dreq else 0.0,
            "side_hit_rate": 0.0,
            "prefetch_accuracy": None,  # no prefetch issued
            "bytes_per_token": req / n_tok,
            "decode_bytes_per_token": dreq / n_dec,
            "disk_bytes_per_token": disk / n_tok,
            "decode_disk_bytes_per_token": ddisk / n_dec,
            "wall_seconds": timings[i].wall_s,
            "MBps_wall": disk / timings[i].wall_s / 1e6,
            "peak_mlx_bytes": int(max(peaks)),
            "peak_rss_bytes": vm_hwm_bytes(),
        },
    )


def _peer_summary(name: str, runs: list[dict]) -> dict:
    """Worker results of single repetitions: tok/s median and spread over all, the other
    figures from the median (by decode tok/s) repetition."""
    ok = [r for r in runs if "error" not in r]
    if not ok:
        return dict(runs[0], name=name)
    med = dict(sorted(ok, key=lambda r: r["decode_tps"])[len(ok) // 2])
    for key in ("decode_tps", "prefill_tps"):
        v, lo, hi = med_spread([r[key] for r in ok])
        med[key], med[f"{key}_spread"] = v, [lo, hi]
    med["reps"] = len(ok)
    med["name"] = name
    return med


def decode_suite(
    model,
    prompt: list[int],
    fractions=FRACTIONS,
    modes=tuple(MODES),
    reps: int = 3,
    max_tokens: int = 64,
    peers: bool = True,
    log=print,
) -> dict:
    """Resident baseline, streamed at each fraction x mode, and the peers at each
    fraction's budget, in `reps` round-robin rounds. Returns {"rows", "budgets",
    "resident_note", ...}."""
    store = blob_store(model)
    m = store.manifest
    configs = [
        (
            f"streamed {fraction:.1%} {mode}",
            fraction,
            mode,
            stream_fields(mode, fraction, m.num_experts, m.top_k),
        )
        for fraction in fractions
        for mode in modes
    ]
    resident = not is_store(model)
    resident_note = (
        "" if resident else "no resident baseline: --model is an expert store, not an mlx-lm model"
    )
    budgets = {}
    if peers:
        for fraction in fractions:
            probe = run_worker(
                {
                    "kind": "streamed",
                    "store": str(store.path),
                    "fields": stream_fields("lfu", fraction, m.num_experts, m.top_k),
                    "prompt": prompt,
                    "max_tokens": max_tokens,
                    "reps": 1,
                }
            )
            if "error" in probe:
                log(f"budget probe at {fraction:.1%} failed: {probe['error']}")
            else:
                budgets[fraction] = int(probe["peak_rss_bytes"])
    peer_cases = [(f, mode) for f in budgets for mode in PEER_MODES]
    # Warm-up (discarded): the first use of each path pays for kernels and allocations.
    if resident:
        _resident_once(model, prompt, 8)
    _streamed_once(store.path, configs[0][3], prompt, 8)
    # Round-robin over every configuration, `reps` rounds: load from other processes on a
    # shared machine then falls on all configurations alike, and the ratios hold. Each
    # round starts one configuration later than the one before, so that no configuration
    # always runs first, right after the previous round's peers (child processes in memory
    # cgroups, page cache dropped): a configuration that always ran in that place would
    # run measurably slower than its peers.
    res_onces, onces = [], {c[0]: [] for c in configs}
    peer_runs = {case: [] for case in peer_cases}
    # (where a repetition's result goes, the repetition)
    runs = [
        (onces[name], lambda fields=fields: _streamed_once(store.path, fields, prompt, max_tokens))
        for name, _, _, fields in configs
    ]
    if resident:
        runs.insert(0, (res_onces, lambda: _resident_once(model, prompt, max_tokens)))
    for rnd in range(reps):
        log(f"round {rnd + 1}/{reps}")
        start = rnd % len(runs)
        for results, run in runs[start:] + runs[:start]:
            results.append(run())
        for fraction, mode in peer_cases:
            peer_runs[(fraction, mode)].append(
                run_peer(store.path, mode, prompt, max_tokens, budgets[fraction])
            )
    rows = []
    resident_tps = None
    if resident:
        r = _resident_summary(res_onces)
        r.update(fraction=None, mode=None, ratio_to_resident=1.0)
        resident_tps = r["decode_tps"]
        rows.append(r)
        log(f"resident: decode {r['decode_tps']:.1f} tok/s, prefill {r['prefill_tps']:.1f}")
    else:
        log(resident_note)
    for name, fraction, mode, fields in configs:
        r = _streamed_summary(name, fields, onces[name])
        r.update(fraction=fraction, mode=mode)
        r["ratio_to_resident"] = r["decode_tps"] / resident_tps if resident_tps else None
        rows.append(r)
        log(
            f"{r['name']}: decode {r['decode_tps']:.1f} tok/s"
            + (f" ({r['ratio_to_resident']:.2f}x resident)" if resident_tps else "")
            + f", hit rate {r['hit_rate']:.1%} (decode {r['decode_hit_rate']:.1%})"
        )
    for (fraction, mode), runs in peer_runs.items():
        budget = budgets[fraction]
        r = _peer_summary(f"peer: {mode} @ {fraction:.1%} budget", runs)
        r.update(fraction=fraction, mode=mode, kind=mode, budget_bytes=budget)
        if "error" in r:
            log(f"{r['name']}: {r['error']}")
        else:
            r["ratio_to_resident"] = r["decode_tps"] / resident_tps if resident_tps else None
            log(
                f"{r['name']} ({r['bound'] or 'unbounded'}, {budget / 2**20:.0f} MiB): "
                f"decode {r['decode_tps']:.1f} tok/s, page-cache hit rate {r['hit_rate']:.1%}"
            )
        rows.append(r)
    return {
        "rows": rows,
        "budgets": {str(f): b for f, b in budgets.items()},
        "resident_note": resident_note,
        "resident_decode_tps": resident_tps,
        "store": str(store.path),
        "num_experts": m.num_experts,
        "top_k": m.top_k,
    }


PREFILL_FRACTIONS = (1.0, 0.25, 0.125)


def long_prompt(prompt: list[int], length: int = 1536) -> list[int]:
    """`prompt` repeated and cut to `length` tokens: a pasted document's prefill, which at
    partial capacity routes to nearly every expert of every layer."""
    if not prompt:
        raise ValueError("long_prompt: the prompt to repeat is empty")
    return (prompt * (length // len(prompt) + 1))[:length]


def prefill_suite(
    model,
    prompt: list[int],
    fractions=PREFILL_FRACTIONS,
    reps: int = 3,
    fields: dict | None = None,
    log=print,
    configs: dict[str, tuple[float, dict]] | None = None,
    warm_up: bool = True,
) -> dict:
    """Time to first token of `prompt` (a long one: `long_prompt`) for mlx-lm resident
    and the engine at each fraction of the experts (prefetch off: a prefill of several
    tokens never prefetches; `fields`: more StreamConfig fields for every engine run;
    `configs`: instead of `fractions`, named runs of (fraction, more fields) each, a
    field "warm": True running the prompt once untimed after the load, `_streamed_once`),
    each repetition from a freshly loaded model (cold cache: every expert the prompt
    routes to is read), in `reps` round-robin rounds after one discarded warm-up of each
    path, as `decode_suite` does (`warm_up` False: none, where an earlier suite in the
    process has compiled the kernels).

    Returns:
        {"prompt_tokens", "baseline", "rows"}: one row per run with "ttft_s" (median
        seconds) and "ttft_s_spread" [min, max], "prefill_tps" (prompt tokens / median
        ttft), "ratio" (the baseline's median ttft / this one's: its prefill rate as a
        fraction of the baseline's), and for the engine "fraction", "overcap_calls",
        "bytes_read", "reading_s" (seconds with a read in flight: `reading_seconds`),
        "MBps_while_reading" (bytes_read / reading_s; 0 with nothing read),
        "host_tier_bytes" (copied from the host tier), "load_s" (the host's seconds in
        the calls' acquires and loads: reads waited for, tier copies) and "copy_s" (of
        those, the seconds in the loads' copies into the layer scratch), of the median
        repetition; "same_tokens": every repetition's first token equals the baseline's
        first repetition's; "same_logits": and its logits, every bit. The baseline is
        the first row: resident, or for an expert store (no mlx-lm model) the engine at
        the first fraction (at 100%: every expert cached).

    Raises:
        ValueError: reps < 1.
    """
    if reps < 1:
        raise ValueError(f"prefill_suite: reps is {reps}, at least 1 is needed")
    store = blob_store(model)
    m = store.manifest
    configs = {
        name: (f, stream_fields("off", f, m.num_experts, m.top_k) | (fields or {}) | more)
        for name, (f, more) in (
            configs or {f"streamed {f:.1%}": (f, {}) for f in fractions}
        ).items()
    }
    runs = {
        name: lambda fields=fields: _streamed_once(
            store.path,
            {k: v for k, v in fields.items() if k != "warm"},
            prompt,
            1,
            fields.get("warm", False),
        )
        for name, (_, fields) in configs.items()
    }
    if not is_store(model):
        runs = {"resident (mlx-lm)": lambda: _resident_once(model, prompt, 1), **runs}
    for run in runs.values() if warm_up else ():  # discarded: kernels and allocations
        run()
    onces = {name: [] for name in runs}
    names = list(runs)
    for rnd in range(reps):
        log(f"round {rnd + 1}/{reps}")
        start = rnd % len(names)
        for name in names[start:] + names[:start]:
            onces[name].append(runs[name]())
            # Each run as it ends: a suite stopped midway still says what it measured.
            log(f"  {name}: {onces[name][-1]['timing'].prefill_s * 1e3:.0f} ms")
    rows = []
    first = onces[names[0]][0]["timing"]
    for name in names:
        ttft, lo, hi = med_spread([o["timing"].prefill_s for o in onces[name]])
        row = {
            "name": name,
            "ttft_s": ttft,
            "ttft_s_spread": [lo, hi],
            "prefill_tps": len(prompt) / ttft,
            "ratio": rows[0]["ttft_s"] / ttft if rows else 1.0,
            "reps": reps,
            "same_tokens": all(o["timing"].tokens == first.tokens for o in onces[name]),
            "same_logits": all(
                np.array_equal(o["timing"].first_logprobs, first.first_logprobs)
                for o in onces[name]
            ),
        }
        if name in configs:
            o = sorted(onces[name], key=lambda o: o["timing"].prefill_s)[reps // 2]
            read = o["whole"]["bytes_read"]
            row |= {
                "fraction": configs[name][0],
                "overcap_calls": o["whole"]["overcap_calls"],
                "bytes_read": read,
                "reading_s": o["reading_s"],
                "MBps_while_reading": read / o["reading_s"] / 1e6 if o["reading_s"] else 0.0,
                "host_tier_bytes": o["whole"]["host_bytes"],
                # the host's time in the calls' loads (reads waited for, tier copies)
                "load_s": o["whole"]["acquire_seconds"],
                "copy_s": o["whole"]["copy_seconds"],
            }
        rows.append(row)
        reads = (
            f"; {row['bytes_read'] / 1e6:.0f} MB read in {row['reading_s'] * 1e3:.0f} ms "
            f"of reading, {row['MBps_while_reading']:.0f} MB/s while reading"
            if row.get("bytes_read")
            else ""
        )
        if row.get("host_tier_bytes"):
            reads += (
                f"; {row['host_tier_bytes'] / 1e6:.0f} MB copied from the host tier, "
                f"{row['load_s'] * 1e3:.0f} ms of the host in the layers' loads, "
                f"{row['copy_s'] * 1e3:.0f} ms of them in copies"
            )
        log(
            f"{name}: time to first token {ttft * 1e3:.0f} ms ({row['ratio']:.2f}x {names[0]})"
            + reads
            + ("" if row["same_tokens"] else f"; FIRST TOKEN DIFFERS from {names[0]}'s")
            + ("" if row["same_logits"] else f"; LOGITS DIFFER from {names[0]}'s")
        )
    return {"prompt_tokens": len(prompt), "baseline": names[0], "rows": rows}
