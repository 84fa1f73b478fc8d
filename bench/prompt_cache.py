"""The server's prompt cache: time to the first token of a follow-up request, whose prompt
continues one the server has seen (an agent resending its growing context), against a
request of the same length that shares nothing with it (a full prefill).

The server runs in this process as `expertstream serve` runs it (bench.server); the
requests go over HTTP as token ids to `/v1/completions`, streamed, and the time to the
first token is the time from sending the request to its first text chunk. Each
repetition sends a fresh context (random token ids) as a first request (`--reply`
tokens), then the follow-up (the context plus `--new` tokens) and the full prefill (as
many other random tokens), in alternating order, and reads the cached tokens from each
reply's usage.

Models: the embedded one, or `--synthetic WORK_DIR`: a qwen3_moe store larger than the
embedded model (engine.synthetic; written there on first use), whose experts are streamed
at `--expert-slots` per layer (served with a tokenizer: `bench.server.with_tokenizer`).

    python -m bench.prompt_cache [--model DIR_OR_STORE | --synthetic WORK_DIR]
        [--context 512] [--new 16] [--reply 8] [--reps 3] [--expert-slots N]
"""

import argparse
import platform
import statistics
import sys
from datetime import UTC, datetime
from pathlib import Path

import numpy as np

from bench.common import machine_load
from bench.server import Server, with_tokenizer

# A store larger than the embedded model, whose experts a 16-slot pool must stream, yet
# quick to write: 16 MoE layers of 64 experts, top-8, 4 bits, group 64.
SYNTHETIC = {
    "model_type": "qwen3_moe",
    "hidden_size": 1024,
    "intermediate_size": 2048,
    "moe_intermediate_size": 640,
    "num_hidden_layers": 16,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 128,
    "num_experts": 64,
    "num_experts_per_tok": 8,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "norm_topk_prob": True,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "vocab_size": 8192,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
}


def synthetic_store(work: Path) -> Path:
    """The SYNTHETIC store under `work`, written if missing, served with a tokenizer."""
    from engine.synthetic import ensure_store

    store = ensure_store(work / "synthetic-store", SYNTHETIC)
    return with_tokenizer(store, work / "synthetic-served")


def measure(server: Server, context: int, new: int, reply: int, reps: int, seed: int = 0):
    """Per repetition: (follow-up seconds, its cached tokens, full-prefill seconds, its
    cached tokens)."""
    rng = np.random.default_rng(seed)

    def tokens(n: int) -> list[int]:
        # Ids from 1: a tokenizer's id 0 is often its unknown or padding token.
        return rng.integers(1, server.vocab, n).tolist()

    def first_token(prompt: list[int]) -> tuple[float, int]:
        r = server.complete(prompt, reply)
        return r.ttft, r.cached

    rows = []
    for rep in range(reps):
        conversation = tokens(context)
        first_token(conversation)  # the turn the server has seen
        follow_up = conversation + tokens(new)
        fresh = tokens(context + new)
        if rep % 2:
            full = first_token(fresh)
            cached = first_token(follow_up)
        else:
            cached = first_token(follow_up)
            full = first_token(fresh)
        rows.append((*cached, *full))
    return rows


def main(argv: list[str] | None = None) -> int:
    """Measures and prints the table (markdown) and the medians; returns the exit code."""
    p = argparse.ArgumentParser(prog="python -m bench.prompt_cache", description=__doc__)
    p.add_argument("--model", help="mlx-lm model directory or expert store (default: embedded)")
    p.add_argument("--synthetic", metavar="WORK_DIR", help="serve the synthetic store there")
    p.add_argument("--context", type=int, default=512, help="tokens the server has seen")
    p.add_argument("--new", type=int, default=16, help="tokens the follow-up adds")
    p.add_argument("--reply", type=int, default=8, help="reply tokens of every request")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--expert-slots", type=int, help="expert slots per layer (default: all)")
    args = p.parse_args(argv)
    if args.model and args.synthetic:
        p.error("--model and --synthetic: one model at a time")
    from engine.store import MANIFEST_FILE

    model = Path(args.model) if args.model else None
    if args.synthetic:
        model = synthetic_store(Path(args.synthetic))
    elif model is not None and (model / MANIFEST_FILE).exists():
        model = with_tokenizer(model, model.parent / f"{model.name}-served")

    from engine.config import StreamConfig

    start, load = datetime.now(UTC), machine_load()
    server = Server(model, StreamConfig(expert_slots=args.expert_slots), 4 << 30, max_queue=4)
    try:
        rows = measure(server, args.context, args.new, args.reply, args.reps)
    finally:
        server.close()
    name = "embedded (tinystories-moe)" if model is None else str(model)
    slots = args.expert_slots or "all"
    print(
        f"model {name}, {slots} expert slots per layer; {platform.system()} "
        f"{platform.machine()}, {load['cpus']} CPUs; started {start:%Y-%m-%d %H:%M} UTC "
        f"(load average {load['loadavg_1m']:.2f})"
    )
    print(
        f"context {args.context} tokens, follow-up +{args.new}, reply {args.reply} tokens, "
        f"{args.reps} repetitions\n"
    )
    print("| rep | follow-up TTFT | cached tokens | full prefill TTFT | cached tokens | ratio |")
    print("|---|---|---|---|---|---|")
    for i, (t_cached, n_cached, t_full, n_full) in enumerate(rows):
        print(
            f"| {i + 1} | {t_cached * 1e3:.0f} ms | {n_cached} | {t_full * 1e3:.0f} ms | "
            f"{n_full} | {t_full / t_cached:.1f}x |"
        )
    t_cached = statistics.median(r[0] for r in rows)
    t_full = statistics.median(r[2] for r in rows)
    print(
        f"\nmedian: follow-up {t_cached * 1e3:.0f} ms, full prefill {t_full * 1e3:.0f} ms, "
        f"{t_full / t_cached:.1f}x"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
