"""The server's prompt cache: time to the first token of a follow-up request, whose prompt
continues one the server has seen (an agent resending its growing context), against a
request of the same length that shares nothing with it (a full prefill).

The server runs in this process as `expertstream serve` runs it (engine.serve.server's
generation thread and application on uvicorn, a loopback port); the requests go over HTTP
as token ids to `/v1/completions`, streamed, and the time to the first token is the time
from sending the request to its first text chunk. Each repetition sends a fresh context
(random token ids) as a first request (`--reply` tokens), then the follow-up (the context
plus `--new` tokens) and the full prefill (as many other random tokens), in alternating
order, and reads the cached tokens from each reply's usage.

Models: the embedded one, or `--synthetic WORK_DIR`: a qwen3_moe store larger than the
embedded model (engine.synthetic; written there on first use), whose experts are streamed
at `--expert-slots` per layer. Stores without a tokenizer (synthetic ones) are served
through a copy of their directory of links, plus a word-level tokenizer of their
vocabulary, so that the server can decode replies.

    python -m bench.prompt_cache [--model DIR_OR_STORE | --synthetic WORK_DIR]
        [--context 512] [--new 16] [--reply 8] [--reps 3] [--expert-slots N]
"""

import argparse
import json
import platform
import socket
import statistics
import sys
import threading
import time
from datetime import UTC, datetime
from pathlib import Path

import httpx
import numpy as np

from bench.common import machine_load

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


def with_tokenizer(store: Path, out: Path) -> Path:
    """`store` when it has tokenizer files, else `out`: links to each of its files and a
    word-level tokenizer ("w0" ... one word per id of its vocabulary)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    from engine.store import read_config

    if (store / "tokenizer.json").exists() or (store / "tokenizer_config.json").exists():
        return store
    out.mkdir(parents=True, exist_ok=True)
    for f in store.iterdir():
        link = out / f.name
        if not link.exists():
            link.symlink_to(f.resolve())
    vocab = read_config(store)["vocab_size"]
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(out / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast"}
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return out


class Server:
    """`expertstream serve` of `model` in this process, on a free loopback port."""

    def __init__(self, model: Path | None, expert_slots: int | None, cache_bytes: int):
        import uvicorn

        from engine.config import StreamConfig
        from engine.model import load
        from engine.serve.server import GenerationThread, build_app

        config = StreamConfig(expert_slots=expert_slots) if expert_slots else StreamConfig()
        self.engine = GenerationThread(lambda: load(model, config), 4, 0, cache_bytes)
        self.engine.start()
        self.vocab = self.engine.sm.store.config["vocab_size"]
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}/v1/completions"
        app = build_app(self.engine, "bench")
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]})
        self.thread.start()
        while not self.server.started:
            time.sleep(0.01)

    def first_token(self, prompt: list[int], max_tokens: int) -> tuple[float, int]:
        """(seconds to the first text chunk, prompt tokens taken from the cache) of a
        streamed completion of `prompt` (read to its end)."""
        body = {
            "prompt": prompt,
            "max_tokens": max_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        t0, first, cached = time.perf_counter(), None, None
        with httpx.stream("POST", self.url, json=body, timeout=3600) as r:
            r.raise_for_status()
            for line in r.iter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line.removeprefix("data: "))
                if first is None and chunk["choices"] and chunk["choices"][0]["text"]:
                    first = time.perf_counter() - t0
                if chunk.get("usage"):
                    cached = chunk["usage"]["prompt_tokens_details"]["cached_tokens"]
        return first, cached

    def close(self) -> None:
        """Stops uvicorn; the generation thread ends with the app's lifespan."""
        self.server.should_exit = True
        self.thread.join(60)


def measure(server: Server, context: int, new: int, reply: int, reps: int, seed: int = 0):
    """Per repetition: (follow-up seconds, its cached tokens, full-prefill seconds, its
    cached tokens)."""
    rng = np.random.default_rng(seed)

    def tokens(n: int) -> list[int]:
        # Ids from 1: a tokenizer's id 0 is often its unknown or padding token.
        return rng.integers(1, server.vocab, n).tolist()

    rows = []
    for rep in range(reps):
        conversation = tokens(context)
        server.first_token(conversation, reply)  # the turn the server has seen
        follow_up = conversation + tokens(new)
        fresh = tokens(context + new)
        if rep % 2:
            full = server.first_token(fresh, reply)
            cached = server.first_token(follow_up, reply)
        else:
            cached = server.first_token(follow_up, reply)
            full = server.first_token(fresh, reply)
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

    start, load = datetime.now(UTC), machine_load()
    server = Server(model, args.expert_slots, 4 << 30)
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
