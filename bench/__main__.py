"""`python -m bench`: run one benchmark suite (what `expertstream bench` runs in a checkout)."""

import argparse
import sys

from bench import SUITES, run_suite


def main(argv: list[str] | None = None) -> int:
    """Parses the suite's flags, runs it and writes its results; returns the exit code."""
    p = argparse.ArgumentParser(
        prog="expertstream bench",
        description="Benchmarks: figures and ratios against resident mlx-lm, measured side "
        "by side (docs/benchmarks.md).",
    )
    p.add_argument(
        "--suite",
        choices=SUITES,
        default="quick",
        help="quick: tiny pass (CI); full: decode, time to first token, cache policies, "
        "I/O; scale: Qwen3-30B-A3B-shaped synthetic store under 4 GiB; prefill: time to "
        "first token of a long prompt at 100/25/12.5%% of the experts; prefetch: the adaptive "
        "prefetch degree against fixed side rows (default: quick)",
    )
    p.add_argument("--out", default="bench-out", help="results folder (default: bench-out)")
    p.add_argument(
        "--model",
        help="mlx-lm model directory or expert store (default: the embedded model; scale: "
        "the synthetic store, generated on first use)",
    )
    args = p.parse_args(argv)
    try:
        run_suite(args.suite, args.out, args.model)
    except (ValueError, OSError, KeyError) as e:
        print(f"expertstream bench: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {args.out}/results.json, results.md and plots")
    return 0


if __name__ == "__main__":
    sys.exit(main())
