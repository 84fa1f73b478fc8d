"""Converting a model larger than the memory budget: a Qwen3-30B-A3B-shaped checkpoint
(about 17 GB) through `expertstream convert` inside a 4 GiB memory cgroup.

Users convert on the machine that cannot hold the model, so conversion must stay bounded
by the dense weights plus one MoE layer. This benchmark writes the checkpoint in mlx-lm's
own on-disk format (mlx-lm's `quantize_model` and `save_model`: 4-bit, group 64, routers
at 8 bits, sharded safetensors with an index; random weights, generated lazily so the
writer holds one shard at a time), converts it in a child process inside a memory cgroup
of `--budget-gib`, and reports wall time, the child's peak RSS (sampled from
/proc/PID/status every 20 ms: VmRSS, and its parts RssAnon, the converter's own memory,
and RssFile, checkpoint pages MLX maps) and the cgroup's peak (RSS plus the page cache it
was charged). The checkpoint's pages are evicted from the page cache first, so that the
converter's reads are charged to its own cgroup. The checkpoint and the store are deleted
afterwards unless `--keep`.

    python -m bench.convert_memory WORK_DIR [--budget-gib 4] [--keep]
"""

import argparse
import contextlib
import io
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten, tree_map
from mlx_lm.utils import _get_classes, quantize_model, save_config, save_model

from bench.limits import make_cgroup
from engine.synthetic import QWEN3_30B_A3B


def write_checkpoint(out: Path, config: dict = QWEN3_30B_A3B, seed: int = 0) -> int:
    """Write a random 4-bit mlx-lm checkpoint of `config` to `out`; returns its bytes.

    The model is built and quantized by mlx-lm with lazy parameters, which are then
    replaced by lazy random ones of the same shapes (uint32 codes, bfloat16 scales, biases
    and norms); mlx-lm's `save_model(donate_model=True)` evaluates and writes one shard at
    a time.
    """
    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    with contextlib.redirect_stdout(io.StringIO()):
        model, qconfig = quantize_model(model, dict(config), 64, 4)
    key = iter(mx.random.split(mx.random.key(seed), len(tree_flatten(model.parameters()))))

    def rand(p):
        if p.dtype == mx.uint32:  # two exact 16-bit halves: every nibble uniform
            hi, lo = mx.random.split(next(key))
            half = (mx.random.randint(0, 2**16, p.shape, mx.uint32, key=k) for k in (hi, lo))
            return (next(half) << 16) | next(half)
        return (0.02 * mx.random.normal(p.shape, key=next(key))).astype(mx.bfloat16)

    model.update(tree_map(rand, model.parameters()))
    save_model(out, model, donate_model=True)
    save_config(qconfig, out / "config.json")
    return sum(f.stat().st_size for f in out.glob("*.safetensors"))


def evict_from_page_cache(paths) -> None:
    """Drop the clean cached pages of `paths` (posix_fadvise DONTNEED), so that the
    converter's reads are charged to its own cgroup, not to the writer's."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _sample(pid: int, peaks: dict, done: threading.Event) -> None:
    """Peaks of VmHWM (the kernel's own RSS high-water mark), VmRSS, RssAnon and RssFile of
    process `pid`, read every 20 ms, in bytes."""
    while not done.wait(0.02):
        try:
            lines = Path(f"/proc/{pid}/status").read_text().splitlines()
        except OSError:
            return
        for line in lines:
            name, _, value = line.partition(":")
            if name in ("VmHWM", "VmRSS", "RssAnon", "RssFile"):
                peaks[name] = max(peaks.get(name, 0), int(value.split()[0]) * 1024)


def convert_in_cgroup(model_dir: Path, store_dir: Path, budget: int) -> dict:
    """`expertstream convert` in a child process inside a `budget`-byte memory cgroup.

    Returns:
        {"seconds", "peak_rss_bytes" (VmHWM, the kernel's high-water mark, as last read
        before the child exited), and sampled peaks "sampled_rss_bytes" (VmRSS),
        "peak_anon_bytes" (RssAnon: the converter's own memory), "peak_file_bytes"
        (RssFile: mapped checkpoint pages),
        "cgroup_peak_bytes" (RSS plus page cache charged), "bound" (the cgroup mechanism,
        or None with "reason"), "oom_kills", "returncode", "stderr"}.
    """
    argv = [sys.executable, "-m", "engine.cli", "convert", str(model_dir), str(store_dir)]
    cg, reason = make_cgroup(budget, "expertstream-convert")
    peaks: dict[str, int] = {}
    done = threading.Event()
    start = time.monotonic()
    try:
        proc = subprocess.Popen(
            cg.wrap(argv) if cg else argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
        sampler = threading.Thread(target=_sample, args=(proc.pid, peaks, done), daemon=True)
        sampler.start()
        _, stderr = proc.communicate()
        seconds = time.monotonic() - start
        done.set()
        sampler.join()
        return {
            "seconds": seconds,
            "peak_rss_bytes": peaks.get("VmHWM"),
            "sampled_rss_bytes": peaks.get("VmRSS"),
            "peak_anon_bytes": peaks.get("RssAnon"),
            "peak_file_bytes": peaks.get("RssFile"),
            "cgroup_peak_bytes": cg.peak_bytes() if cg else None,
            "bound": cg.mechanism if cg else None,
            "reason": reason,
            "oom_kills": cg.oom_kills() if cg else None,
            "returncode": proc.returncode,
            "stderr": stderr.decode(errors="replace").strip()[-300:],
        }
    finally:
        if cg is not None:
            cg.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("work_dir", type=Path, help="where the checkpoint and store go")
    parser.add_argument("--budget-gib", type=float, default=4.0)
    parser.add_argument("--keep", action="store_true", help="keep checkpoint and store")
    args = parser.parse_args(argv)
    model_dir, store_dir = args.work_dir / "qwen3-30b-a3b-4bit", args.work_dir / "store"
    for path in (model_dir, store_dir):
        if path.exists():
            parser.error(f"{path} exists; remove it first")
    try:
        start = time.monotonic()
        size = write_checkpoint(model_dir)
        print(f"wrote {size / 1e9:.2f} GB checkpoint in {time.monotonic() - start:.0f} s")
        shards = sorted(model_dir.glob("model-*.safetensors"))
        evict_from_page_cache(shards)
        result = convert_in_cgroup(model_dir, store_dir, int(args.budget_gib * 2**30))
        result |= {"checkpoint_bytes": size, "shards": len(shards), "budget_gib": args.budget_gib}
        if result["returncode"] == 0:
            blobs = sum(f.stat().st_size for f in store_dir.glob("layer*.blob"))
            result["store_blob_bytes"] = blobs
        print(json.dumps(result, indent=2))
        return 0 if result["returncode"] == 0 else 1
    finally:
        if not args.keep:
            shutil.rmtree(model_dir, ignore_errors=True)
            shutil.rmtree(store_dir, ignore_errors=True)
            with contextlib.suppress(OSError):
                os.rmdir(args.work_dir)


if __name__ == "__main__":
    sys.exit(main())
