"""Decode on an accelerator: the engine against its baselines, in one run.

Run where MLX has a GPU (MLX CUDA on Linux, Metal on a Mac):

    python -m bench.device --out DIR [--synthetic STORE] [--tokens N] [--side-slots N]
        [--prefill] [--batch] [--no-decode]

For the embedded model: mlx-lm resident, then the engine at 100/50/25/12.5% of the
experts, prefetch off and on, below 100% also with the CPU-stream acquire
(`device_acquire=False`, the path before the acquire kernels), tokens checked against
resident. For a synthetic Qwen3-30B-A3B-shaped store (`python -m engine.synthetic`, no
resident reference fits the comparison): at 100% a bare device table (the pools indexed
by `table[ids]` with no cache call at all: the ceiling of any expert cache on these
pools), then each fraction from a dropped page cache with no host tier (O_DIRECT reads),
prefetch on and off, and with prefetch and the host tier warmed by one decode. Each row
splits a decode token's time into the cache's acquire calls (demand reads included), the
reads alone, and the rest (compute, graph building and any wait), with the bytes read
from disk and copied from the host tier per token, the records demand-read and the
prefetch fills per token (used and wasted) with the prefetch degree the run ended at
(mean fills per prediction, `StreamConfig.adaptive_prefetch`), and the read rate while
reading (bytes over
the wall time with a read in flight, `reading_seconds`); the synthetic store's disk rows
against `dd`'s own O_DIRECT rate of two of its blob files just before and just after the
row (`dd_beside`). With --rounds R, the synthetic store's engine 100%, each fraction's
host-tier row, the same row with the fill stream (`StreamConfig.fill_stream`) and the
bare table again, alternated R times in one process.

With --prefill, time to first token of a long prompt: the embedded model's
1,536 tokens against mlx-lm resident at 100/25/12.5% of the experts; a synthetic store's
prompts of --prefill-tokens (2,048 by default) with every expert cached in mlx-lm's form
(the reference, up to 8,192 tokens) and expert-major (`StreamConfig.expert_major`), and
at 25% with the host tier (buffered reads: the store in the page cache, i.e. host RAM)
and O_DIRECT; each run from a fresh load, in alternated rounds
(`bench.decode.prefill_suite`), each row saying whether its first token and logits equal
the first row's, each engine row with the MB/s while reading (`reading_seconds`) beside
`dd`'s; then where one forward's time goes (`prefill_split`). --no-decode leaves the
decode rows out.

With --batch, many conversations at once (`bench.batch`): 1, 2, 4 and 8 clients
streaming replies through `expertstream serve` side by side, total and per-client tokens/s
and times to first token, and a client joining a running batch: the embedded model, and
a synthetic store at 100% and at 25% of the experts with the host tier, prefetch off
and on (--side-slots side rows, 2 x top_k by default; a batch's decode step predicts from
every reply's row). --clients picks the batch sizes.

Figures go to stdout, DIR/device.json and DIR/device.md, each section's as it ends.
"""

import argparse
import importlib.util
import json
import os
import re
import statistics
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx_lm.generate import generate_step

from engine.cache import CRC32_IMPLEMENTATION, NO_ROW, snapshot
from engine.config import ConfigError, StreamConfig
from engine.flags import positive_int
from engine.model import load
from engine.streamed_layer import StreamedExperts

FRACTIONS = (1.0, 0.5, 0.25, 0.125)
# What --batch's server and clients import (`bench.server`): checked before anything runs.
SERVE_MODULES = ("starlette", "uvicorn", "httpx")


def decode(model, prompt: list[int], tokens: int) -> tuple[list[int], float, float]:
    """mlx-lm's own pipelined decode loop (greedy). Returns the tokens, the seconds from
    the first token to the last, and the prefill seconds."""
    out, t0, t_first = [], time.perf_counter(), None
    for y, _ in generate_step(mx.array(prompt), model, max_tokens=tokens):
        out.append(int(y))
        if t_first is None:
            t_first = time.perf_counter()
    return out, time.perf_counter() - t_first, t_first - t0


def mailbox_answers(sm) -> tuple[int, int, int]:
    """(answered from the hit table, answered, record copies handed to the fill stream)
    by the acquire kernels' mailbox so far, once its thread has answered every request;
    zeros without one."""
    box = sm.predictor.mailbox
    if box is None:
        return 0, 0, 0
    box.wait()
    return box.fast_answers, box.answered, box.fill_batches[1]


def run_streamed(sm, prompt, tokens, sync_path=False) -> dict:
    """One decode run through the engine; cache figures per decode token."""
    sm.predictor.on_acquire = (lambda layer, ids: None) if sync_path else None
    out, t0, t_first, before = [], time.perf_counter(), None, None
    for y, _ in generate_step(mx.array(prompt), sm.model, max_tokens=tokens):
        out.append(int(y))
        if t_first is None:  # the prompt is done: count decode from here
            t_first = time.perf_counter()
            before, reading0 = snapshot(sm.cache).totals(), sm.cache.reading_seconds
            answers0 = mailbox_answers(sm)
    dt = time.perf_counter() - t_first
    sm.cache.raise_stream_error()
    sm.predictor.on_acquire = None
    after = snapshot(sm.cache).totals()
    fast, answered, beside = (a - b for a, b in zip(mailbox_answers(sm), answers0, strict=True))
    n = max(len(out) - 1, 1)
    d = {
        k: after[k] - before[k]
        for k in (
            "hits",
            "misses",
            "bytes_read",
            "host_bytes",
            "prefetch_issued",
            "prefetch_used",
            "prefetch_wasted",
        )
    }
    snap = snapshot(sm.cache)
    targets = (snap.side_state != NO_ROW).any(axis=1)  # the layers with side rows
    lookups = d["hits"] + d["misses"]
    acq = after["acquire_seconds"] - before["acquire_seconds"]
    rd = after["read_seconds"] - before["read_seconds"]
    reading = sm.cache.reading_seconds - reading0
    return {
        "tokens": out,
        "decode_tps": n / dt,
        "prefill_s": t_first - t0,
        "hit_rate": d["hits"] / lookups if lookups else 0.0,
        "ms_per_token": 1e3 * dt / n,
        "acquire_ms_per_token": 1e3 * acq / n,
        # the acquire kernels' requests that took their rows from the hit table
        "hit_table_share": fast / answered if answered else 0.0,
        # record copies (a segment of an expert each) the fill stream made beside the compute
        "fill_copies_beside_per_token": beside / n,
        "read_ms_per_token": 1e3 * rd / n,
        "other_ms_per_token": 1e3 * (dt - acq) / n,
        "MB_read_per_token": d["bytes_read"] / n / 1e6,
        "MB_host_per_token": d["host_bytes"] / n / 1e6,
        "demand_reads_per_token": d["misses"] / n,
        "fills_per_token": d["prefetch_issued"] / n,
        "fills_used_per_token": d["prefetch_used"] / n,
        "fills_wasted_per_token": d["prefetch_wasted"] / n,
        # where the adaptive degree ended: fills per prediction, mean over the layers with
        # side rows, and the threshold a fill had to reach (StreamConfig.adaptive_prefetch)
        "prefetch_degree": float(snap.degree[targets].mean()) if targets.any() else 0.0,
        "prefetch_threshold": snap.kept_threshold,
        # Over the wall time with a read in flight (demand reads and fills counted
        # once where they overlap): the figure dd's rate compares with.
        "reading_ms_per_token": 1e3 * reading / n,
        "MBps_while_reading": d["bytes_read"] / reading / 1e6 if reading else 0.0,
    }


def bare_table_call(self, x, indices):
    """The ceiling: this layer's pools indexed by the device table, no cache call."""
    return self._experts(x, self._table[indices])


def drop_page_cache() -> None:
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    except OSError:
        pass  # not root: uncached (O_DIRECT) reads make it matter little


def dd_rate(path: Path) -> float:
    """MB/s (1e6 bytes) of one O_DIRECT sequential read of `path` with 2 MiB blocks by
    dd: the bytes and seconds it reports (its own rate has two significant figures), or
    0.0 where dd cannot read it so (a file system without O_DIRECT, such as tmpfs)."""
    r = subprocess.run(
        ["dd", f"if={path}", "of=/dev/null", "bs=2M", "iflag=direct"],
        capture_output=True,
        text=True,
        env=os.environ | {"LC_ALL": "C"},
    )
    # GNU dd's last line: "N bytes (...) copied, S s, R GB/s" (S as %g: 2.3e-05 too).
    done = re.search(r"^(\d+) bytes .*copied, ([\d.e+-]+) s,", r.stderr, re.MULTILINE)
    if r.returncode != 0 or not done or not float(done[2]):
        return 0.0
    return int(done[1]) / float(done[2]) / 1e6


def dd_beside(store: Path) -> float:
    """`dd_rate` of two of `store`'s blob files (a quarter and three quarters through its
    layers), their mean, or 0.0 (unknown) where dd could not read one: a read-rate row
    compares with this taken just before and just after it, since a disk's rate can move
    within minutes (a cloud volume's does: docs/benchmarks.md)."""
    files = sorted(store.glob("layer*.blob"))
    rates = [dd_rate(files[i * len(files) // 4]) for i in (1, 3)]
    return statistics.mean(rates) if all(rates) else 0.0


def fractions(text: str) -> tuple[float, ...]:
    """An argparse type: comma-separated fractions of the experts, each in (0, 1]."""
    try:
        values = tuple(float(f) for f in text.split(","))
    except ValueError:
        values = ()
    if not values or not all(0.0 < v <= 1.0 for v in values):
        raise argparse.ArgumentTypeError(
            f"must be fractions in (0, 1] separated by commas, e.g. 1,0.25; got {text!r}"
        )
    return values


def lengths(text: str) -> tuple[int, ...]:
    """--prefill-tokens, --clients: comma-separated counts (prompt lengths, clients at
    once), each at least 1."""
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a list of counts") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: every count must be at least 1")
    return values


def decode_tokens(text: str) -> int:
    """An argparse type: tokens per decode run, at least 2 (the rate is over the tokens
    after the first)."""
    value = positive_int(text)
    if value < 2:
        raise argparse.ArgumentTypeError(f"must be an integer >= 2, got {text!r}")
    return value


def row(label: str, r: dict, base: float) -> str:
    dd = r.get("dd_MBps")
    return (
        f"| {label} | {r['decode_tps']:.1f} | {r['decode_tps'] / base:.2f} | "
        f"{r['hit_rate']:.1%} | {r['hit_table_share']:.0%} | {r['ms_per_token']:.2f} | "
        f"{r['acquire_ms_per_token']:.2f} | "
        f"{r['read_ms_per_token']:.2f} | {r['other_ms_per_token']:.2f} | "
        f"{r['MB_read_per_token']:.1f} | {r['MB_host_per_token']:.1f} | "
        f"{r['demand_reads_per_token']:.1f} | {r['fills_per_token']:.1f} "
        f"({r['fills_used_per_token']:.1f}, {r['fills_wasted_per_token']:.1f}) · "
        f"{r['prefetch_degree']:.1f} | {r['fill_copies_beside_per_token']:.1f} | "
        f"{r['reading_ms_per_token']:.2f} | {r['MBps_while_reading']:.0f} | "
        + (f"{dd:.0f} | {r['MBps_while_reading'] / dd:.2f} | " if dd else " | | ")
        + f"{r.get('same_tokens', '')} |"
    )


HEADER = (
    "| run | decode tok/s | ÷ baseline | hit rate | from the hit table | ms/token | acquire ms "
    "| of it reads ms "
    "| rest ms | MB read/token | MB from host tier/token | demand reads/token "
    "| fills/token (used, wasted) · degree | fill copies beside the compute/token "
    "| ms with a read in flight | MB/s while reading "
    "| dd MB/s beside | ÷ dd | same tokens as baseline |\n"
    "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
)


def alternated(runs: dict[str, Callable[[], float]], rounds: int, log) -> dict:
    """Each run's decode tok/s over `rounds` rounds in turn (round 1 runs every entry
    once, then round 2, ...), so that drift in the machine's speed falls on all alike; the
    first entry is the baseline, and each round's ratio to the baseline of the same round
    is kept. Logs a table of medians, the median ratio and its spread (min..max)."""
    tps = {name: [] for name in runs}
    for _ in range(rounds):
        for name, run in runs.items():
            tps[name].append(run())
    base_name = next(iter(runs))
    out = {}
    log(
        f"\n{rounds} alternated rounds, each ratio against the baseline of its own round:\n\n"
        "| run | median tok/s | ÷ baseline, median | min..max |\n|---|---|---|---|"
    )
    for name, values in tps.items():
        ratios = [v / b for v, b in zip(values, tps[base_name], strict=True)]
        out[name] = {"decode_tps": values, "ratios": ratios}
        log(
            f"| {name} | {statistics.median(values):.1f} | {statistics.median(ratios):.2f} | "
            f"{min(ratios):.2f}..{max(ratios):.2f} |"
        )
    return out


def tps_of(model, prompt: list[int], tokens: int) -> Callable[[], float]:
    """A run for `alternated`: one decode of `model`, its tok/s."""

    def run() -> float:
        out, dt, _ = decode(model, prompt, tokens)
        return (len(out) - 1) / dt

    return run


def embedded(tokens: int, log, fractions=FRACTIONS, rounds=None, side_slots=None, res=None) -> dict:
    """The embedded model's rows (module docstring), into `res` (a new dict by default)
    as they are measured; returns it."""
    from mlx_lm import load as mlx_load

    from engine.resources import default_model_path

    path = default_model_path()
    model, tok = mlx_load(str(path))
    prompt = tok.encode("Once upon a time, there was a little girl named Lily.")
    decode(model, prompt, 8)  # first use of each kernel compiles it
    ref, dt, _ = decode(model, prompt, tokens)
    base = (len(ref) - 1) / dt
    res = {} if res is None else res
    res |= {"resident": {"decode_tps": base}, "runs": {}}
    probe = load(None, StreamConfig())
    e, k = probe.cache.num_experts, probe.store.manifest.top_k
    on = {"side_slots": side_slots or 2 * k, "prefetch": True}
    res["side_slots"] = on["side_slots"]
    log(
        f"\n### Embedded model, {tokens} tokens: mlx-lm resident {base:.1f} tok/s; "
        f"prefetch side rows per bank: {on['side_slots']}\n\n"
        f"(pool writes: {probe.cache.pool_writes}; record crc32: {CRC32_IMPLEMENTATION})"
        f"\n\n{HEADER}"
    )
    del probe
    for frac in fractions:
        slots = max(k, round(e * frac))  # never below top-k, as the CLI refuses
        for prefetch in (False, True):
            side = on if prefetch else {}
            # The CPU-stream acquire, the path before the acquire kernels, beside them.
            for device in [True] + ([False] if frac < 1.0 else []):
                cfg = StreamConfig(expert_slots=slots, device_acquire=device, **side)
                sm = load(None, cfg)  # 100%: filled at load
                run_streamed(sm, prompt, 8)  # warm the kernels and the cache
                r = run_streamed(sm, prompt, tokens)
                r["same_tokens"] = r.pop("tokens") == ref
                label = f"{frac:.1%} ({slots} slots), prefetch {'on' if prefetch else 'off'}"
                label += "" if device else ", CPU-stream acquire"
                res["runs"][label] = r
                log(row(label, r, base))
                del sm
    if rounds:
        runs = {"mlx-lm resident": tps_of(model, prompt, tokens)}
        for label, frac, fields in (
            ("100%", 1.0, {}),
            ("25%, prefetch off", 0.25, {}),
            ("25%, prefetch on", 0.25, on),
            ("12.5%, prefetch on", 0.125, on),
        ):
            sm = load(None, StreamConfig(expert_slots=max(k, round(e * frac)), **fields))
            run_streamed(sm, prompt, 8)
            runs[f"engine {label}"] = tps_of(sm.model, prompt, tokens)
        res["alternated"] = alternated(runs, rounds, log)
    return res


def synthetic(
    store: Path, tokens: int, log, fractions=FRACTIONS, rounds=None, side_slots=None, res=None
) -> dict:
    """A synthetic store's rows (module docstring), into `res` (a new dict by default) as
    they are measured; returns it."""
    rng = np.random.default_rng(0)
    probe = load(store, StreamConfig(expert_slots=1))
    e, k = probe.cache.num_experts, probe.store.manifest.top_k
    vocab = probe.store.config["vocab_size"]
    del probe
    prompt = rng.integers(0, vocab, 16).tolist()
    on = {"side_slots": side_slots or 2 * k, "prefetch": True}
    res = {} if res is None else res
    res |= {"runs": {}, "side_slots": on["side_slots"]}

    sm = load(store, StreamConfig())  # every expert: filled at load
    run_streamed(sm, prompt, 8)
    original = StreamedExperts.__call__
    StreamedExperts.__call__ = bare_table_call
    try:
        decode(sm.model, prompt, 8)
        bare_tokens, dt, _ = decode(sm.model, prompt, tokens)
    finally:
        StreamedExperts.__call__ = original
    base = (len(bare_tokens) - 1) / dt
    res["bare_table_tps"] = base
    log(
        f"\n### Store {store} ({e} experts, top-{k}), {tokens} tokens: "
        f"bare device table {base:.1f} tok/s; "
        f"prefetch side rows per bank: {on['side_slots']}\n\n"
        f"(pool writes: {sm.cache.pool_writes}; record crc32: {CRC32_IMPLEMENTATION})\n\n{HEADER}"
    )
    for sync_path in (False, True):
        r = run_streamed(sm, prompt, tokens, sync_path)
        r["same_tokens"] = r.pop("tokens") == bare_tokens
        label = f"100% ({e} slots)" + (", sync path (before)" if sync_path else "")
        res["runs"][label] = r
        log(row(label, r, base))

    def bare(model=sm.model) -> float:
        StreamedExperts.__call__ = bare_table_call
        try:
            return tps_of(model, prompt, tokens)()
        finally:
            StreamedExperts.__call__ = original

    # With --rounds the 100% model and each fraction's host-tier model stay loaded for the
    # alternated rounds at the end: single runs of these rows differ by more than their
    # gaps from one run to the next.
    kept = {"engine 100%": sm} if rounds else {}
    del sm
    for frac in [f for f in fractions if f < 1.0]:
        slots = max(k, round(e * frac))
        for label, fields, warm in (
            ("prefetch on, disk, O_DIRECT, no host tier", on | {"host_memory": None}, False),
            ("prefetch off, disk, O_DIRECT, no host tier", {"host_memory": None}, False),
            ("prefetch on, host tier (warmed by one decode)", on | {"host_memory": "auto"}, True),
        ):
            dd_before = None if warm else dd_beside(store)
            drop_page_cache()
            sm = load(store, StreamConfig(expert_slots=slots, **fields))
            if warm:
                run_streamed(sm, prompt, tokens)
            r = run_streamed(sm, prompt, tokens)
            if dd_before is not None:
                dd_after = dd_beside(store)
                r["dd_MBps"] = (dd_before + dd_after) / 2 if dd_before and dd_after else 0.0
            r["same_tokens"] = r.pop("tokens") == bare_tokens
            tier = sm.cache.host_tier
            r["host_tier"] = {"slots_per_layer": tier[0], "held": tier[1], "bytes": tier[2]}
            label = f"{frac:.1%} ({slots} slots), {label}"
            res["runs"][label] = r
            log(row(label, r, base))
            if warm and rounds:
                kept[f"engine {frac:.0%}, host tier"] = sm
            del sm
    if rounds:
        runs = {name: tps_of(s.model, prompt, tokens) for name, s in kept.items()}
        # Each host-tier row again with its fills copied by the fill stream beside the
        # compute (StreamConfig.fill_stream), not by the answers' copy kernel.
        for name, s in list(kept.items())[1:]:
            runs[f"{name}, fill stream"] = fill_stream(s, tps_of(s.model, prompt, tokens))
        res["alternated"] = alternated(runs | {"bare device table": bare}, rounds, log)
    return res


def fill_stream(sm, run: Callable[[], float]) -> Callable[[], float]:
    """`run` with the model's fill stream on (`Predictor.set_fill_stream`)."""

    def on() -> float:
        sm.predictor.set_fill_stream(True)
        try:
            return run()
        finally:
            sm.predictor.set_fill_stream(False)

    return on


def prefill(store: Path | None, log, rounds: int, lengths=(2048,)) -> dict:
    """Time to first token (module docstring): the embedded model, or `store` at each
    prompt length of `lengths` (past 8,192 tokens the 100% row alone), and where one
    forward of the first length's time goes (`prefill_split`, up to 8,192 tokens)."""
    from bench.common import prompt_ids
    from bench.decode import long_prompt, prefill_suite
    from engine.model import load_store_tokenizer, resolve_store
    from engine.resources import default_model_path

    if store is None:
        model = default_model_path()
        s = resolve_store(model)
        prompt = prompt_ids(load_store_tokenizer(s), s.config["vocab_size"])
        log("\n### Time to first token, embedded model\n")
        return prefill_suite(model, long_prompt(prompt, 1536), reps=rounds, log=log)
    vocab = resolve_store(store).config["vocab_size"]
    out = {}
    for n in lengths:
        prompt = np.random.default_rng(0).integers(0, vocab, n).tolist()
        # mlx-lm's form takes a minute at 16k tokens: the reference where it is quick
        # enough, else expert-major at 100% (whose own check compares the first chunk
        # of every layer kind with mlx-lm's form).
        configs = {"100%, mlx-lm's form": (1.0, {"expert_major": "off"})} if n <= 8192 else {}
        configs["100%"] = (1.0, {})
        if n <= 8192:  # past it the device's time goes to the 100% row
            configs |= {
                "25%, host tier": (0.25, {"uncached_io": False}),
                "25%, host tier warm": (0.25, {"uncached_io": False, "warm": True}),
                "25%, O_DIRECT": (0.25, {"uncached_io": True, "host_memory": None}),
            }
        log(f"\n### Time to first token, synthetic store, {n} tokens\n")
        before = dd_beside(store)
        # Past 2,048 tokens: one round, no warm-up (the shorter prompt's compiled the
        # kernels): mlx-lm's form alone takes half a minute at 8,192 tokens.
        first = n == lengths[0]
        out[str(n)] = prefill_suite(
            store, prompt, reps=rounds if first else 1, log=log, configs=configs, warm_up=first
        )
        after = dd_beside(store)
        out[str(n)]["dd_MBps"] = (before + after) / 2 if before and after else 0.0
        log(f"\ndd O_DIRECT beside these rows: {out[str(n)]['dd_MBps']:.0f} MB/s")
    if lengths[0] <= 8192:  # mlx-lm's form of longer prompts takes minutes
        log("\n### Where a prefill's time goes, synthetic store, 100%, one forward\n")
        out["split"] = {
            form: prefill_split(store, lengths[0], form, log) for form in ("off", "auto")
        }
    return out


def batch(
    store: Path | None, tokens: int, log, clients=None, side_slots: int | None = None
) -> dict:
    """Many conversations at once (`bench.batch.suite`, `clients` at once per row): the
    embedded model with every expert, or `store` at 100% and at 25% of the experts with
    the host tier, prefetch off and on (`side_slots` side rows, default 2 x top_k: each
    decode step predicts from every reply's row). `clients` None: `bench.batch.CLIENTS`."""
    from bench.batch import CLIENTS, suite
    from engine.model import resolve_store

    clients = clients or CLIENTS

    if store is None:
        log("\n### Many conversations at once, embedded model, every expert\n")
        return {"100%": suite(None, StreamConfig(), clients, tokens=tokens, log=log)}
    manifest = resolve_store(store).manifest
    quarter = max(manifest.top_k, manifest.num_experts // 4)
    side = side_slots or 2 * manifest.top_k
    out = {}
    for name, title, config in (
        ("100%", "100% of the experts", StreamConfig()),
        ("25%", "25% of the experts, host tier", StreamConfig(expert_slots=quarter)),
        (
            "25%, prefetch",
            f"25% of the experts, host tier, prefetch on ({side} side rows)",
            StreamConfig(expert_slots=quarter, prefetch=True, side_slots=side),
        ),
    ):
        log(f"\n### Many conversations at once, {store}, {title}\n")
        out[name] = suite(store, config, clients, tokens=tokens, log=log)
    return out


def prefill_split(store: Path, n: int, expert_major: str, log) -> dict:
    """One forward of an `n`-token prompt with every expert cached, timed whole, with
    the experts' math left out (their outputs zeros that still wait for the router),
    and with attention left out too: the experts' share is the first difference, the
    attention's the second, the rest (embeddings, norms, routers, dense layers, the
    head) what remains. Median of 3 after a warm-up, milliseconds."""
    from engine.model import resolve_store

    vocab = resolve_store(store).config["vocab_size"]
    tokens = mx.array([np.random.default_rng(1).integers(0, vocab, n).tolist()])
    sm = load(store, StreamConfig(expert_major=expert_major))
    layers = [m for m in sm.model.modules() if hasattr(m, "self_attn")]

    def forward_ms() -> float:
        mx.eval(sm.model(tokens))
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            mx.eval(sm.model(tokens))
            times.append(time.perf_counter() - t0)
        return 1e3 * statistics.median(times)

    def no_experts(self, x, indices):
        return mx.broadcast_to(
            (indices[..., None] * 0).astype(x.dtype), (*indices.shape, x.shape[-1])
        )

    def no_attention(x, *args, **kwargs):
        return mx.zeros_like(x)

    whole = forward_ms()
    call = StreamedExperts.__call__
    StreamedExperts.__call__ = no_experts
    try:
        without_experts = forward_ms()
        attention = [layer.self_attn for layer in layers]
        for layer in layers:
            layer.self_attn = no_attention
        try:
            rest = forward_ms()
        finally:
            for layer, a in zip(layers, attention, strict=True):
                layer.self_attn = a
    finally:
        StreamedExperts.__call__ = call
    split = {
        "tokens": n,
        "forward_ms": whole,
        "experts_ms": whole - without_experts,
        "attention_ms": without_experts - rest,
        "rest_ms": rest,
    }
    log(
        f"expert_major {expert_major}: forward {whole:.0f} ms = experts "
        f"{split['experts_ms']:.0f} + attention {split['attention_ms']:.0f} + rest "
        f"(embeddings, norms, routers, dense layers, head) {rest:.0f}"
    )
    return split


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="folder for device.json and device.md")
    p.add_argument("--synthetic", type=Path, help="a synthetic 30B-A3B-shaped store")
    p.add_argument(
        "--tokens",
        type=decode_tokens,
        default=64,
        help="tokens per decode run (at least 2: tok/s counts those after the first)",
    )
    p.add_argument("--skip-embedded", action="store_true", help="only the synthetic store")
    p.add_argument(
        "--fractions",
        type=fractions,
        default=FRACTIONS,
        help="fractions of the experts cached, comma-separated (default 1,0.5,0.25,0.125)",
    )
    p.add_argument(
        "--side-slots",
        type=positive_int,
        help="side rows per bank of the prefetch-on rows, and the experts each prediction "
        "prefetches (default 2 x top_k)",
    )
    p.add_argument(
        "--rounds",
        type=positive_int,
        default=None,
        help="then the headline comparisons (embedded: resident, 100%%, 25%%; synthetic: "
        "engine 100%%, each fraction with the host tier, bare table) in this many "
        "alternated rounds, with per-round ratios",
    )
    p.add_argument(
        "--prefill",
        action="store_true",
        help="also time the first token of a long prompt (embedded: 1,536 tokens against "
        "resident; synthetic: 2,048 tokens against 100%%), in --rounds rounds (default 3)",
    )
    p.add_argument(
        "--batch",
        action="store_true",
        help="also drive 1, 2, 4 and 8 clients at once through serve (bench.batch): the "
        "embedded model; a synthetic store at 100%% and at 25%% with the host tier, "
        "prefetch off and on (--side-slots side rows)",
    )
    p.add_argument(
        "--clients",
        type=lengths,
        help="with --batch: clients at once per row, comma-separated (default 1,2,4,8)",
    )
    p.add_argument(
        "--prefill-tokens",
        type=lengths,
        default=(2048,),
        help="the synthetic store's prompt lengths, comma-separated (default 2048; "
        "lengths after the first take one round)",
    )
    p.add_argument(
        "--no-decode",
        action="store_true",
        help="leave out the decode rows (with --prefill or --batch: only those)",
    )
    args = p.parse_args(argv)
    sections = {
        "embedded": not args.skip_embedded and not args.no_decode,
        "synthetic": args.synthetic and not args.no_decode,
        "prefill_embedded": args.prefill and not args.skip_embedded,
        "prefill_synthetic": args.prefill and args.synthetic,
        "batch_embedded": args.batch and not args.skip_embedded,
        "batch_synthetic": args.batch and args.synthetic,
    }
    if args.no_decode and not (args.prefill or args.batch):
        p.error("--no-decode leaves nothing to run without --prefill or --batch")
    missing = [m for m in SERVE_MODULES if args.batch and importlib.util.find_spec(m) is None]
    if missing:
        p.error(
            f"--batch serves through `expertstream serve`, which needs {', '.join(missing)}: "
            "pip install 'expertstream[serve]'"
        )
    if not any(sections.values()):
        p.error("nothing to run: give --synthetic STORE, or leave out --skip-embedded")
    if args.synthetic and not list(args.synthetic.glob("layer*.blob")):
        p.error(f"--synthetic {args.synthetic}: not a store (no layer*.blob files)")
    if args.side_slots:
        from engine.model import resolve_store
        from engine.resources import default_model_path

        uses_synthetic = sections["synthetic"] or sections["batch_synthetic"]
        for model in [args.synthetic] * bool(uses_synthetic) + [default_model_path()] * bool(
            sections["embedded"]
        ):
            experts = resolve_store(model).manifest.num_experts
            if args.side_slots > experts:
                p.error(f"--side-slots {args.side_slots}: {model} has {experts} experts a layer")
    lines, results = [], {}

    def save() -> None:
        (args.out / "device.json").write_text(json.dumps(results, indent=1))
        (args.out / "device.md").write_text("\n".join(lines) + "\n")

    try:
        args.out.mkdir(parents=True, exist_ok=True)
        save()  # a folder it cannot write is refused before anything is measured
    except OSError as e:
        p.error(f"--out {args.out}: {e.strerror}")

    def log(s):
        print(s, flush=True)
        lines.append(s)

    def run(section: str, res: dict) -> dict:
        rounds, store, side = args.rounds, args.synthetic, args.side_slots
        if section == "embedded":
            return embedded(args.tokens, log, args.fractions, rounds, side, res)
        if section == "synthetic":
            return synthetic(store, args.tokens, log, args.fractions, rounds, side, res)
        if section.startswith("batch"):
            model = None if section == "batch_embedded" else store
            return batch(model, args.tokens, log, args.clients, side)
        if section == "prefill_embedded":
            return prefill(None, log, rounds or 3)
        return prefill(store, log, rounds or 3, args.prefill_tokens)

    log(f"device: {mx.default_device()}; {os.uname().nodename}; {time.strftime('%F %T')}")
    for section in [name for name, wanted in sections.items() if wanted]:
        try:
            results[section] = run(section, results.setdefault(section, {}))
        except ConfigError as e:  # a run the model refuses: the rest still runs
            log(f"\n{section}: stopped: {e}")
            results[section]["stopped"] = str(e)
        finally:  # what was measured is kept, whatever stops the rest
            save()
    return 1 if any("stopped" in r for r in results.values()) else 0


if __name__ == "__main__":
    raise SystemExit(main())
