"""`expertstream serve`: an HTTP server for one streamed model, in the protocols agents and
chat front ends speak: OpenAI's chat completions, completions and Responses
(engine.serve.openai, engine.serve.responses), Anthropic's Messages
(engine.serve.anthropic) and Ollama's API (engine.serve.ollama).

Starlette routes run on uvicorn's event loop; one generation thread owns the model (it
loads it, and only it touches MLX arrays) and serves requests one at a time, in arrival
order, from a bounded queue (a full queue answers 503 with Retry-After). Every route turns
its request into the same `Job` (engine.serve.bodies), so every protocol shares the
queue, the sampling checks and the limits; each writes its own error format. The thread
sends the reply's text pieces and its end back to the event loop. A client that goes away
sets the job's cancel flag, which the model polls at every MoE layer call, so its
generation ends at the next one.

A prompt cache (mlx-lm's LRUPromptCache, within a byte budget) keeps the KV of recent
replies: a request whose prompt starts with tokens the server has seen (a conversation
continued, an agent's growing context) prefills only the rest.

Routes shared by the protocols: `GET /v1/models`, `GET /v1/stats` (the expert cache's
counters, the prompt cache's, and the request counts since the server started: totals,
unlike `expertstream generate --json`'s stats, which are one reply's), `GET /v1/trace`
(the routing of the last N tokens as a `.npz` trace, with `--record-trace N`:
`expertstream advise --trace` reads it), `GET /health` (with `last_error` while the latest
reply failed). A request names no file: `model` is not used to pick or load anything.

`serve --pipeline` serves the same application with engine.serve.pipeline's subclass of
the generation thread, which runs each job on every rank of a pipeline.
"""

import asyncio
import contextlib
import copy
import errno
import io
import math
import queue
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from engine.cache import REPORTED_STATS, ratio
from engine.serve import anthropic, ollama, openai, responses
from engine.serve.bodies import Job, RequestError, Served

# Conversations the prompt cache keeps at most (mlx_lm.server's default), within its bytes.
PROMPT_CACHE_ENTRIES = 10
# The prompt cache's key for the one model served (mlx-lm's keys a model provider's).
_MODEL_KEY = "model"
# Why the jobs a shutdown (Ctrl+C, SIGTERM) ends fail: queued ones and the reply in progress.
SHUTTING_DOWN = "the server is shutting down"


def bind(host: str, port: int) -> socket.socket:
    """A TCP socket bound to `host` (its first address) and `port`, for uvicorn to listen
    on (`uvicorn.Server.run(sockets=[...])`): taken before the model loads, so that a host
    that does not resolve, or a port in use, is refused at once.

    Raises:
        ValueError: naming --host or --port and the value, and why.
    """
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (socket.gaierror, UnicodeError) as e:
        reason = e.strerror if isinstance(e, socket.gaierror) else str(e)
        raise ValueError(f"--host {host}: not an address of this machine ({reason})") from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise ValueError(f"--port {port}: already in use on {host}") from None
        if e.errno == errno.EACCES:
            raise ValueError(f"--port {port}: not allowed ({e.strerror})") from None
        raise ValueError(f"--host {host}: cannot listen there ({e.strerror})") from None
    return sock


def url(sock: socket.socket) -> str:
    """The http:// address a bound socket serves."""
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if sock.family == socket.AF_INET6 else f"http://{host}:{port}"


# ---- the generation thread ------------------------------------------------------------


class StopMatcher:
    """Stop strings over a reply that grows piece by piece: `add` returns the text that
    may be sent now, holding back a tail that could be the start of a stop string, and
    cuts the reply where the first stop string begins (`hit`; `matched`: that string)."""

    def __init__(self, stops: list[str]):
        self.stops = stops
        self.text = ""
        self.sent = 0
        self.hit = False
        self.matched: str | None = None

    def add(self, piece: str) -> str:
        """Appends `piece`; returns what can be sent (nothing more after a hit)."""
        if self.hit:
            return ""
        self.text += piece
        found = [(i, s) for s in self.stops if (i := self.text.find(s, self.sent)) >= 0]
        if found:
            self.hit = True
            end, self.matched = min(found)
        else:
            end = len(self.text) - self._pending()
        out, self.sent = self.text[self.sent : end], end
        return out

    def flush(self) -> str:
        """The held-back tail, at the end of a reply no stop string cut."""
        out, self.sent = ("" if self.hit else self.text[self.sent :]), len(self.text)
        return out

    def _pending(self) -> int:
        """Length of the longest unsent tail that a stop string starts with."""
        tail = self.text[self.sent :]
        return max(
            (
                k
                for s in self.stops
                for k in range(min(len(s) - 1, len(tail)), 0, -1)
                if tail.endswith(s[:k])
            ),
            default=0,
        )


@dataclass
class ServerStats:
    """Request and token counters of the server's lifetime (guarded by `lock`).

    Attributes:
        requests: requests queued (refused ones are `requests_refused`).
        requests_refused: requests refused with 503 (the queue was full).
        completed, cancelled, failed: queued requests by how they ended.
        prompt_tokens: prompt tokens of the replies, cached ones included.
        cached_tokens: prompt tokens taken from the prompt cache (not prefilled).
        prefill_tokens, prefill_seconds, decode_tokens, decode_seconds: what the replies
            prefilled and decoded and how long that took (the queue's wait estimate).
        last_error: why the latest reply failed; None once a later one succeeds.
        last_prefill_tps, last_decode_tps: the latest reply's prefill and decode
            tokens/s; None before the first reply, and without a prefill / decode step
            (`GenerationResult.prefill_tps`, `.decode_tps`).
    """

    requests: int = 0
    requests_refused: int = 0
    completed: int = 0
    cancelled: int = 0
    failed: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    generation_seconds: float = 0.0
    prefill_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_tokens: int = 0
    decode_seconds: float = 0.0
    last_prefill_tps: float | None = None
    last_decode_tps: float | None = None
    last_error: str | None = None
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)


class GenerationThread:
    """The thread that loads the model and generates every reply, one job at a time.

    Args:
        load: called on the thread; returns the StreamedModel.
        max_queue: jobs that may wait (beyond the one generating); more are refused.
        trace_tokens: keep the routing of the last this many tokens (`recorder`, an
            engine.trace.TraceRecorder; 0: none).
        prompt_cache_bytes: the prompt cache's budget, bytes of KV (0: no prompt cache).

    A subclass may change how the thread waits for a job (`_next_job`) and generates one
    (`_generate`); an exception of `fatal` raised there ends the thread, not only the
    request (engine.serve.pipeline).
    """

    fatal: tuple[type[BaseException], ...] = ()

    def __init__(
        self,
        load: Callable[[], object],
        max_queue: int = 32,
        trace_tokens: int = 0,
        prompt_cache_bytes: int = 0,
    ):
        if max_queue < 1:
            raise ValueError(f"max_queue is {max_queue}: must be >= 1")
        if trace_tokens < 0:
            raise ValueError(f"trace_tokens is {trace_tokens}: must be >= 0")
        if prompt_cache_bytes < 0:
            raise ValueError(f"prompt_cache_bytes is {prompt_cache_bytes}: must be >= 0")
        self.max_queue = max_queue
        self.prompt_cache_bytes = prompt_cache_bytes
        self.prompt_cache = None  # made on the thread, with the model
        self._load = load
        self._trace_tokens = trace_tokens
        self.recorder = None
        self._jobs: queue.Queue = queue.Queue(maxsize=max_queue)
        self._ready = threading.Event()
        self._load_error: BaseException | None = None
        self._current: Job | None = None
        self._closing = False  # set by cancel_all: every job from then on fails
        self.sm = None
        self.stats = ServerStats()
        self.thread = threading.Thread(target=self._run, name="expertstream-generate", daemon=True)

    def start(self) -> None:
        """Starts the thread and waits until the model has loaded.

        Raises:
            whatever the load raised (a bad model path or store, for example).
        """
        self.thread.start()
        self._ready.wait()
        if self._load_error is not None:
            self.thread.join()
            raise self._load_error

    def submit(self, job: Job) -> None:
        """Queues `job`.

        Raises:
            queue.Full: `max_queue` jobs are waiting already (counted in
                `requests_refused`).
        """
        try:
            self._jobs.put_nowait(job)
        except queue.Full:
            with self.stats.lock:
                self.stats.requests_refused += 1
            raise
        with self.stats.lock:
            self.stats.requests += 1

    def queued(self) -> int:
        """Jobs waiting (not counting the one generating)."""
        return self._jobs.qsize()

    def busy(self) -> bool:
        """A reply is being generated."""
        return self._current is not None

    def retry_after(self) -> int:
        """Seconds a refused client should wait: the time to generate the replies queued
        and the one generating, each estimated from its own prompt length and reply limit
        at the prefill and decode rates of the replies so far (a reply's length taken as
        at most the mean reply length); 1 second a reply before the first one."""
        with self._jobs.mutex:
            jobs = [j for j in self._jobs.queue if j is not None]
        if (current := self._current) is not None:
            jobs.append(current)
        with self.stats.lock:
            s = self.stats
            done = s.completed + s.cancelled + s.failed
            if not (done and s.prefill_seconds and s.decode_seconds):
                return max(1, len(jobs))
            prefill, decode = (
                s.prefill_tokens / s.prefill_seconds,
                s.decode_tokens / s.decode_seconds,
            )
            mean_reply = s.completion_tokens / done
        seconds = sum(
            len(j.prompt) / prefill + min(j.max_tokens, mean_reply) / decode for j in jobs
        )
        return max(1, math.ceil(seconds))

    def prompt_cache_stats(self) -> dict:
        """The prompt cache's figures (`/v1/stats`'s "prompt_cache"): its budget, the bytes
        and conversations it holds, and the prompt tokens it has saved prefilling."""
        cache = self.prompt_cache
        with self.stats.lock:
            reused = self.stats.cached_tokens
        return {
            "budget_bytes": self.prompt_cache_bytes,
            "bytes": cache.nbytes if cache is not None else 0,
            "entries": len(cache) if cache is not None else 0,
            "cached_tokens": reused,
        }

    def cache_stats(self) -> dict:
        """The expert cache's `REPORTED_STATS` over the server's lifetime (`/v1/stats`'s
        "cache"); hit_rate and prefetch_accuracy None (JSON null) while undefined."""
        t = self.sm.snapshot().totals()
        return {k: t[k] for k in REPORTED_STATS}

    def cancel_all(self) -> None:
        """Fails every queued job and cancels the reply in progress (it ends at its next
        MoE layer with an error naming the tokens sent); returns at once."""
        self._closing = True  # a job taken from the queue but not yet current fails too
        self._drain(SHUTTING_DOWN, 503)
        if (job := self._current) is not None:
            job.ended_by = SHUTTING_DOWN
            job.cancel.set()

    def close(self, timeout: float = 30.0) -> None:
        """`cancel_all`, then ends the thread (the model is freed on it) and waits up to
        `timeout` seconds for it."""
        self.cancel_all()
        if self.thread.is_alive():
            self._jobs.put(None)
            self.thread.join(timeout)

    def _drain(self, reason: str, status: int = 500) -> None:
        """Fails every queued job with `reason` (a whole reply's HTTP `status`)."""
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job.cancel.set()
                job.emit("error", reason, status)

    def _next_job(self) -> Job | None:
        """The next job to serve; None ends the thread."""
        return self._jobs.get()

    def _run(self) -> None:
        try:
            self.sm = self._load()
            if self.prompt_cache_bytes:
                from mlx_lm.models.cache import LRUPromptCache

                self.prompt_cache = LRUPromptCache(PROMPT_CACHE_ENTRIES, self.prompt_cache_bytes)
            if self._trace_tokens:
                from engine.trace import record

                self.recorder = record(self.sm, self._trace_tokens)
        except BaseException as e:  # noqa: BLE001  (re-raised by start, on the caller's thread)
            self._load_error = e
            self._ready.set()
            return
        self._ready.set()
        while (job := self._next_job()) is not None:
            if job.cancel.is_set() or self._closing:
                with self.stats.lock:
                    self.stats.cancelled += 1
                if self._closing:
                    job.emit("error", SHUTTING_DOWN, 503)
                continue
            self._current = job
            if self._closing:  # cancel_all ran between the check above and this job's start
                job.ended_by = SHUTTING_DOWN
                job.cancel.set()
            try:
                self._serve(job)
            finally:
                self._current = None
        self.sm = self.prompt_cache = None  # the model's arrays are freed here, on their thread

    def _serve(self, job: Job) -> None:
        matcher = StopMatcher(job.stop)
        records: list[dict] = []  # log-probabilities of tokens whose text is held back
        sent = 0  # tokens handed to the reply (a pipeline's last one is not in its result)

        def on_response(r) -> None:
            nonlocal sent
            sent += 1
            if job.logprobs is not None:
                records.append(self._logprobs(r, job.logprobs))
            if piece := matcher.add(r.text):
                job.emit("text", piece, records[:])
                records.clear()

        t0 = time.monotonic()
        try:
            result = self._generate(job, on_response, lambda: job.cancel.is_set() or matcher.hit)
        except self.fatal:
            raise
        except Exception as e:  # noqa: BLE001  (the request fails; the server goes on)
            message = f"generation failed: {type(e).__name__}: {e}"
            with self.stats.lock:
                self.stats.failed += 1
                self.stats.generation_seconds += time.monotonic() - t0
                self.stats.last_error = message
            job.emit("error", message)
            return
        if matcher.hit:
            finish = "stop"
        elif result.stopped:  # the cancel was seen: a cancel after the last token ends nothing
            finish = None
        else:
            if (rest := matcher.flush()) or records:
                job.emit("text", rest, records[:])
            finish = result.finish_reason
        prompt, cached = len(job.prompt), result.cached_tokens
        usage = {
            "prompt_tokens": prompt,
            "completion_tokens": len(result.tokens),
            "total_tokens": prompt + len(result.tokens),
            "cached_tokens": cached,
        }
        with self.stats.lock:
            s = self.stats
            if finish is None:
                s.cancelled += 1
            else:
                s.completed += 1
            s.prompt_tokens += prompt
            s.cached_tokens += cached
            s.completion_tokens += usage["completion_tokens"]
            s.generation_seconds += time.monotonic() - t0
            if result.prefill_tps:
                s.prefill_tokens += prompt - cached
                s.prefill_seconds += (prompt - cached) / result.prefill_tps
            if result.decode_tps:
                s.decode_tokens += len(result.tokens)
                s.decode_seconds += len(result.tokens) / result.decode_tps
            s.last_prefill_tps, s.last_decode_tps = result.prefill_tps, result.decode_tps
            s.last_error = None
        if finish is None and job.ended_by:
            job.emit("error", f"{job.ended_by}: the reply was cut after {sent} tokens", 503)
        else:
            job.emit("done", {"finish": finish, "stop": matcher.matched, "usage": usage})

    def _logprobs(self, r, top: int) -> dict:
        """The log-probability of response `r`'s token and of the `top` most likely tokens
        at its step (mlx-lm's `GenerationResponse.logprobs`: the sampler's distribution
        before temperature), with each token's text."""
        import mlx.core as mx

        decode = self.sm.tokenizer.decode
        out = {"token": decode([r.token]), "logprob": r.logprobs[r.token].item(), "top": []}
        if top:
            ids = mx.argpartition(-r.logprobs, top - 1)[:top]
            values = r.logprobs[ids].tolist()
            pairs = sorted(zip(values, ids.tolist(), strict=True), key=lambda p: -p[0])
            out["top"] = [(decode([i]), v) for v, i in pairs]
        return out

    def _generate(self, job: Job, on_response: Callable, stop: Callable[[], bool]):
        """Generates `job`'s reply (engine.generate.generate) over the prompt cache's KV of
        its longest known prefix, then keeps its KV there; returns its GenerationResult."""
        import mlx.core as mx

        from engine.generate import generate

        cache, cached = self._fetch(job.prompt)
        job.emit("start", {"cached_tokens": cached})
        try:
            if job.seed is not None:
                mx.random.seed(job.seed)
            result = generate(
                self.sm,
                job.prompt[cached:],
                job.max_tokens,
                job.temperature,
                job.top_p,
                on_response=on_response,
                stop=stop,
                prompt_cache=cache,
                cached_tokens=cached,
            )
        finally:
            # Sampling leaves MLX's global random key lazy on this thread's stream.
            mx.eval(mx.random.state)
        self._keep(cache, job.prompt + result.tokens)
        return result

    def _fetch(self, prompt: list[int]) -> tuple[list | None, int]:
        """(KV cache, tokens of `prompt` it holds) to generate `prompt`'s reply over: the
        prompt cache's nearest entry (trimmed to the common prefix, at least one prompt
        token left to feed), a fresh cache, or (None, 0) without a prompt cache."""
        if self.prompt_cache is None:
            return None, 0
        from mlx_lm.models.cache import can_trim_prompt_cache, make_prompt_cache

        cache, rest = self.prompt_cache.fetch_nearest_cache(_MODEL_KEY, prompt)
        cached = len(prompt) - len(rest)
        if cache is not None and not rest:  # the whole prompt is known: feed its last token
            if can_trim_prompt_cache(cache):
                for c in cache:
                    c.trim(1)
                cached -= 1
            else:
                cache = None
        if cache is None:
            return make_prompt_cache(self.sm.model), 0
        return cache, cached

    def _keep(self, cache: list | None, tokens: list[int]) -> None:
        """Puts `cache` into the prompt cache under the `tokens` whose KV it holds.

        A reply cut short (stopped, cancelled) may have ended mid-forward, with some
        layers a token ahead of others: every layer is trimmed to the shortest, whose
        tokens every layer holds whole."""
        from mlx_lm.models.cache import can_trim_prompt_cache

        if cache is None or not can_trim_prompt_cache(cache):
            return
        held = min(c.offset for c in cache)
        for c in cache:
            c.trim(c.offset - held)
        if held:
            self.prompt_cache.insert_cache(_MODEL_KEY, tokens[:held], cache)


def uvicorn_server(
    app: Starlette,
    engine: GenerationThread,
    log_level: str,
    on_start: Callable[[], None] | None = None,
):
    """A `uvicorn.Server` of `app` that calls `on_start` once it listens (its Ctrl+C
    handling is in place by then; the app's lifespan starts before it listens, so a
    client told then was refused), and whose shutdown (Ctrl+C, SIGTERM) starts with
    `engine.cancel_all()`: uvicorn waits for open replies before the app's lifespan ends
    (`engine.close`), so a long reply would otherwise hold the shutdown until its last
    token. Every log line, the access log's included, goes to stderr: stdout is left to
    what a command prints as its result."""
    import uvicorn
    from uvicorn.config import LOGGING_CONFIG

    class Server(uvicorn.Server):
        async def startup(self, sockets=None) -> None:
            await super().startup(sockets)
            if on_start is not None and not self.should_exit:
                on_start()

        def handle_exit(self, sig, frame) -> None:
            engine.cancel_all()
            super().handle_exit(sig, frame)

    log_config = copy.deepcopy(LOGGING_CONFIG)
    log_config["handlers"]["access"]["stream"] = "ext://sys.stderr"
    return Server(uvicorn.Config(app, log_level=log_level, log_config=log_config))


# ---- the application ------------------------------------------------------------------


def build_app(
    engine: GenerationThread,
    model_id: str,
    default_max_tokens: int = 256,
) -> Starlette:
    """The Starlette application serving `engine`'s model as `model_id`, in every protocol.

    Args:
        engine: a started GenerationThread.
        model_id: the name `/v1/models` (and Ollama's `/api/tags`) lists and replies carry.
        default_max_tokens: reply limit of requests that give no max_tokens (shortened to
            what the context leaves).
    """
    sm = engine.sm
    served = Served(
        engine=engine,
        model_id=model_id,
        tokenizer=sm.tokenizer,
        vocab=sm.store.vocab_size,
        context=sm.store.context_length or 1 << 30,
        default_max_tokens=default_max_tokens,
        created=int(time.time()),
        config=sm.store.config,
        size_bytes=sum(f.stat().st_size for f in sm.store.path.iterdir() if f.is_file()),
    )

    entry = {
        "id": model_id,
        "object": "model",
        "created": served.created,
        "owned_by": "expertstream",
    }

    async def models(request: Request):
        return JSONResponse({"object": "list", "data": [entry]})

    async def model(request: Request):
        name = request.path_params["name"]
        if name != model_id:
            raise RequestError(
                "model", f"model {name!r} is not served here: this server serves {model_id!r}", 404
            )
        return JSONResponse(entry)

    async def stats(request: Request):
        cache = engine.cache_stats()
        prompt_cache = engine.prompt_cache_stats()
        with engine.stats.lock:
            s = engine.stats
            counts = {
                "requests": s.requests,
                "requests_refused": s.requests_refused,
                "completed": s.completed,
                "cancelled": s.cancelled,
                "failed": s.failed,
                "queued": engine.queued(),
                "generating": engine.busy(),
                "prompt_tokens": s.prompt_tokens,
                "cached_tokens": s.cached_tokens,
                "completion_tokens": s.completion_tokens,
                "tokens_per_second": ratio(s.completion_tokens, s.generation_seconds),
                "last_prefill_tps": s.last_prefill_tps,
                "last_decode_tps": s.last_decode_tps,
            }
        return JSONResponse(
            {"model": model_id, "cache": cache, "prompt_cache": prompt_cache, "server": counts}
        )

    async def trace(request: Request):
        if engine.recorder is None:
            raise RequestError(
                None, "no routing is recorded: start the server with --record-trace N", 404
            )
        buf = io.BytesIO()
        engine.recorder.trace(model_id).save(buf)
        return Response(
            buf.getvalue(),
            media_type="application/octet-stream",
            headers={"Content-Disposition": 'attachment; filename="trace.npz"'},
        )

    async def health(request: Request):
        alive = engine.thread.is_alive()
        body = {"status": "ok" if alive else "stopped"}
        with engine.stats.lock:
            if engine.stats.last_error is not None:
                body["last_error"] = engine.stats.last_error
        return JSONResponse(body, 200 if alive else 503)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        await asyncio.to_thread(engine.close)

    async def http_error(request: Request, exc: HTTPException):
        return openai.error_response(
            RequestError(None, str(exc.detail), exc.status_code, headers=exc.headers)
        )

    async def internal_error(request: Request, exc: Exception):
        return openai.error_response(
            RequestError(None, f"internal error: {type(exc).__name__}: {exc}", 500)
        )

    return Starlette(
        routes=[
            *openai.routes(served),
            *responses.routes(served),
            *anthropic.routes(served),
            *ollama.routes(served),
            Route("/v1/models", openai.endpoint(models), methods=["GET"]),
            Route("/v1/models/{name:path}", openai.endpoint(model), methods=["GET"]),
            Route("/v1/stats", stats, methods=["GET"]),
            Route("/v1/trace", openai.endpoint(trace), methods=["GET"]),
            Route("/health", health, methods=["GET"]),
        ],
        exception_handlers={HTTPException: http_error, Exception: internal_error},
        lifespan=lifespan,
    )
