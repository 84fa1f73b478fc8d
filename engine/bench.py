"""Benchmarks that print figures and ratios (never timed tests).

`decode_vs_resident` runs, in one process and on the same prompt: mlx-lm with the model
fully resident, then the streamed engine at several real-region sizes (fractions of the
experts) in each prefetch mode. Each configuration runs `reps` times from a cold cache;
the median and the spread (min..max) are reported.
"""

import json
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import mlx.core as mx
from mlx_lm.generate import stream_generate as mlx_stream_generate
from mlx_lm.sample_utils import make_sampler
from mlx_lm.utils import load as mlx_load

from engine.config import StreamConfig
from engine.generate import generate, prompt_tokens
from engine.model import load, resolve_store

# Prefetch modes: name -> StreamConfig fields (spec_slots is set per run).
MODES = {
    "off": {"prefetch": False},
    "legacy": {"prefetch": True, "side_lfu": False},
    "lfu": {"prefetch": True, "side_lfu": True},
    "lfu+sync": {"prefetch": True, "side_lfu": True, "sync": True},
}
PROMPT = "Once upon a time, there was a little girl named Lily. She"


@dataclass
class Run:
    """One configuration's figures (medians over repetitions; *_spread = (min, max))."""

    name: str
    fraction: float | None
    mode: str | None
    prefill_tps: float
    decode_tps: float
    decode_tps_spread: tuple[float, float]
    ratio_to_resident: float
    hit_rate: float
    side_hit_rate: float
    prefetch_accuracy: float
    bytes_per_token: float
    peak_memory_bytes: int


def _resident(model_path: Path, prompt: str, max_tokens: int, reps: int) -> dict:
    model, tok = mlx_load(str(model_path))
    ids = tok.encode(prompt)
    runs = []
    for _ in range(reps):
        mx.reset_peak_memory()
        last = None
        for last in mlx_stream_generate(model, tok, mx.array(ids), max_tokens=max_tokens,
                                        sampler=make_sampler(temp=0.0)):
            pass
        runs.append((last.prompt_tps, last.generation_tps, mx.get_peak_memory()))
    del model
    mx.clear_cache()
    return {
        "prefill_tps": statistics.median(r[0] for r in runs),
        "decode": [r[1] for r in runs],
        "peak": max(r[2] for r in runs),
    }


def decode_vs_resident(
    model_path: str | Path,
    fractions=(1.0, 0.5, 0.25, 0.125),
    modes=tuple(MODES),
    reps: int = 3,
    max_tokens: int = 64,
    prompt: str = PROMPT,
    log=print,
) -> list[Run]:
    """Resident baseline, then streamed at each fraction x mode. Returns one Run each.

    spec_slots for the prefetch modes is 2 x top-k; expert_slots = round(fraction x E),
    at least 1.
    """
    store = resolve_store(model_path)
    num_experts, top_k = store.manifest.num_experts, store.manifest.top_k
    base = _resident(Path(model_path), prompt, max_tokens, reps)
    resident_tps = statistics.median(base["decode"])
    rows = [Run("resident", None, None, base["prefill_tps"], resident_tps,
                (min(base["decode"]), max(base["decode"])), 1.0, 1.0, 0.0, 0.0, 0.0,
                int(base["peak"]))]
    log(f"resident: decode {resident_tps:.1f} tok/s, prefill {base['prefill_tps']:.1f} tok/s")
    for fraction in fractions:
        slots = max(1, round(fraction * num_experts))
        for mode in modes:
            fields = dict(MODES[mode])
            fields["spec_slots"] = 2 * top_k if fields["prefetch"] else 0
            cfg = StreamConfig(expert_slots=slots, **fields)
            results = []
            for _ in range(reps):
                sm = load(store.path, cfg)
                results.append(generate(sm, prompt_tokens(sm, prompt, False), max_tokens))
                del sm
            decode = [r.decode_tps for r in results]
            med = results[sorted(range(reps), key=lambda i: decode[i])[reps // 2]]
            c = med.cache
            lookups = c["hits"] + c["misses"]
            row = Run(
                name=f"streamed {fraction:.1%} {mode}",
                fraction=fraction,
                mode=mode,
                prefill_tps=med.prefill_tps,
                decode_tps=statistics.median(decode),
                decode_tps_spread=(min(decode), max(decode)),
                ratio_to_resident=statistics.median(decode) / resident_tps,
                hit_rate=c["hit_rate"],
                side_hit_rate=c["side_hits"] / lookups if lookups else 0.0,
                prefetch_accuracy=c["prefetch_accuracy"],
                bytes_per_token=c["bytes_read"] / max(1, med.prompt_tokens + len(med.tokens)),
                peak_memory_bytes=med.peak_memory_bytes,
            )
            rows.append(row)
            log(f"{row.name}: decode {row.decode_tps:.1f} tok/s ({row.ratio_to_resident:.2f}x "
                f"resident), hit rate {row.hit_rate:.1%}, side hits {row.side_hit_rate:.1%}, "
                f"prefetch accuracy {row.prefetch_accuracy:.1%}")
    return rows


def markdown_table(rows: list[Run]) -> str:
    """A Markdown table of `rows`."""
    head = ("| run | prefill tok/s | decode tok/s (min..max) | × resident | hit rate | "
            "side hits | prefetch acc. | bytes/token | peak MB |\n|---|---|---|---|---|---|---|"
            "---|---|\n")
    lines = [
        f"| {r.name} | {r.prefill_tps:.1f} | {r.decode_tps:.1f} ({r.decode_tps_spread[0]:.1f}.."
        f"{r.decode_tps_spread[1]:.1f}) | {r.ratio_to_resident:.2f} | {r.hit_rate:.1%} | "
        f"{r.side_hit_rate:.1%} | {r.prefetch_accuracy:.1%} | {r.bytes_per_token / 1e3:.0f} kB | "
        f"{r.peak_memory_bytes / 1e6:.0f} |"
        for r in rows
    ]
    return head + "\n".join(lines) + "\n"


def run_suite(suite: str, out: str | Path, model: str | Path | None = None, log=print) -> dict:
    """Runs `suite` ("quick": one fraction, two modes, 1 rep, 8 tokens; "full": the
    decode/prefill comparison) and writes out/results.json and out/results.md."""
    from engine.resources import default_model_path

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    model = model or default_model_path()
    t0 = time.perf_counter()
    if suite == "quick":
        rows = decode_vs_resident(model, fractions=(0.25,), modes=("off", "lfu"), reps=1,
                                  max_tokens=8, log=log)
    elif suite == "full":
        rows = decode_vs_resident(model, log=log)
    else:
        raise ValueError(f"unknown suite {suite!r} (quick, full)")
    results = {"suite": suite, "model": str(model), "seconds": time.perf_counter() - t0,
               "decode_vs_resident": [asdict(r) for r in rows]}
    (out / "results.json").write_text(json.dumps(results, indent=2))
    (out / "results.md").write_text(markdown_table(rows))
    return results
