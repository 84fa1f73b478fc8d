"""Suite 3: the engine's reads against the disk's limit, and proof they bypass the cache.

Raw bandwidth: record-sized `pread`s of a store's blob files, sequential (records in file
order) and random (shuffled over all files), with 1 and N threads, uncached (`O_DIRECT`
into page-aligned `mmap` buffers, after `posix_fadvise(DONTNEED)` of every file). Then the
engine's own bandwidth while generating (demand reads only, prefetch off): bytes_read
over the time a read was in flight (`reading_seconds`) and over the wall time.
Page-cache residency of the blob files (`mincore` on a mapping) before and after each
run shows whether reads went through the page cache; a buffered control run shows the
opposite.
"""

import ctypes
import mmap
import os
import random
import sys
import threading
import time
from pathlib import Path

import numpy as np

from bench.common import prompt_ids, timed_generate
from engine.cache import CRC32_IMPLEMENTATION, open_cache, snapshot
from engine.config import StreamConfig
from engine.flags import positive_int
from engine.memory_plan import default_reader_threads
from engine.model import load
from engine.store import ExpertStore

_PAGE = mmap.PAGESIZE


def blob_paths(store: ExpertStore) -> list[Path]:
    return [store.blob_path(spec) for spec in store.manifest.layers]


def evict(paths) -> None:
    """Drops the clean page-cache pages of `paths` (POSIX_FADV_DONTNEED)."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _libc():
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = (
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_long,
    )
    libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
    libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte))
    return libc


def resident_fraction(paths) -> float | None:
    """Fraction of the pages of `paths` in the page cache (mincore), None where the
    platform has no mincore."""
    if not sys.platform.startswith("linux"):
        return None
    libc = _libc()
    resident = total = 0
    for p in paths:
        size = os.path.getsize(p)
        if size == 0:
            continue
        fd = os.open(p, os.O_RDONLY)
        try:
            addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
            if addr in (None, ctypes.c_void_p(-1).value):
                return None
            pages = (size + _PAGE - 1) // _PAGE
            vec = (ctypes.c_ubyte * pages)()
            rc = libc.mincore(addr, size, vec)
            libc.munmap(addr, size)
            if rc != 0:
                return None
            resident += sum(b & 1 for b in bytes(vec))
            total += pages
        finally:
            os.close(fd)
    return resident / total if total else 0.0


_HUGE = 2 << 20


def _read_buffer(size: int, huge_pages: bool) -> tuple[mmap.mmap, memoryview]:
    """A private anonymous mapping and a page-aligned view of `size` bytes in it; with
    `huge_pages`, 2 MiB-aligned and advised MADV_HUGEPAGE where the platform has it."""
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
    if not huge_pages:
        buf = mmap.mmap(-1, size, flags=flags)
        return buf, memoryview(buf)
    buf = mmap.mmap(-1, size + _HUGE, flags=flags)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        buf.madvise(mmap.MADV_HUGEPAGE)
    addr = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    off = -addr % _HUGE
    return buf, memoryview(buf)[off : off + size]


def raw_pread(
    paths,
    stride: int,
    pattern: str,
    threads: int,
    max_bytes: int,
    direct: bool = True,
    evict_first: bool = True,
    seed: int = 0,
    huge_pages: bool = True,
) -> dict:
    """Record-sized preads of `paths` (each a sequence of `stride`-byte records).

    Args:
        pattern: "seq" (file by file, records in order; threads take contiguous shares)
            or "rand" (records shuffled over all files).
        max_bytes: read this many bytes (whole records), going over the files again
            when they are smaller (only meaningful uncached).
        direct: O_DIRECT (falls back to buffered if the file system refuses it).
        huge_pages: read into 2 MiB-aligned buffers advised MADV_HUGEPAGE (O_DIRECT
            into 4 KiB pages pins every page, and runs far slower).

    Returns:
        {"pattern", "threads", "bytes", "seconds", "MBps", "direct"}.
    """
    if pattern not in ("seq", "rand"):
        raise ValueError(f"pattern {pattern!r} not in ('seq', 'rand')")
    per_file = [os.path.getsize(p) // stride for p in paths]
    every = [(fi, r) for fi, n in enumerate(per_file) for r in range(n)]
    budget = max(1, max_bytes // stride)
    rng = random.Random(seed)
    tasks = []
    while len(tasks) < budget:  # files smaller than max_bytes are read again (uncached)
        tasks += rng.sample(every, len(every)) if pattern == "rand" else every
    tasks = tasks[:budget]
    if evict_first:
        evict(paths)
    flags = os.O_RDONLY | (getattr(os, "O_DIRECT", 0) if direct else 0)
    used_direct = direct and hasattr(os, "O_DIRECT")
    try:
        fds = [os.open(p, flags) for p in paths]
    except OSError:
        fds = [os.open(p, os.O_RDONLY) for p in paths]
        used_direct = False
    if pattern == "seq":
        share = -(-len(tasks) // threads)
        parts = [tasks[i * share : (i + 1) * share] for i in range(threads)]
    else:
        parts = [tasks[i::threads] for i in range(threads)]
    errors = []

    def work(part):
        buf, view = _read_buffer(stride, huge_pages)
        try:
            for fi, r in part:
                if os.preadv(fds[fi], [view], r * stride) != stride:
                    raise OSError(f"short read in {paths[fi]} record {r}")
        except OSError as e:
            errors.append(e)
        finally:
            view.release()
            buf.close()

    workers = [threading.Thread(target=work, args=(p,)) for p in parts]
    t0 = time.perf_counter()
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    seconds = time.perf_counter() - t0
    for fd in fds:
        os.close(fd)
    if errors:
        raise errors[0]
    nbytes = len(tasks) * stride
    return {
        "pattern": pattern,
        "threads": threads,
        "bytes": nbytes,
        "seconds": seconds,
        "MBps": nbytes / seconds / 1e6 if seconds > 0 else 0.0,
        "direct": used_direct,
        "huge_pages": huge_pages,
    }


def raw_sweep(
    paths, stride: int, thread_counts, max_bytes: int, reps: int = 3, log=print
) -> list[dict]:
    """`raw_pread` for each pattern x thread count into huge-page buffers, plus random
    reads into 4 KiB pages with the most threads, `reps` times each: the median MB/s
    (`MBps`) and the spread (`MBps_spread`)."""
    out = []
    cases = [(pattern, n, True) for pattern in ("seq", "rand") for n in thread_counts]
    cases.append(("rand", max(thread_counts), False))
    for pattern, n, huge in cases:
        runs = [
            raw_pread(paths, stride, pattern, n, max_bytes, seed=i, huge_pages=huge)
            for i in range(reps)
        ]
        speeds = sorted(r["MBps"] for r in runs)
        r = dict(
            runs[0],
            MBps=speeds[len(speeds) // 2],
            MBps_spread=[speeds[0], speeds[-1]],
            reps=reps,
        )
        out.append(r)
        log(
            f"raw pread {pattern} x{n} threads, {'2 MiB' if huge else '4 KiB'} pages: "
            f"{r['MBps']:.0f} MB/s "
            f"({speeds[0]:.0f}..{speeds[-1]:.0f}; {r['bytes'] / 1e6:.0f} MB per pass, "
            f"O_DIRECT={r['direct']})"
        )
    return out


def best_random(raw: list[dict]) -> dict:
    """The fastest random-read case of a `raw_sweep`: the disk's limit for record reads
    in any order (the engine reads records in routing order)."""
    return max((r for r in raw if r["pattern"] == "rand"), key=lambda r: r["MBps"])


def engine_at_depth(
    store: ExpertStore, depth: int, max_bytes: int, seed: int = 0, **fields
) -> dict:
    """Demand reads through the native cache with exactly `depth` misses per `acquire`
    call: the engine's read path at queue depth `depth` (no model, no compute).

    Calls go round the MoE layers; each asks for `depth` random experts of its layer that
    the previous call of that layer did not hold, into a real region of `depth` slots, so
    every id misses. `fields` override the StreamConfig (reader_threads, verify_checksums,
    io_uring, ...); the blob files are evicted from the page cache first.

    Returns:
        {"depth", "calls", "threads", "verify", "io_uring", "bytes", "read_seconds",
        "MBps"}: io_uring tells whether the demand reads went through io_uring (else the
        reader threads); bytes is the cache's bytes_read (calls x depth x stride), MBps
        bytes / read_seconds (the time inside the calls' reads).

    Raises:
        ValueError: 2 * depth exceeds the store's experts per layer.
    """
    m = store.manifest
    if 2 * depth > m.num_experts:
        raise ValueError(f"depth {depth}: needs 2 x depth <= {m.num_experts} experts per layer")
    config = StreamConfig(expert_slots=depth, scratch_slots=depth, **fields)
    layers = len(m.layers)
    calls = max(layers, max_bytes // (m.layers[0].stride * depth))
    rng = np.random.default_rng(seed)
    held = [np.empty(0, np.int32)] * layers
    ids = []
    for c in range(calls):
        li = c % layers
        free = np.setdiff1d(np.arange(m.num_experts, dtype=np.int32), held[li])
        held[li] = rng.choice(free, depth, replace=False).astype(np.int32)
        ids.append(held[li])
    evict(blob_paths(store))
    cache = open_cache(store, config)
    for c, pick in enumerate(ids):
        cache.acquire(c % layers, pick)
    snap = snapshot(cache)
    t = snap.totals()
    del cache
    return {
        "depth": depth,
        "calls": calls,
        "threads": config.reader_threads or default_reader_threads(m.top_k),
        "verify": config.verify_checksums,
        "io_uring": snap.io_uring,
        "bytes": t["bytes_read"],
        "read_seconds": t["read_seconds"],
        "MBps": t["bytes_read"] / t["read_seconds"] / 1e6 if t["read_seconds"] else 0.0,
    }


# The engine's two ways of demand reading (StreamConfig.io_uring), named as the results
# name them.
READ_PATHS = {"io_uring": True, "threads": False}


def depth_sweep(
    store: ExpertStore,
    depths=(1, 2, 4, 8),
    max_bytes: int = 256 << 20,
    rounds: int = 3,
    log=print,
    **fields,
) -> list[dict]:
    """Raw random O_DIRECT pread with `depth` threads (huge-page buffers) and
    `engine_at_depth(depth)` both ways (`READ_PATHS`: io_uring, and the reader threads),
    alternated `rounds` times per depth so all three see the same load (the two engine
    runs swap order every round). Depths above half the store's experts per layer are
    skipped.

    Returns:
        Per depth {"depth", "threads", "verify", "raw_MBps", "paths", "path",
        "engine_MBps", "ratio", "ratios"}: threads the reader threads, raw_MBps the
        median raw rate; paths[name] for each name of READ_PATHS {"engine_MBps",
        "ratio", "ratios"} (medians over the rounds, and each round's engine / raw), None
        for io_uring where the kernel has none; path the one the engine uses by default
        (io_uring where the kernel has it) and the last three its figures.
    """
    m = store.manifest
    paths = blob_paths(store)
    stride = m.layers[0].stride
    out = []
    for depth in depths:
        if 2 * depth > m.num_experts:
            continue
        raws, engines = [], {name: [] for name in READ_PATHS}
        for i in range(rounds):
            raws.append(raw_pread(paths, stride, "rand", depth, max_bytes, seed=200 + i)["MBps"])
            order = list(READ_PATHS) if i % 2 == 0 else list(reversed(READ_PATHS))
            for name in order:
                engines[name].append(
                    engine_at_depth(
                        store, depth, max_bytes, seed=200 + i, io_uring=READ_PATHS[name], **fields
                    )
                )
        mid = len(raws) // 2
        last = engines["threads"][-1]
        r = {
            "depth": depth,
            "threads": last["threads"],
            "verify": last["verify"],
            "raw_MBps": sorted(raws)[mid],
        }
        r["paths"] = {}
        for name, runs in engines.items():
            if runs[0]["io_uring"] != READ_PATHS[name]:  # asked for io_uring, not there
                r["paths"][name] = None
                continue
            ratios = [e["MBps"] / raw for e, raw in zip(runs, raws, strict=True)]
            r["paths"][name] = {
                "engine_MBps": sorted(e["MBps"] for e in runs)[mid],
                "ratio": sorted(ratios)[mid],
                "ratios": ratios,
            }
        default = "io_uring" if r["paths"]["io_uring"] else "threads"
        r |= dict(r["paths"][default], path=default)
        out.append(r)

        log(
            f"depth {depth}: raw {r['raw_MBps']:.0f} MB/s; "
            + "; ".join(_path_text(name, p) for name, p in r["paths"].items())
            + f" ({r['threads']} reader threads, checksums "
            + (f"on, {CRC32_IMPLEMENTATION})" if r["verify"] else "off)")
        )
    return out


def _path_text(name: str, p: dict | None) -> str:
    """One read path's figures of a `depth_sweep` row, for its log line."""
    if p is None:
        return f"{name}: n/a (no io_uring here)"
    each = ", ".join(f"{x:.2f}" for x in p["ratios"])
    return f"{name} {p['engine_MBps']:.0f} MB/s, ratio {p['ratio']:.2f} ({each})"


def engine_bandwidth(
    store: ExpertStore,
    slots: int,
    prompt: list[int],
    max_tokens: int,
    uncached: bool = True,
    threads: int | None = None,
) -> dict:
    """Generates with demand reads only (prefetch off) and reports the engine's read
    bandwidth and the blob files' page-cache residency before and after."""
    paths = blob_paths(store)
    evict(paths)
    before = resident_fraction(paths)
    sm = load(
        store.path, StreamConfig(expert_slots=slots, uncached_io=uncached, reader_threads=threads)
    )
    timing = timed_generate(sm.model, prompt, max_tokens)
    t, reading = sm.snapshot().totals(), sm.cache.reading_seconds
    del sm
    after = resident_fraction(paths)
    return {
        "uncached_io": uncached,
        "slots": slots,
        "threads": threads or default_reader_threads(store.manifest.top_k),
        "tokens": timing.prompt_tokens + len(timing.tokens),
        "bytes_read": t["bytes_read"],
        "loads": t["loads"],
        "read_seconds": t["read_seconds"],
        "wall_seconds": timing.wall_s,
        "reading_seconds": reading,
        "MBps_while_reading": t["bytes_read"] / reading / 1e6 if reading else 0.0,
        "MBps_wall": t["bytes_read"] / timing.wall_s / 1e6 if timing.wall_s > 0 else 0.0,
        "read_share_of_wall": t["read_seconds"] / timing.wall_s if timing.wall_s else 0.0,
        "resident_before": before,
        "resident_after": after,
    }


def io_suite(
    store: ExpertStore,
    tokenizer=None,
    slots: int | None = None,
    max_tokens: int = 32,
    max_bytes: int = 1 << 30,
    thread_counts=(1, 2, 4),
    reps: int = 3,
    depths=(1, 2, 4, 8),
    log=print,
) -> dict:
    """Raw pread bandwidths, a second-pass check, the engine's bandwidth (uncached, and a
    buffered control), the ratio engine / best raw random pread, and `depth_sweep`: the
    engine against raw random pread at the same queue depth, `reps` rounds per depth."""
    paths = blob_paths(store)
    stride = store.manifest.layers[0].stride
    m = store.manifest
    slots = slots or max(m.top_k, m.num_experts // 8)
    raw = raw_sweep(paths, stride, thread_counts, max_bytes, reps, log)
    # The time of a second read: uncached stays as slow, buffered becomes a memory copy.
    second = {}
    once = min(max_bytes, sum(os.path.getsize(p) for p in paths))
    for direct in (True, False):
        first = raw_pread(paths, stride, "seq", 1, once, direct=direct)
        again = raw_pread(paths, stride, "seq", 1, once, direct=direct, evict_first=False)
        second["direct" if direct else "buffered"] = {
            "first_MBps": first["MBps"],
            "second_MBps": again["MBps"],
            "resident_after": resident_fraction(paths),
        }
    evict(paths)
    prompt = prompt_ids(tokenizer, store.config["vocab_size"])
    engine = engine_bandwidth(store, slots, prompt, max_tokens, uncached=True)
    log(
        f"engine (O_DIRECT, {slots} slots, prefetch off): "
        f"{engine['MBps_while_reading']:.0f} MB/s while reading, {engine['MBps_wall']:.0f} "
        f"MB/s over wall time; blob residency {engine['resident_before']:.1%} -> "
        f"{engine['resident_after']:.1%}"
    )
    control = engine_bandwidth(store, slots, prompt, max_tokens, uncached=False)
    log(
        f"engine control (buffered): residency {control['resident_before']:.1%} -> "
        f"{control['resident_after']:.1%}"
    )
    evict(paths)
    log("engine vs raw random pread at the same queue depth (misses per acquire call):")
    depth = depth_sweep(store, depths, min(max_bytes, 256 << 20), reps, log)
    evict(paths)
    ref = best_random(raw)
    return {
        "depth": depth,
        "raw": raw,
        "second_read": second,
        "engine": engine,
        "engine_buffered": control,
        "reference": {
            "pattern": ref["pattern"],
            "threads": ref["threads"],
            "huge_pages": ref["huge_pages"],
            "MBps": ref["MBps"],
        },
        "ratio_while_reading": engine["MBps_while_reading"] / ref["MBps"] if ref["MBps"] else 0,
        "ratio_wall": engine["MBps_wall"] / ref["MBps"] if ref["MBps"] else 0,
    }


def main(argv=None) -> int:
    """`python -m bench.disk [STORE] [--depths 1,2,4,8] [--mb 256] [--rounds 3]`: the
    depth sweep alone (engine vs raw at the same queue depth), checksums on and off."""
    import argparse

    from engine.model import resolve_store
    from engine.resources import default_model_path

    p = argparse.ArgumentParser(prog="python -m bench.disk", description=main.__doc__)
    p.add_argument("store", nargs="?", help="model directory or expert store (default: embedded)")
    p.add_argument("--depths", default="1,2,4,8", help="queue depths, comma-separated")
    p.add_argument("--mb", type=positive_int, default=256, help="MB read per run")
    p.add_argument("--rounds", type=positive_int, default=3)
    p.add_argument("--threads", type=positive_int, default=None, help="engine reader threads")
    args = p.parse_args(argv)
    store = resolve_store(args.store or default_model_path())
    fields = {} if args.threads is None else {"reader_threads": args.threads}
    depths = [int(d) for d in args.depths.split(",")]
    for verify in (True, False):
        depth_sweep(store, depths, args.mb << 20, args.rounds, verify_checksums=verify, **fields)
    return 0


if __name__ == "__main__":
    sys.exit(main())
