"""`expertstream` command line: parses flags and calls the engine, nothing more."""

import argparse
import json
import sys
from pathlib import Path

from engine.flags import add_cache_flags, stream_config


def _convert(args) -> int:
    from tqdm import tqdm

    from engine.convert import convert

    bar = tqdm(total=0, unit="B", unit_scale=True, desc="experts", file=sys.stderr)

    def progress(done, total):
        bar.total = total
        bar.n = done
        bar.refresh()

    path = convert(args.model_dir, args.store_dir, force=args.force, progress=progress)
    bar.close()
    print(f"wrote {path}")
    return 0


def _generate(args) -> int:
    from engine.generate import prompt_tokens
    from engine.model import load

    sm = load(args.model, stream_config(args))
    prompt = prompt_tokens(sm, args.prompt, args.chat)
    if args.record_trace:
        from engine.trace import record

        with record(sm) as recorder:
            recorder.begin_segment()
            code = _generate_with(sm, prompt, args)
            path = recorder.trace(Path(args.record_trace).stem).save(args.record_trace)
        print(f"wrote routing trace {path}", file=sys.stderr)
        return code
    return _generate_with(sm, prompt, args)


def _generate_with(sm, prompt, args) -> int:
    from engine.generate import generate

    if args.json:
        result = generate(sm, prompt, args.max_tokens, args.temp, args.top_p)
        print(json.dumps({"text": result.text, "tokens": result.tokens, "stats": result.stats()}))
        return 0
    if not args.chat:
        print(args.prompt, end="", flush=True)
    result = generate(
        sm,
        prompt,
        args.max_tokens,
        args.temp,
        args.top_p,
        on_response=lambda r: print(r.text, end="", flush=True),
    )
    s = result.stats()
    print(
        f"\n--\nhits {s['hits']}  misses {s['misses']}  hit rate {s['hit_rate']:.1%}  "
        f"read {s['bytes_read'] / 1e6:.1f} MB  side hits {s['side_hits']}  "
        f"prefetch used/issued {s['prefetch_used']}/{s['prefetch_issued']}\n"
        f"prefill {s['prefill_tps']:.1f} tok/s ({s['prompt_tokens']} tokens)  "
        f"decode {s['decode_tps']:.1f} tok/s ({s['generated_tokens']} tokens)  "
        f"peak memory {s['peak_memory_bytes'] / 1e6:.1f} MB",
        file=sys.stderr,
    )
    return 0


def _bench(args) -> int:
    # The benchmarks are the source checkout's top-level `bench` package, never shipped:
    # found next to this engine package when it runs from a checkout (editable install).
    root = Path(__file__).resolve().parents[1]
    if not ((root / "pyproject.toml").is_file() and (root / "bench" / "__init__.py").is_file()):
        print(
            "expertstream: error: the benchmarks are not installed with the package; run "
            "`expertstream bench` from a source checkout (git clone, then "
            "pip install -e '.[bench]')",
            file=sys.stderr,
        )
        return 2
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    from bench import run_suite

    run_suite(args.suite, args.out, args.model)
    print(f"wrote {args.out}/results.json, results.md and plots")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="expertstream",
        description="Run Mixture-of-Experts models with experts streamed from disk.",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("convert", help="write the expert store of an mlx-lm MoE model")
    p.add_argument("model_dir")
    p.add_argument("store_dir")
    p.add_argument("--force", action="store_true", help="replace an existing store")
    p.set_defaults(func=_convert)

    p = sub.add_parser("generate", help="generate text with streamed experts")
    p.add_argument(
        "--model", help="expert store or mlx-lm MoE model directory (default: the embedded model)"
    )
    p.add_argument("--prompt", default="Once upon a time")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temp", type=float, default=0.0, help="sampling temperature (0: greedy)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--chat", action="store_true", help="apply the model's chat template")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument(
        "--record-trace",
        metavar="FILE.npz",
        help="write the routed expert ids of every MoE layer call (engine.trace)",
    )
    add_cache_flags(p)
    p.set_defaults(func=_generate)

    p = sub.add_parser(
        "bench",
        help="benchmarks: figures and ratios against resident mlx-lm (from a source checkout)",
    )
    p.add_argument(
        "--suite",
        choices=["quick", "full", "scale"],
        default="quick",
        help="quick: tiny pass (CI); full: decode, cache policies, I/O; scale: "
        "Qwen3-30B-A3B-shaped synthetic store under 4 GiB",
    )
    p.add_argument("--out", default="bench-out")
    p.add_argument(
        "--model",
        help="default: the embedded model (scale: the synthetic store, generated on first use)",
    )
    p.set_defaults(func=_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `expertstream` console script; returns the exit code."""
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, OSError, KeyError) as e:
        print(f"expertstream: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
