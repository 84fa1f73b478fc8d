"""Benchmarks that print figures and ratios (never timed tests).

`run_suite(suite, out, model)` runs one suite and writes `out/results.json`,
`out/results.md` and PNG plots:

- `quick`: a tiny pass over suites 1-3 (one fraction, two modes, one repetition, short
  traces) that CI runs;
- `full`: suite 1 (`decode`: decode/prefill vs resident, and the peers at the same
  memory budget), suite 2 (`policy`: cache policies on routing traces against Belady's
  MIN) and suite 3 (`disk`: engine reads against raw pread bandwidth);
- `scale`: suite 4 (`scale`: a Qwen3-30B-A3B-shaped synthetic store under 4 GiB);
- `prefill`: time to first token of a long prompt (1,536 tokens) against resident at
  100/25/12.5% of the experts (`bench.decode.prefill_suite`); `full` runs it too;
- `prefetch`: the adaptive prefetch degree against fixed side rows and prefetch off, on
  the embedded model (trained routers) and a random-router synthetic store
  (`bench.prefetch`).

docs/benchmarks.md explains each figure and what limits it.
"""

import json
import os
import time
from pathlib import Path

from bench.common import PROMPT, machine_load, prompt_ids
from engine.model import load_store_tokenizer

SUITES = ("quick", "full", "scale", "prefill", "prefetch")


def routing_traces_dir() -> Path | None:
    """The folder of HD-MoE Mixtral routing traces that `$EXPERTSTREAM_TRACES` names;
    None when unset or not a folder."""
    env = os.environ.get("EXPERTSTREAM_TRACES")
    return Path(env) if env and Path(env).is_dir() else None


def record_trace(store, prompts: list[list[int]], max_tokens: int, name: str):
    """The routing of `max_tokens` greedy tokens after each prompt, recorded from the
    engine (every expert cacheable, prefetch off)."""
    from bench.common import timed_generate
    from engine.config import StreamConfig
    from engine.model import load
    from engine.trace import record

    sm = load(store.path, StreamConfig())
    with record(sm) as rec:
        for p in prompts:
            rec.begin_segment()
            timed_generate(sm.model, p, max_tokens)
        return rec.trace(name)


def run_suite(suite: str, out: str | Path, model: str | Path | None = None, log=print) -> dict:
    """Runs `suite` (one of SUITES) and writes out/results.json, out/results.md and
    the plots. `model`: an mlx-lm model directory or expert store (default: the
    embedded model; for `scale`, the synthetic store, generated on first use)."""
    from bench import report
    from engine.model import resolve_store, store_cache_dir

    if suite not in SUITES:
        raise ValueError(f"unknown suite {suite!r} ({', '.join(SUITES)})")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    start = machine_load()
    t0 = time.perf_counter()
    results: dict = {"suite": suite}
    if suite == "scale":
        from bench.scale import scale_suite

        results["scale"] = scale_suite(model, log=log)
        results["model"] = results["scale"]["store"]
    elif suite == "prefetch":
        from bench.prefetch import prefetch_suite

        results["model"] = str(model or "the embedded model")
        log("prefetch degree: adaptive against fixed side rows")
        results["prefetch"] = prefetch_suite(model, log=log)
    elif suite == "prefill":
        from bench.decode import long_prompt, prefill_suite
        from engine.resources import default_model_path

        model = model or default_model_path()
        results["model"] = str(model)
        store = resolve_store(model)
        prompt = prompt_ids(load_store_tokenizer(store), store.config["vocab_size"])
        prompt = long_prompt(prompt)
        log(f"time to first token ({len(prompt)}-token prompt)")
        results["prefill"] = prefill_suite(model, prompt, log=log)
    else:
        from bench.decode import decode_suite, long_prompt, prefill_suite
        from bench.disk import io_suite
        from bench.policy import acquire_cost, policy_suite, trace_store
        from bench.prediction import prediction_suite
        from engine.resources import default_model_path
        from engine.trace import load_trace, local_trace

        model = model or default_model_path()
        results["model"] = str(model)
        store = resolve_store(model)
        tok = load_store_tokenizer(store)
        prompt = prompt_ids(tok, store.config["vocab_size"])
        quick = suite == "quick"
        log(f"[1/3] decode vs resident ({len(prompt)}-token prompt)")
        if quick:
            results["decode"] = decode_suite(
                model,
                prompt,
                fractions=(0.25,),
                modes=("off", "lfu"),
                reps=1,
                max_tokens=8,
                log=log,
            )
        else:
            results["decode"] = decode_suite(model, prompt, reps=5, log=log)
            log(f"  time to first token ({len(long_prompt(prompt))}-token prompt)")
            results["prefill"] = prefill_suite(model, long_prompt(prompt), log=log)
        log("[2/3] cache policies on routing traces")
        traces_out = out / "traces"
        traces_out.mkdir(exist_ok=True)
        recorded = record_trace(
            store,
            [prompt, prompt[: max(1, len(prompt) // 4)]],
            16 if quick else 128,
            f"recorded-{Path(model).name}",
        )
        recorded.save(traces_out / f"{recorded.name}.npz")
        traces = [recorded]
        tdir = routing_traces_dir()
        if tdir is not None:
            files = sorted(tdir.glob("experts_*_mixtral.json"))
            for f in files[:1] if quick else files:
                t = load_trace(f)
                traces.append(t.head(300) if quick else t)
        else:
            log("  (no HD-MoE traces found: set EXPERTSTREAM_TRACES)")
        m = store.manifest
        traces.append(
            local_trace(
                64 if quick else 2048,
                len(m.layers),
                m.num_experts,
                m.top_k,
                reuse=0.36,
                skew=0.1,
                seed=3,
                name=f"mixtral-like-{m.num_experts}x{m.top_k}",
            )
        )
        results["policy"] = policy_suite(traces, store_cache_dir() / "bench", log=log)
        log("  the policies' cost: ns per acquire call, and decode at 25% with each")
        costed = traces[1] if len(traces) > 2 else recorded  # an HD-MoE trace if present
        cap = max(m.top_k, costed.num_experts // 2)
        results["policy_cost"] = {
            "trace": costed.name,
            "capacity": cap,
            "per_call": acquire_cost(
                trace_store(costed, store_cache_dir() / "bench"),
                costed,
                cap,
                rounds=1 if quick else 5,
                tokens=100 if quick else 2000,
            ),
            "decode": decode_suite(
                model,
                prompt,
                fractions=(0.25,),
                modes=("off", "off@lfu"),
                reps=1 if quick else 7,
                max_tokens=8 if quick else 64,
                peers=False,
                log=log,
            )["rows"],
        }
        log("  the prefetch predictor's recall and precision per layer distance")
        results["prediction"] = prediction_suite(
            model,
            [prompt, prompt[: max(1, len(prompt) // 4)]],
            16 if quick else 128,
            distances=(1, 2) if quick else (1, 2, 3, 4),
            log=log,
        )
        log("[3/3] I/O against the disk")
        results["io"] = io_suite(
            store,
            tok,
            max_tokens=8 if quick else 32,
            max_bytes=(32 << 20) if quick else (1 << 30),
            thread_counts=(1, 2) if quick else (1, 2, 4),
            depths=(1, 4) if quick else (1, 2, 4, 8),
            log=log,
        )
    results["seconds"] = time.perf_counter() - t0
    results["machine"] = {"start": start, "end": machine_load()}
    results["prompt_text"] = PROMPT
    results["plots"] = report.plots(results, out)
    (out / "results.json").write_text(json.dumps(results, indent=1, default=_jsonable))
    (out / "results.md").write_text(report.markdown(results))
    return results


def _jsonable(x):
    if hasattr(x, "tolist"):
        return x.tolist()
    if hasattr(x, "item"):
        return x.item()
    raise TypeError(f"{type(x).__name__} is not JSON serializable")
