"""In place or a copy: the in-place store (experts read from the checkpoint's own
safetensors files) against the blob store (every expert written again) of one checkpoint.

    python -m bench.inplace [--model DIR] [--layers 4] [--out DIR] [--reps 3] [--tokens 16]

The checkpoint is `--model` (an mlx-lm MoE model directory whose experts are stacked
tensors, an mlx-community checkpoint), else a Qwen3-30B-A3B-shaped one (random weights,
its real record size: 128 experts of about 3 MB per layer, `--layers` decoder layers)
written once under the work folder from a synthetic store (`engine.synthetic`). Both
stores of it are written; then, on the same model and in one process:

- what each costs to make: seconds, and bytes written (the index; the blob store's
  blobs, dense weights, config and tokenizer);
- the read rate of demand reads at queue depths 1, 4 and 8 (`bench.disk.engine_at_depth`:
  random misses, uncached, checksums on), MB/s of record bytes;
- decode and prefill tokens/s against mlx-lm resident, with every expert cacheable and
  with a quarter of them, each configuration `--reps` times from a freshly loaded model
  in round-robin order, the median reported.

Writes `<out>/inplace.json` and prints the table docs/benchmarks.md quotes.
"""

import argparse
import gc
import json
import platform
import shutil
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx_lm.utils import load_model

from bench.common import machine_load, prompt_ids, timed_generate
from bench.disk import engine_at_depth
from engine.config import StreamConfig
from engine.convert import convert, index_in_place
from engine.flags import positive_int
from engine.memory import human_bytes
from engine.model import load
from engine.store import CONFIG_FILE, ExpertStore
from engine.synthetic import QWEN3_30B_A3B, ensure_store

DEPTHS = (1, 4, 8)
FRACTIONS = (1.0, 0.25)


def checkpoint_from_store(store: ExpertStore, out: Path) -> Path:
    """Writes an mlx-community checkpoint of the blob store `store` to `out`: its dense
    weights in `model-00000-of-N.safetensors`, each MoE layer's experts stacked per
    segment (`<module>.<key>` of shape (num_experts, *shape)) in a file of its own, the
    index and config.json; mlx-lm loads it as it loads any such checkpoint."""
    out.mkdir(parents=True)
    m = store.manifest
    n = len(m.layers) + 1
    names = [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(n)]
    weight_map = {}
    dense = store.dense_weights()
    mx.save_safetensors(str(out / names[0]), dense, metadata={"format": "mlx"})
    weight_map |= dict.fromkeys(dense, names[0])
    for i, spec in enumerate(m.layers, start=1):
        records = np.fromfile(store.blob_path(spec), dtype=np.uint8).reshape(m.num_experts, -1)
        tensors = {}
        for seg in spec.segments:
            part = records[:, seg.offset : seg.offset + seg.nbytes]
            dtype = getattr(mx, seg.dtype)
            stacked = mx.array(np.ascontiguousarray(part)).view(dtype)
            tensors[f"{spec.module}.{seg.key}"] = stacked.reshape(m.num_experts, *seg.shape)
        mx.save_safetensors(str(out / names[i]), tensors, metadata={"format": "mlx"})
        weight_map |= dict.fromkeys(tensors, names[i])
        del records, tensors
    index = {"metadata": {}, "weight_map": dict(sorted(weight_map.items()))}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    shutil.copyfile(store.path / CONFIG_FILE, out / CONFIG_FILE)
    return out


def tree_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and not f.is_symlink())


def timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def generate_once(path, fields: dict | None, prompt: list[int], tokens: int):
    """One generation from a freshly loaded model: the streamed engine on the store at
    `path` with `fields`, or mlx-lm resident on the checkpoint `path` (None)."""
    if fields is None:
        model = load_model(Path(path))[0]
        mx.eval(model.parameters())
    else:
        model = load(path, StreamConfig(**fields)).model
    t = timed_generate(model, prompt, tokens)
    del model
    gc.collect()
    mx.clear_cache()
    return t


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.inplace", description=__doc__)
    p.add_argument("--model", help="mlx-lm MoE model directory (default: synthetic)")
    p.add_argument(
        "--layers", type=positive_int, default=4, help="decoder layers of the synthetic model"
    )
    p.add_argument("--work", default="bench-inplace", help="folder of the stores written")
    p.add_argument("--out", default="bench-out", help="results folder")
    p.add_argument("--reps", type=positive_int, default=3)
    p.add_argument("--tokens", type=positive_int, default=16, help="tokens per generation")
    args = p.parse_args(argv)
    work, out = Path(args.work), Path(args.out)
    work.mkdir(parents=True, exist_ok=True)
    out.mkdir(parents=True, exist_ok=True)

    if args.model:
        ckpt = Path(args.model)
    else:
        ckpt = work / f"qwen3-30b-a3b-{args.layers}-layers"
        if not ckpt.exists():
            config = QWEN3_30B_A3B | {"num_hidden_layers": args.layers}
            print(f"writing a synthetic Qwen3-30B-A3B-shaped checkpoint to {ckpt}", flush=True)
            source = ensure_store(work / "synthetic", config)
            checkpoint_from_store(ExpertStore(source), ckpt)
            shutil.rmtree(source)
    for name in ("index", "blob"):
        shutil.rmtree(work / name, ignore_errors=True)
    index_path, index_s = timed(lambda: index_in_place(ckpt, work / "index"))
    blob_path, blob_s = timed(lambda: convert(ckpt, work / "blob"))
    stores = {"in-place": ExpertStore(index_path), "blob": ExpertStore(blob_path)}
    m = stores["blob"].manifest
    experts = sum(s.record_bytes for s in m.layers) * m.num_experts
    results = {
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor(),
            "device": str(mx.default_device()),
            **machine_load(),
        },
        "checkpoint": str(ckpt),
        "expert_bytes": experts,
        "record_bytes": m.layers[0].record_bytes,
        "make": {
            "in-place": {"seconds": index_s, "bytes_written": tree_bytes(index_path)},
            "blob": {"seconds": blob_s, "bytes_written": tree_bytes(blob_path)},
        },
    }
    print(
        f"{ckpt}: {human_bytes(experts)} of experts, records of "
        f"{human_bytes(m.layers[0].record_bytes)}; index {index_s:.1f} s, "
        f"{human_bytes(results['make']['in-place']['bytes_written'])}; blob store "
        f"{blob_s:.1f} s, {human_bytes(results['make']['blob']['bytes_written'])}",
        flush=True,
    )

    results["read_MBps"] = {}
    for depth in DEPTHS:
        row = {}
        for _ in range(args.reps):  # alternated: both see the same load
            for kind, store in stores.items():
                r = engine_at_depth(store, depth, 256 << 20)
                row.setdefault(kind, []).append(r["MBps"])
        results["read_MBps"][depth] = {k: statistics.median(v) for k, v in row.items()}
        print(
            f"depth {depth}: "
            + ", ".join(f"{k} {v:.0f} MB/s" for k, v in results["read_MBps"][depth].items()),
            flush=True,
        )

    prompt = prompt_ids(None, stores["blob"].vocab_size or 1000)
    runs = {"resident": (ckpt, None)}
    for fraction in FRACTIONS:
        slots = max(m.top_k, round(fraction * m.num_experts))
        for kind, store in stores.items():
            runs[f"{kind} {fraction:.0%}"] = (store.path, {"expert_slots": slots})
    timings = {name: [] for name in runs}
    for path, fields in runs.values():  # warm-up, discarded
        generate_once(path, fields, prompt, 2)
    for rep in range(args.reps):
        names = list(runs)
        names = names[rep % len(names) :] + names[: rep % len(names)]
        for name in names:
            path, fields = runs[name]
            timings[name].append(generate_once(path, fields, prompt, args.tokens))
    tokens = {name: t[0].tokens for name, t in timings.items()}
    assert all(t == tokens["resident"] for t in tokens.values()), "the tokens differ"
    res = {
        name: {
            "decode_tps": statistics.median(t.decode_tps for t in ts),
            "prefill_tps": statistics.median(t.prefill_tps for t in ts),
        }
        for name, ts in timings.items()
    }
    for r in res.values():
        r["decode_ratio"] = r["decode_tps"] / res["resident"]["decode_tps"]
        r["prefill_ratio"] = r["prefill_tps"] / res["resident"]["prefill_tps"]
    results["generate"] = res
    (out / "inplace.json").write_text(json.dumps(results, indent=2))

    print("\n| | in-place | blob |\n|---|---|---|")
    make = results["make"]
    print(f"| made in | {make['in-place']['seconds']:.1f} s | {make['blob']['seconds']:.1f} s |")
    print(
        f"| bytes written | {human_bytes(make['in-place']['bytes_written'])} | "
        f"{human_bytes(make['blob']['bytes_written'])} |"
    )
    for depth, row in results["read_MBps"].items():
        print(f"| read rate, depth {depth} | {row['in-place']:.0f} MB/s | {row['blob']:.0f} MB/s |")
    for fraction in FRACTIONS:
        a, b = res[f"in-place {fraction:.0%}"], res[f"blob {fraction:.0%}"]
        print(
            f"| decode / resident, {fraction:.0%} of experts | {a['decode_ratio']:.2f} | "
            f"{b['decode_ratio']:.2f} |"
        )
        print(
            f"| prefill / resident, {fraction:.0%} of experts | {a['prefill_ratio']:.2f} | "
            f"{b['prefill_ratio']:.2f} |"
        )
    r = res["resident"]
    print(
        f"\nresident (mlx-lm): decode {r['decode_tps']:.1f} tok/s, prefill "
        f"{r['prefill_tps']:.1f} tok/s ({len(prompt)} prompt tokens, {args.tokens} generated)"
    )
    print(f"wrote {out / 'inplace.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
