"""One MoE layer's experts at N tokens: mlx-lm's form against the expert-major form.

    python -m bench.expert_major [--tokens 16,256,2048] [--shape 30b] [--out FILE]

Random experts of a model's shapes in a pool, random top-k routing (distinct experts per
token), bf16 hidden states: `engine.expert_compute.expert_outputs` (mlx-lm's
`SwitchGLU` / `SwitchMLP` call for call) against `expert_major_outputs` at each tile
height, each the median of `--reps` timed runs after a warm-up, and whether every output
bit is the same (with the largest difference where it is not). `--modes` adds other
quantization modes and dtypes at the largest token count. Needs only MLX and mlx-lm (no
native extension): `python bench/expert_major.py` with the source tree on PYTHONPATH runs
it on a device where the engine is not built yet.
"""

import argparse
import json
import statistics
import time
from pathlib import Path
from types import SimpleNamespace

import mlx.core as mx
from mlx_lm.models.switch_layers import SwiGLU

from engine.expert_compute import expert_major_outputs, expert_outputs

# (hidden, expert width, experts, top-k): Qwen3-30B-A3B, Qwen3-235B-A22B, gpt-oss-20b.
SHAPES = {"30b": (2048, 768, 128, 8), "235b": (4096, 1536, 128, 8), "gpt-oss": (2880, 2880, 32, 4)}
# mode -> (group size, bits); None: unquantized.
MODES = {
    "affine4": ("affine", 64, 4),
    "affine8": ("affine", 64, 8),
    "mxfp4": ("mxfp4", 32, 4),
    "mxfp8": ("mxfp8", 32, 8),
    "nvfp4": ("nvfp4", 16, 4),
    "bf16": None,
}


def make_pool(shape, mode: str, bias: bool) -> tuple[dict, dict]:
    """Random experts of `shape` in `mode`: (pool, quantization) as the engine keeps them."""
    d, width, experts, _ = shape
    pool, quant = {}, {}
    for name, (out, inp) in {
        "up_proj": (width, d),
        "gate_proj": (width, d),
        "down_proj": (d, width),
    }.items():
        w = mx.random.normal((experts, out, inp)) * 0.02
        if MODES[mode] is None:
            pool[f"{name}.weight"], quant[name] = w.astype(mx.bfloat16), None
        else:
            qmode, group, bits = MODES[mode]
            q = mx.quantize(w, group_size=group, bits=bits, mode=qmode)
            pool[f"{name}.weight"], pool[f"{name}.scales"] = q[0], q[1]
            if qmode == "affine":
                pool[f"{name}.biases"] = q[2]
            quant[name] = {"group_size": group, "bits": bits, "mode": qmode}
        if bias:
            pool[f"{name}.bias"] = (mx.random.normal((experts, out)) * 0.02).astype(mx.bfloat16)
    mx.eval(pool)
    return pool, quant


def routing(tokens: int, experts: int, k: int) -> mx.array:
    """(tokens, k) int32 distinct experts per token, as a router's top-k picks them."""
    logits = mx.random.normal((tokens, experts))
    return mx.argpartition(-logits, k - 1, axis=-1)[:, :k].astype(mx.int32)


def timed(fn, reps: int) -> float:
    """Median milliseconds of `reps` evaluated calls of `fn`, after one warm-up."""
    mx.eval(fn())
    mx.synchronize()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        mx.eval(fn())
        mx.synchronize()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def compare(shape, mode, dtype, tokens, tiles, reps, bias=False) -> dict:
    """One row: mlx-lm's form and the expert-major form at each tile height."""
    pool, quant = make_pool(shape, mode, bias)
    # `engine.experts.ExpertMath`'s fields; that module needs the native extension.
    math = SimpleNamespace(kind="SwitchGLU", activation=SwiGLU())
    x = (mx.random.normal((tokens, shape[0])) * 0.5).astype(dtype)
    rows = routing(tokens, shape[2], shape[3])
    mx.eval(x, rows)
    ref = expert_outputs(x, pool, rows, quant, math)
    row = {
        "tokens": tokens,
        "mode": mode,
        "dtype": str(dtype).rpartition(".")[2],
        "mlx_lm_ms": timed(lambda: expert_outputs(x, pool, rows, quant, math), reps),
    }
    for tile in tiles:
        y = expert_major_outputs(x, pool, rows, quant, math, tile)
        same = bool(mx.array_equal(ref, y).item())
        row[f"tile{tile}"] = {
            "ms": timed(lambda t=tile: expert_major_outputs(x, pool, rows, quant, math, t), reps),
            "same_bits": same,
            "max_abs_diff": 0.0 if same else float(mx.abs(ref - y).max().item()),
        }
    return row


def line(r: dict) -> str:
    cells = [f"{r['tokens']:>6} {r['mode']:>7} {r['dtype']:>8}  mlx-lm {r['mlx_lm_ms']:8.2f} ms"]
    for key, v in r.items():
        if key.startswith("tile"):
            same = "same" if v["same_bits"] else f"DIFF {v['max_abs_diff']:.1e}"
            ratio = r["mlx_lm_ms"] / v["ms"] if v["ms"] else 0.0
            cells.append(f"{key} {v['ms']:8.2f} ms {ratio:5.2f}x {same}")
    return " | ".join(cells)


def ints(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a list of integers") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: every value must be at least 1")
    return values


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.expert_major", description=__doc__)
    p.add_argument("--tokens", type=ints, default=[16, 64, 256, 512, 1024, 2048, 8192])
    p.add_argument("--tiles", type=ints, default=[16, 32, 64])
    p.add_argument("--shape", choices=SHAPES, default="30b")
    p.add_argument("--modes", action="store_true", help="also every mode and dtype (last tokens)")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--out", type=Path, help="write the rows as JSON here too")
    args = p.parse_args(argv)
    mx.random.seed(0)
    print(f"device {mx.default_device()}, shape {args.shape} {SHAPES[args.shape]}", flush=True)
    rows = []

    def add(r):
        rows.append(r)
        print(line(r), flush=True)
        if args.out:
            args.out.write_text(json.dumps(rows, indent=1))

    shape = SHAPES[args.shape]
    for n in args.tokens:
        add(compare(shape, "affine4", mx.bfloat16, n, args.tiles, args.reps))
    if args.modes:
        n, tile = args.tokens[-1], [max(args.tiles)]
        for mode in MODES:
            if mode != "affine4":
                add(compare(shape, mode, mx.bfloat16, n, tile, args.reps))
        for dtype in (mx.float16, mx.float32):
            add(compare(shape, "affine4", dtype, n, tile, args.reps))
        add(compare(SHAPES["gpt-oss"], "mxfp4", mx.bfloat16, n, tile, args.reps, bias=True))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
