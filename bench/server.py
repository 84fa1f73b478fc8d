"""`expertstream serve` in the benchmark's own process, and streamed completions timed
from the client's side (bench.prompt_cache, bench.batch).

The server is built as the command builds it (engine.serve.server's generation thread and
application, on uvicorn, a free loopback port); requests go over HTTP as token ids to
`/v1/completions`, streamed, with the usage at the end. A store without a tokenizer (a
synthetic one) is served through a copy of its directory of links plus a word-level
tokenizer of its vocabulary (`with_tokenizer`), so that the server can decode replies.
"""

import dataclasses
import json
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx


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


@dataclass
class Streamed:
    """One streamed completion seen by its client: when it was sent, when its first and
    last text chunks came (`time.perf_counter()`, seconds; None: no text came), its
    usage's completion and cached tokens, and its text."""

    sent: float
    first: float | None
    last: float | None
    tokens: int
    cached: int
    text: str

    @property
    def ttft(self) -> float | None:
        """Seconds from sending to the first text."""
        return None if self.first is None else self.first - self.sent

    @property
    def decode_tps(self) -> float | None:
        """Tokens after the first over the time after the first (None with fewer than 2)."""
        if self.first is None or self.tokens < 2 or self.last <= self.first:
            return None
        return (self.tokens - 1) / (self.last - self.first)


class Server:
    """`expertstream serve` of `model` (None: the embedded one) with `config`, a prompt
    cache of `cache_bytes`, `max_batch` replies at once and `max_queue` waiting.

    Attributes:
        engine: the GenerationThread (its model: `engine.sm`).
        url: the base URL (http://127.0.0.1:PORT).
        vocab: the model's vocabulary size.
    """

    def __init__(self, model, config, cache_bytes: int = 0, max_batch: int = 8, max_queue=32):
        import socket

        import uvicorn

        from engine.model import load
        from engine.serve.server import GenerationThread, build_app

        # As `expertstream serve --max-batch` loads it: the acquire kernels' requests and
        # staging are sized at load for max_batch rows of top-k ids.
        config = dataclasses.replace(config, max_batch=max_batch)
        self.engine = GenerationThread(
            lambda: load(model, config), max_queue, 0, cache_bytes, max_batch
        )
        self.engine.start()
        self.vocab = self.engine.sm.store.config["vocab_size"]
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        app = build_app(self.engine, "bench")
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]})
        self.thread.start()
        while not self.server.started:
            time.sleep(0.01)

    def complete(self, prompt: list[int], max_tokens: int) -> Streamed:
        """A streamed completion of token ids `prompt`, read to its end."""
        body = {
            "prompt": prompt,
            "max_tokens": max_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        sent, first, last, usage, text = time.perf_counter(), None, None, None, []
        with httpx.stream("POST", f"{self.url}/v1/completions", json=body, timeout=3600) as r:
            r.raise_for_status()
            for line in r.iter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line.removeprefix("data: "))
                if chunk["choices"] and chunk["choices"][0]["text"]:
                    last = time.perf_counter()
                    first = first or last
                    text.append(chunk["choices"][0]["text"])
                if chunk.get("usage"):
                    usage = chunk["usage"]
        cached = usage["prompt_tokens_details"]["cached_tokens"]
        return Streamed(sent, first, last, usage["completion_tokens"], cached, "".join(text))

    def stats(self) -> dict:
        """`/v1/stats`."""
        return httpx.get(f"{self.url}/v1/stats", timeout=60).json()

    def close(self) -> None:
        """Stops uvicorn; the generation thread ends with the app's lifespan."""
        self.server.should_exit = True
        self.thread.join(60)
