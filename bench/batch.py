"""Many conversations at once: 1, 2, 4 and 8 clients streaming replies through
`expertstream serve` side by side (engine.serve.batch), against one client alone.

Each row starts N clients together, each streaming a completion of a prompt of its own
(so that the prompt cache gives nothing and the rows route to different experts: a
story opening of its own before `bench.common.PROMPT` where the model has a tokenizer
of its own, whose stories run past `--tokens`; else `--prompt` random token ids) for
`--tokens` tokens, `--reps` times, and reports the median over the repetitions of:

- total tokens/s: every client's tokens over the wall time from the first request sent
  to the last text received, and its ratio to one client's (the row of 1);
- tokens/s per client: a client's tokens after its first over the time after its first
  (the decode rate each conversation sees; 1 / it is the batch's decode step);
- time to first token: the median and the slowest client's.

Then whether the replies of the most clients at once are the ones each request gets
alone (greedy: the exactness of the backend's batched kernels, docs/server.md "Many
conversations at once"): how many are, and where the first that is not parts.

Then the join: N - 1 clients stream long replies and, once their text flows, one more
client sends a prompt; its time to first token beside its prompt's prefill (its time to
first token alone, which comes out of the prefill) and the batch's decode step, and what it
waited beyond the prefill in decode steps of the batch: the rest of the step in flight
when it came (under one step, half on average: its first token comes out of its
prefill, before the batch's next step).

    python -m bench.batch [--model DIR_OR_STORE] [--clients 1,2,4,8]
        [--tokens 64] [--prompt 64] [--reps 2] [--fraction F] [--host-memory SIZE|auto|off]
        [--side-slots N [--fill-stream]]

bench.device runs `suite` on the H200 (the embedded model, and a 30B-A3B-shaped synthetic
store at 100% and at 25% of the experts with the host tier).
"""

import argparse
import os
import platform
import statistics
import sys
import threading
import time
from datetime import UTC, datetime
from pathlib import Path

import numpy as np

from bench.common import PROMPT, machine_load
from bench.server import Server, Streamed, with_tokenizer

CLIENTS = (1, 2, 4, 8)
# Before PROMPT, one per client (cycled): the embedded model's prompts differ from the start.
OPENINGS = (
    "Tom had a big red truck.",
    "The sun was hot and the sea was blue.",
    "Mia found a small box under her bed.",
    "A little bird could not fly.",
    "Ben and his mom made a cake.",
    "The old cat sat by the door.",
    "Sam lost his toy in the park.",
    "It was a cold day in the woods.",
)


def clients_at_once(server: Server, prompts: list[list[int]], tokens: int) -> list[Streamed]:
    """One streamed completion per prompt, all sent at once (each on a thread of its own,
    released together)."""
    out: list[Streamed | None] = [None] * len(prompts)
    ready = threading.Barrier(len(prompts))

    def client(i: int) -> None:
        ready.wait()
        out[i] = server.complete(prompts[i], tokens)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def figures(replies: list[Streamed]) -> dict:
    """Total and per-client tokens/s and times to first token of replies sent at once."""
    wall = max(r.last for r in replies) - min(r.sent for r in replies)
    per_client = [r.decode_tps for r in replies if r.decode_tps]
    ttft = [r.ttft for r in replies]
    return {
        "tokens": sum(r.tokens for r in replies),
        "total_tps": sum(r.tokens for r in replies) / wall,
        "client_tps": statistics.median(per_client) if per_client else None,
        "ttft_median_s": statistics.median(ttft),
        "ttft_max_s": max(ttft),
    }


def join(server: Server, prompts: list[list[int]], tokens: int) -> dict:
    """The join (module docstring): `prompts[-1]` sent once the others' text flows;
    its time to first token, and the batch's decode step beside it."""
    running: list[Streamed | None] = [None] * (len(prompts) - 1)

    def client(i: int) -> None:
        running[i] = server.complete(prompts[i], 3 * tokens)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(running))]
    for t in threads:
        t.start()
    while all(t.is_alive() for t in threads):  # until every running reply's text flows
        replies = server.stats()["server"]["replies"]
        if len(replies) == len(running) and all(r["generated_tokens"] >= 4 for r in replies):
            break
        time.sleep(0.05)  # each look takes the event loop's (and the GIL's) time
    joined = server.complete(prompts[-1], tokens)
    for t in threads:
        t.join()
    step = statistics.median(1 / r.decode_tps for r in running if r.decode_tps)
    return {"join_ttft_s": joined.ttft, "batch_step_s": step}


def suite(model, config, clients=CLIENTS, tokens=64, prompt=64, reps=2, log=print) -> dict:
    """The rows of the module docstring for `model` (None: the embedded one; a store
    without a tokenizer is served with one) under `config` (a StreamConfig), served with
    `max(clients)` replies at once; returns {"rows": {N: figures}, "exact": {...},
    "join": {N: ...}}."""
    from engine.model import load_store_tokenizer, resolve_store
    from engine.resources import default_model_path
    from engine.store import MANIFEST_FILE

    tokenizer = load_store_tokenizer(resolve_store(model or default_model_path()))
    if model is not None and (Path(model) / MANIFEST_FILE).exists():
        model = with_tokenizer(Path(model), Path(model).parent / f"{Path(model).name}-served")
    rng = np.random.default_rng(0)
    server = Server(model, config, max_batch=max(clients))
    try:
        told = 0  # openings handed out so far

        def prompts(n: int) -> list[list[int]]:
            nonlocal told
            if tokenizer is not None:
                told += n
                return [
                    tokenizer.encode(f"{OPENINGS[i % len(OPENINGS)]} {PROMPT}")
                    for i in range(told - n, told)
                ]
            # Ids from 1: a tokenizer's id 0 is often its unknown or padding token.
            return [rng.integers(1, server.vocab, prompt).tolist() for _ in range(n)]

        server.complete(prompts(1)[0], 8)  # the first forward's one-time costs
        rows, joins = {}, {}
        log("| clients | total tok/s | × 1 client | tok/s per client | TTFT median | TTFT max |")
        log("|---|---|---|---|---|---|")
        for n in clients:
            # Discarded: a batch size's first steps may pay one-time costs the later ones do not.
            clients_at_once(server, prompts(n), 4)
            runs = [figures(clients_at_once(server, prompts(n), tokens)) for _ in range(reps)]
            rows[n] = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
            r, one = rows[n], rows[clients[0]]
            log(
                f"| {n} | {r['total_tps']:.1f} | {r['total_tps'] / one['total_tps']:.2f}x | "
                f"{r['client_tps']:.1f} | {r['ttft_median_s'] * 1e3:.0f} ms | "
                f"{r['ttft_max_s'] * 1e3:.0f} ms |"
            )
        batch = prompts(max(clients))
        together = clients_at_once(server, batch, tokens)
        apart = [server.complete(p, tokens) for p in batch]
        same = [a.text == b.text for a, b in zip(together, apart, strict=True)]
        parts = [
            len(os.path.commonprefix([a.text, b.text]))
            for a, b, equal in zip(together, apart, same, strict=True)
            if not equal
        ]
        exact = {"clients": len(batch), "same": sum(same), "first_difference_chars": parts}
        log(
            f"\nReplies of {len(batch)} clients at once equal to each alone: {sum(same)} of "
            f"{len(batch)}" + (f" (the others part at characters {parts})" if parts else "")
        )
        log(
            "\nA client joining a running batch of N - 1: its time to first token beside its "
            "prompt's prefill (its time to first token alone, just before) and the batch's "
            "decode step\n"
        )
        log("| clients | join TTFT | its prefill alone | batch decode step | beyond the prefill |")
        log("|---|---|---|---|---|")
        for n in [n for n in clients if n > 1]:
            runs = []
            for _ in range(reps):
                ns = prompts(n)
                alone = server.complete(ns[-1], tokens)
                j = join(server, ns, tokens)
                j["prefill_s"] = alone.ttft
                j["steps_beyond_prefill"] = (j["join_ttft_s"] - j["prefill_s"]) / j["batch_step_s"]
                runs.append(j)
            joins[n] = j = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
            log(
                f"| {n} | {j['join_ttft_s'] * 1e3:.0f} ms | {j['prefill_s'] * 1e3:.0f} ms | "
                f"{j['batch_step_s'] * 1e3:.0f} ms | {j['steps_beyond_prefill']:.1f} steps |"
            )
    finally:
        server.close()
    return {"rows": rows, "exact": exact, "join": joins}


def main(argv: list[str] | None = None) -> int:
    """Measures and prints the tables (markdown); returns the exit code."""
    p = argparse.ArgumentParser(prog="python -m bench.batch", description=__doc__)
    p.add_argument("--model", help="mlx-lm model directory or expert store (default: embedded)")
    p.add_argument(
        "--clients",
        type=lambda s: tuple(int(n) for n in s.split(",")),
        default=CLIENTS,
        help="clients at once per row, comma-separated (default 1,2,4,8)",
    )
    p.add_argument("--tokens", type=int, default=64, help="reply tokens per client")
    p.add_argument("--prompt", type=int, default=64, help="prompt tokens per client (random ids)")
    p.add_argument("--reps", type=int, default=2, help="repetitions per row (median)")
    p.add_argument("--fraction", type=float, help="fraction of the experts cached (default: all)")
    p.add_argument(
        "--host-memory", default="auto", help="the host tier (MLX CUDA): SIZE, auto or off"
    )
    p.add_argument(
        "--side-slots",
        type=int,
        default=0,
        help="side rows per layer, prefetch on (a decode step predicted from every reply's "
        "row); default 0: prefetch off",
    )
    p.add_argument(
        "--fill-stream",
        action="store_true",
        help="with --side-slots, on MLX CUDA: prefetch fills copied by the copy engines "
        "beside the compute (StreamConfig.fill_stream)",
    )
    args = p.parse_args(argv)
    if min(args.clients) < 1 or args.tokens < 2 or args.prompt < 1 or args.reps < 1:
        p.error("--clients, --prompt and --reps must be >= 1, --tokens >= 2")
    if args.side_slots < 0:
        p.error(f"--side-slots {args.side_slots}: must be >= 0")
    if args.fill_stream and args.side_slots == 0:
        p.error("--fill-stream copies prefetch fills: give --side-slots too")
    from engine.config import StreamConfig, parse_memory
    from engine.model import resolve_store
    from engine.resources import default_model_path

    model = Path(args.model) if args.model else None
    store = resolve_store(model or default_model_path())
    slots = None
    if args.fraction is not None:
        slots = max(store.manifest.top_k, round(store.manifest.num_experts * args.fraction))
    host = None if args.host_memory == "off" else parse_memory(args.host_memory)
    config = StreamConfig(
        expert_slots=slots,
        host_memory=host,
        side_slots=args.side_slots,
        prefetch=args.side_slots > 0,
        fill_stream=args.fill_stream,
    )
    load = machine_load()
    print(
        f"model {model or 'embedded (tinystories-moe)'}, {slots or 'all'} expert slots per "
        f"layer, {args.side_slots} side rows{', fill stream' if args.fill_stream else ''}; "
        f"{platform.system()} {platform.machine()}, "
        f"{load['cpus']} CPUs; "
        f"{datetime.now(UTC):%Y-%m-%d %H:%M} UTC (load average {load['loadavg_1m']:.2f}); "
        f"{args.prompt}-token prompts, {args.tokens}-token replies, median of {args.reps}\n"
    )
    suite(model, config, tuple(sorted(args.clients)), args.tokens, args.prompt, args.reps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
