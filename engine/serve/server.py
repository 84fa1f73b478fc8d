"""`expertstream serve`: an HTTP server for one streamed model, in the protocols agents and
chat front ends speak: OpenAI's chat completions, completions and Responses
(engine.serve.openai, engine.serve.responses), Anthropic's Messages
(engine.serve.anthropic) and Ollama's API (engine.serve.ollama).

Starlette routes run on uvicorn's event loop; one generation thread owns the model (it
loads it, and only it touches MLX arrays) and takes requests in arrival order from a
bounded queue (the batch's free rows, then `max_queue` more; beyond, 503 with
Retry-After): up to `max_batch` replies generated side by side (engine.serve.batch), or
one at a time. Every route turns its request into the same `Job` (engine.serve.bodies), so
every protocol shares the queue, the sampling checks and the limits; each writes its own
error format. The thread sends each reply's text pieces and its end back to the event loop
(engine.serve.reply). A client that goes away sets the job's cancel flag: its row leaves
the batch at the next step (a reply generated alone polls it at every MoE layer call, and
ends at the next one).

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

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from engine.cache import REPORTED_STATS, ratio
from engine.config import PREFILL_STEP_SIZE
from engine.serve import anthropic, ollama, openai, responses
from engine.serve.bodies import Job, RequestError, Served
from engine.serve.flags import MAX_BATCH
from engine.serve.reply import Reply, ServerStats

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


class GenerationThread:
    """The thread that loads the model and generates every reply.

    With `max_batch` above 1 (and a model whose KV caches batch), replies are generated
    side by side (engine.serve.batch: a request joins the running batch between decode
    steps and leaves it when it ends); else one at a time, in arrival order.

    Args:
        load: called on the thread; returns the StreamedModel.
        max_queue: jobs that may wait while the batch is full; more are refused.
        trace_tokens: keep the routing of the last this many tokens (`recorder`, an
            engine.trace.TraceRecorder; 0: none).
        prompt_cache_bytes: the prompt cache's budget, bytes of KV (0: no prompt cache).
        max_batch: replies generated at once, at most (1: one at a time).
        prefill_step_size: prompt tokens per forward of a prefill: a prompt joining the
            batch holds the other replies up for one such forward at a time.

    A subclass may change how the thread waits for a job (`_next_job`) and generates one
    alone (`_generate`); an exception of `fatal` raised there ends the thread, not only
    the request (engine.serve.pipeline).
    """

    fatal: tuple[type[BaseException], ...] = ()

    def __init__(
        self,
        load: Callable[[], object],
        max_queue: int = 32,
        trace_tokens: int = 0,
        prompt_cache_bytes: int = 0,
        max_batch: int = MAX_BATCH,
        prefill_step_size: int = PREFILL_STEP_SIZE,
    ):
        for name, value, low in (
            ("max_queue", max_queue, 1),
            ("trace_tokens", trace_tokens, 0),
            ("prompt_cache_bytes", prompt_cache_bytes, 0),
            ("max_batch", max_batch, 1),
            ("prefill_step_size", prefill_step_size, 1),
        ):
            if value < low:
                raise ValueError(f"{name} is {value}: must be >= {low}")
        self.max_queue = max_queue
        self.max_batch = max_batch
        self.prefill_step_size = prefill_step_size
        self.prompt_cache_bytes = prompt_cache_bytes
        self.prompt_cache = None  # made on the thread, with the model
        self._load = load
        self._trace_tokens = trace_tokens
        self.recorder = None
        self._jobs: queue.Queue = queue.Queue()  # `submit` bounds it
        self._ready = threading.Event()
        self._load_error: BaseException | None = None
        self.active: dict[Job, Reply] = {}  # the jobs generating and their replies
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
        """Queues `job`: up to the batch's free rows (`max_batch` less the replies
        generating), which it joins at the thread's next turn, and then `max_queue` more,
        which wait for a row. (A job the thread has taken but not yet begun counts in
        neither, for that moment.)

        Raises:
            queue.Full: the free rows and `max_queue` are taken already (counted in
                `requests_refused`).
        """
        free = max(0, self.max_batch - len(self.active))
        if self._jobs.qsize() >= self.max_queue + free:
            with self.stats.lock:
                self.stats.requests_refused += 1
            raise queue.Full
        self._jobs.put_nowait(job)
        with self.stats.lock:
            self.stats.requests += 1

    def queued(self) -> int:
        """Jobs waiting (not counting those generating)."""
        return self._jobs.qsize()

    def busy(self) -> bool:
        """A reply is being generated."""
        return bool(self.active)

    def retry_after(self) -> int:
        """Seconds a refused client should wait: the time to generate the replies queued
        and those generating, each estimated from its own prompt length and reply limit
        at the prefill and decode rates of the replies so far (a reply's length taken as
        at most the mean reply length), `max_batch` of them at a time; 1 second a reply
        before the first one."""
        with self._jobs.mutex:
            jobs = [j for j in self._jobs.queue if j is not None]
        jobs += list(self.active)
        with self.stats.lock:
            s = self.stats
            done = s.completed + s.cancelled + s.failed
            if not (done and s.prefill_seconds and s.decode_seconds):
                return max(1, math.ceil(len(jobs) / self.max_batch))
            prefill, decode = (
                s.prefill_tokens / s.prefill_seconds,
                s.decode_tokens / s.decode_seconds,
            )
            mean_reply = s.completion_tokens / done
        seconds = sum(
            len(j.prompt) / prefill + min(j.max_tokens, mean_reply) / decode for j in jobs
        )
        return max(1, math.ceil(seconds / self.max_batch))

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
        """Fails every queued job and cancels the replies in progress (they end at their
        next MoE layer with an error naming the tokens sent); returns at once."""
        self._closing = True  # a job taken from the queue but not yet begun fails too
        self._drain(SHUTTING_DOWN, 503)
        for job in list(self.active):
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

    def _begin(self, job: Job) -> Reply | None:
        """Makes `job`, taken from the queue, one of those generating (`active`) and
        returns its Reply; None (and the job ended) when it was cancelled while it
        waited, or the server is shutting down."""
        if job.cancel.is_set() or self._closing:
            with self.stats.lock:
                self.stats.cancelled += 1
            if self._closing:
                job.emit("error", SHUTTING_DOWN, 503)
            return None
        reply = self.active[job] = Reply(self.stats, self.sm.tokenizer, job)
        if self._closing:  # cancel_all ran between the check above and now
            job.ended_by = SHUTTING_DOWN
            job.cancel.set()
        return reply

    def _run(self) -> None:
        import mlx.core as mx

        try:
            self._load_and_serve()
        finally:
            # MLX's streams of this thread (mlx-lm's generation stream is one per thread)
            # are destroyed now, when their work is done and the GPU runtime is up, not by
            # the thread's exit handlers, which may run as the process ends: what MLX asks
            # of a thread that ran it.
            mx.synchronize()
            mx.clear_streams()

    def _load_and_serve(self) -> None:
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
        from engine.serve.batch import BatchLoop, batches

        if self.max_batch > 1 and batches(self.sm.model):
            BatchLoop(self).run()
        else:
            self.max_batch = 1  # one reply at a time: the queue's bound and /v1/stats say so
            self._one_at_a_time()
        self.sm = self.prompt_cache = None  # the model's arrays are freed here, on their thread

    def _one_at_a_time(self) -> None:
        """Serves the jobs one after another, each reply generated alone (`_generate`)."""
        while (job := self._next_job()) is not None:
            if (reply := self._begin(job)) is None:
                continue
            t0 = time.monotonic()
            try:
                self._serve(reply)
            finally:
                self.active.pop(job, None)
                with self.stats.lock:
                    self.stats.generation_seconds += time.monotonic() - t0

    def _serve(self, reply: Reply) -> None:
        try:
            result = self._generate(reply)
        except self.fatal:
            raise
        except Exception as e:  # noqa: BLE001  (the request fails; the server goes on)
            reply.fail(e)
            return
        reply.end(
            len(result.tokens),
            result.finish_reason,
            result.stopped,
            result.prefill_tps,
            result.decode_tps,
        )

    def _generate(self, reply: Reply):
        """Generates the reply of `reply.job` alone (engine.generate.generate), its
        responses handed to `reply`, over the prompt cache's KV of its longest known
        prefix, then keeps its KV there; returns its GenerationResult."""
        import mlx.core as mx

        from engine.generate import generate

        job = reply.job
        cache, cached = self.fetch(job.prompt)
        reply.start(cached)
        try:
            if job.seed is not None:
                mx.random.seed(job.seed)
            result = generate(
                self.sm,
                job.prompt[cached:],
                job.max_tokens,
                job.temperature,
                job.top_p,
                on_response=lambda r: reply.respond(r.token, r.text, r.logprobs),
                stop=reply.stopping,
                prompt_cache=cache,
                cached_tokens=cached,
                prefill_step_size=self.prefill_step_size,
            )
        finally:
            # Sampling leaves MLX's global random key lazy on this thread's stream.
            mx.eval(mx.random.state)
        self._keep(cache, job.prompt + result.tokens)
        return result

    def fetch(self, prompt: list[int]) -> tuple[list | None, int]:
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
            self.keep(tokens[:held], cache)

    def keep(self, tokens: list[int], cache: list) -> None:
        """Puts `cache`, the KV of `tokens`, into the prompt cache (when there is one)."""
        if self.prompt_cache is not None:
            self.prompt_cache.insert_cache(_MODEL_KEY, tokens, cache)


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
        size_bytes=sm.store.size_bytes,
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
                "max_batch": engine.max_batch,
                "mean_batch": ratio(s.decode_rows, s.decode_steps),
                "replies": [reply.figures() for reply in list(engine.active.values())],
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
