"""Prefetch degree: the adaptive degree against fixed side rows, side by side.

Two models: the embedded one (trained routers, whose predictions are mostly right) and a
synthetic store with random routers (`SYNTHETIC`: the worst case for prediction). At one
fraction of the experts in the real regions, each runs with prefetch off, with each
fixed number of side rows of `side_rows_for` (every prediction fills them all:
`StreamConfig.adaptive_prefetch` off) and with the adaptive degree, whose upper bound is
the largest of them. Every configuration is a fresh load per repetition, in round-robin
rounds as `bench.decode` runs them (each round starts one configuration later), after one
discarded warm-up; decode tokens/s is the median over the repetitions, the other figures
the median repetition's: the hit rate over the decode, fills per decode token issued,
used and wasted, and for the adaptive run the degree (mean over the layers that have side
rows) and the threshold it ended at.

    python -m bench --suite prefetch --out OUT
"""

import gc
from pathlib import Path

from bench.common import med_spread, prompt_ids, timed_generate
from engine.cache import NO_ROW
from engine.config import StreamConfig
from engine.generate import cache_delta
from engine.model import load, load_store_tokenizer, resolve_store, store_cache_dir
from engine.resources import default_model_path
from engine.synthetic import ensure_store, tiny_config

# Random-router store: 8 MoE layers of 64 experts, top-8, records of about 250 kB.
SYNTHETIC = tiny_config(8, 64, 8, hidden=512, moe_intermediate=256, vocab=1024)
SYNTHETIC_STORE = "synthetic-random-routers-8x64"


def side_rows_for(top_k: int) -> tuple[int, ...]:
    """The fixed side-row settings compared: top_k / 2, top_k and 2 x top_k (the
    device bench's default, and the adaptive run's upper bound)."""
    return tuple(sorted({max(1, top_k // 2), top_k, 2 * top_k}))


def synthetic_store(log=print) -> Path:
    """The random-router store in the store cache dir, written on first use."""
    path = store_cache_dir() / SYNTHETIC_STORE
    log(f"  synthetic store {path}")
    return ensure_store(path, SYNTHETIC, group_size=64, bits=4)


def configs(num_experts: int, top_k: int, fraction: float) -> dict[str, dict]:
    """{name: StreamConfig fields} of the compared runs at `fraction` of the experts."""
    slots = max(top_k, round(fraction * num_experts))
    out = {"prefetch off": {"expert_slots": slots, "prefetch": False}}
    for n in side_rows_for(top_k):
        out[f"{n} side rows, fixed"] = {
            "expert_slots": slots,
            "side_slots": n,
            "prefetch": True,
            "adaptive_prefetch": False,
        }
    top = max(side_rows_for(top_k))
    out[f"adaptive (up to {top})"] = {"expert_slots": slots, "side_slots": top, "prefetch": True}
    return out


def _once(store, fields: dict, prompt: list[int], max_tokens: int) -> dict:
    sm = load(store, StreamConfig(**fields))
    first = {}

    def on_first_token(sm=sm):
        first.update(sm.snapshot().totals())

    t = timed_generate(sm.model, prompt, max_tokens, on_first_token=on_first_token)
    snap = sm.snapshot()
    decode = cache_delta(first, snap.totals())
    targets = (snap.side_state != NO_ROW).any(axis=1)  # the layers with side rows
    degrees = snap.degree[targets]
    once = {
        "timing": t,
        "decode": decode,
        "degree": float(degrees.mean()) if degrees.size else 0.0,
        "threshold": snap.kept_threshold,
    }
    del sm
    gc.collect()
    return once


def _row(name: str, fields: dict, onces: list[dict]) -> dict:
    tps, lo, hi = med_spread([o["timing"].decode_tps for o in onces])
    o = sorted(onces, key=lambda o: o["timing"].decode_tps)[len(onces) // 2]
    d, n = o["decode"], max(1, len(o["timing"].tokens) - 1)
    return {
        "name": name,
        "config": fields,
        "decode_tps": tps,
        "decode_tps_spread": [lo, hi],
        "reps": len(onces),
        "hit_rate": d["hit_rate"],
        "fills_per_token": d["prefetch_issued"] / n,
        "used_per_token": d["prefetch_used"] / n,
        "wasted_per_token": d["prefetch_wasted"] / n,
        "bytes_per_token": d["bytes_read"] / n,
        "degree": o["degree"],
        "threshold": o["threshold"],
        "tokens": o["timing"].tokens,
    }


def compare(
    store, prompt: list[int], fraction: float, reps: int, max_tokens: int, log=print
) -> dict:
    """The runs of `configs` on `store` (a path), `reps` round-robin rounds."""
    m = resolve_store(store).manifest
    runs = configs(m.num_experts, m.top_k, fraction)
    names = list(runs)
    _once(store, runs[names[-1]], prompt, 8)  # warm-up, discarded
    onces = {name: [] for name in names}
    for r in range(reps):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            onces[name].append(_once(store, runs[name], prompt, max_tokens))
    rows = [_row(name, runs[name], onces[name]) for name in names]
    for row in rows:
        log(
            f"    {row['name']:<26} {row['decode_tps']:6.1f} tok/s  hit rate "
            f"{row['hit_rate']:.1%}  fills/token {row['fills_per_token']:.1f} (used "
            f"{row['used_per_token']:.1f}, wasted {row['wasted_per_token']:.1f})"
            + (
                f"  degree {row['degree']:.1f}, threshold {row['threshold']:.2f}"
                if "adaptive" in row["name"]
                else ""
            )
        )
    return {"fraction": fraction, "top_k": m.top_k, "num_experts": m.num_experts, "rows": rows}


def prefetch_suite(
    model=None, fraction: float = 0.25, reps: int = 5, max_tokens: int = 64, log=print
) -> dict:
    """`compare` on the embedded model (or `model`) and on the random-router store."""
    model = model or default_model_path()
    store = resolve_store(model)
    prompt = prompt_ids(load_store_tokenizer(store), store.config["vocab_size"])
    out = {}
    log(f"  {Path(model).name}, trained routers, {fraction:.0%} of the experts")
    out["trained"] = compare(store.path, prompt, fraction, reps, max_tokens, log)
    path = synthetic_store(log)
    log(f"  random routers, {fraction:.0%} of the experts")
    ids = [(7 * i + 3) % SYNTHETIC["vocab_size"] for i in range(len(prompt))]
    out["random"] = compare(path, ids, fraction, reps, max_tokens, log)
    return out
