"""`expertstream serve`: an OpenAI-compatible HTTP server for one streamed model.

Starlette routes run on uvicorn's event loop; one generation thread owns the model (it
loads it, and only it touches MLX arrays) and serves requests one at a time, in arrival
order, from a bounded queue (a full queue answers 503 with Retry-After). Each request
gets its own `Job`: the thread sends the reply's text pieces and its end back to the
event loop. A client that goes away sets the job's cancel flag, which the model polls at
every MoE layer call, so its generation ends at the next one.

Routes: `POST /v1/chat/completions`, `POST /v1/completions` (SSE streaming or one JSON
reply), `GET /v1/models`, `GET /v1/stats` (the expert cache's counters and the request
counts since the server started: totals, unlike `expertstream generate --json`'s stats,
which are one reply's), `GET /v1/trace` (the routing of the last N tokens as a `.npz`
trace, with `--record-trace N`: `expertstream advise --trace` reads it), `GET /health`
(with `last_error` while the latest reply failed). A request names no file: `model` is
not used to pick or load anything.

`serve --pipeline` serves the same application with engine.pipeline_server's subclass of
the generation thread, which runs each job on every rank of a pipeline.
"""

import asyncio
import contextlib
import errno
import io
import json
import math
import queue
import socket
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from engine.cache import ratio
from engine.chat import ROLES, chat_ids, checked_ids, encode
from engine.config import ConfigError, check_sampling

MAX_BODY_BYTES = 1 << 20
MAX_STOP_STRINGS = 4
# The expert cache's counters that `/v1/stats` reports (CacheSnapshot.totals() keys).
CACHE_STATS = (
    "hits",
    "misses",
    "hit_rate",
    "bytes_read",
    "side_hits",
    "prefetch_issued",
    "prefetch_used",
    "prefetch_wasted",
    "prefetch_accuracy",
    "evictions",
)


class RequestError(Exception):
    """A request the server refuses: `status` with an OpenAI-style error naming `param`."""

    def __init__(self, param: str | None, message: str, status: int = 400):
        super().__init__(message)
        self.param, self.message, self.status = param, message, status


def error_response(
    message: str, status: int, param: str | None = None, kind: str | None = None, headers=None
) -> JSONResponse:
    """OpenAI's error body: `{"error": {"message", "type", "param", "code"}}`."""
    kind = kind or ("invalid_request_error" if status < 500 else "server_error")
    body = {"error": {"message": message, "type": kind, "param": param, "code": None}}
    return JSONResponse(body, status_code=status, headers=headers)


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


@dataclass
class Job:
    """One request's generation.

    Attributes:
        prompt: token ids.
        max_tokens: reply length limit, tokens (>= 1).
        temperature, top_p: sampling (temperature 0: greedy).
        seed: MLX random seed set before this reply, or None.
        stop: strings that end the reply (not included in it).
        events: where the generation thread puts ("text", str), then ("done",
            finish_reason, usage dict) or ("error", message); read on the event loop.
        cancel: set when the client has gone; the generation ends at the next MoE layer.
    """

    prompt: list[int]
    max_tokens: int
    temperature: float
    top_p: float
    seed: int | None
    stop: list[str]
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancel: threading.Event = field(default_factory=threading.Event)

    def emit(self, *event) -> None:
        """Hands `event` to the event loop (thread-safe; dropped once the loop is closed)."""
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:
            pass  # the loop has closed: the server is shutting down


class StopMatcher:
    """Stop strings over a reply that grows piece by piece: `add` returns the text that
    may be sent now, holding back a tail that could be the start of a stop string, and
    cuts the reply where the first stop string begins (`hit`)."""

    def __init__(self, stops: list[str]):
        self.stops = stops
        self.text = ""
        self.sent = 0
        self.hit = False

    def add(self, piece: str) -> str:
        """Appends `piece`; returns what can be sent (nothing more after a hit)."""
        if self.hit:
            return ""
        self.text += piece
        found = [i for s in self.stops if (i := self.text.find(s, self.sent)) >= 0]
        if found:
            self.hit = True
            end = min(found)
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
    completion_tokens: int = 0
    generation_seconds: float = 0.0
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

    A subclass may change how the thread waits for a job (`_next_job`) and generates one
    (`_generate`); an exception of `fatal` raised there ends the thread, not only the
    request (engine.pipeline_server).
    """

    fatal: tuple[type[BaseException], ...] = ()

    def __init__(self, load: Callable[[], object], max_queue: int = 32, trace_tokens: int = 0):
        if max_queue < 1:
            raise ValueError(f"max_queue is {max_queue}: must be >= 1")
        if trace_tokens < 0:
            raise ValueError(f"trace_tokens is {trace_tokens}: must be >= 0")
        self._load = load
        self._trace_tokens = trace_tokens
        self.recorder = None
        self._jobs: queue.Queue = queue.Queue(maxsize=max_queue)
        self._ready = threading.Event()
        self._load_error: BaseException | None = None
        self._current: Job | None = None
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
        """Seconds a refused client should wait: the queue times the mean reply time."""
        with self.stats.lock:
            done = self.stats.completed + self.stats.cancelled + self.stats.failed
            mean = self.stats.generation_seconds / done if done else 1.0
        return max(1, math.ceil(mean * (self.queued() + 1)))

    def cache_stats(self) -> dict:
        """The expert cache's counters over the server's lifetime (`/v1/stats`'s "cache");
        hit_rate and prefetch_accuracy None (JSON null) while undefined."""
        t = self.sm.snapshot().totals()
        t["hit_rate"] = ratio(t["hits"], t["hits"] + t["misses"])  # None: nothing looked up
        t["prefetch_accuracy"] = ratio(t["prefetch_used"], t["prefetch_issued"])
        return {k: t[k] for k in CACHE_STATS}

    def cancel_all(self) -> None:
        """Fails every queued job and cancels the reply in progress (it ends at its next
        MoE layer, with no finish reason); returns at once."""
        self._drain("the server is shutting down")
        if (job := self._current) is not None:
            job.cancel.set()

    def close(self, timeout: float = 30.0) -> None:
        """`cancel_all`, then ends the thread (the model is freed on it) and waits up to
        `timeout` seconds for it."""
        self.cancel_all()
        if self.thread.is_alive():
            self._jobs.put(None)
            self.thread.join(timeout)

    def _drain(self, reason: str) -> None:
        """Fails every queued job with `reason`."""
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job.cancel.set()
                job.emit("error", reason)

    def _next_job(self) -> Job | None:
        """The next job to serve; None ends the thread."""
        return self._jobs.get()

    def _run(self) -> None:
        try:
            self.sm = self._load()
            if self._trace_tokens:
                from engine.trace import record

                self.recorder = record(self.sm, self._trace_tokens)
        except BaseException as e:  # noqa: BLE001  (re-raised by start, on the caller's thread)
            self._load_error = e
            self._ready.set()
            return
        self._ready.set()
        while (job := self._next_job()) is not None:
            if job.cancel.is_set():
                with self.stats.lock:
                    self.stats.cancelled += 1
                continue
            self._current = job
            try:
                self._serve(job)
            finally:
                self._current = None
        self.sm = None  # the model's arrays are freed here, on their thread

    def _serve(self, job: Job) -> None:
        matcher = StopMatcher(job.stop)

        def on_response(r) -> None:
            if piece := matcher.add(r.text):
                job.emit("text", piece)

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
        elif job.cancel.is_set():
            finish = None
        else:
            if rest := matcher.flush():
                job.emit("text", rest)
            finish = result.finish_reason
        usage = {
            "prompt_tokens": result.prompt_tokens,
            "completion_tokens": len(result.tokens),
            "total_tokens": result.prompt_tokens + len(result.tokens),
        }
        with self.stats.lock:
            s = self.stats
            if finish is None:
                s.cancelled += 1
            else:
                s.completed += 1
            s.prompt_tokens += usage["prompt_tokens"]
            s.completion_tokens += usage["completion_tokens"]
            s.generation_seconds += time.monotonic() - t0
            s.last_prefill_tps, s.last_decode_tps = result.prefill_tps, result.decode_tps
            s.last_error = None
        job.emit("done", finish, usage)

    def _generate(self, job: Job, on_response: Callable, stop: Callable[[], bool]):
        """Generates `job`'s reply (engine.generate.generate); returns its GenerationResult."""
        import mlx.core as mx

        from engine.generate import generate

        try:
            if job.seed is not None:
                mx.random.seed(job.seed)
            return generate(
                self.sm,
                job.prompt,
                job.max_tokens,
                job.temperature,
                job.top_p,
                on_response=on_response,
                stop=stop,
            )
        finally:
            # Sampling leaves MLX's global random key lazy on this thread's stream.
            mx.eval(mx.random.state)


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
    token."""
    import uvicorn

    class Server(uvicorn.Server):
        async def startup(self, sockets=None) -> None:
            await super().startup(sockets)
            if on_start is not None and not self.should_exit:
                on_start()

        def handle_exit(self, sig, frame) -> None:
            engine.cancel_all()
            super().handle_exit(sig, frame)

    return Server(uvicorn.Config(app, log_level=log_level))


# ---- request fields -------------------------------------------------------------------


def _number(data: dict, name: str, default, lo: float, hi: float, integer: bool = False):
    value = data.get(name)
    if value is None:
        return default
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds) or not lo <= value <= hi:
        what = "an integer" if integer else "a number"
        raise RequestError(name, f"{name} must be {what} in [{lo}, {hi}], got {value!r}")
    return value


def _sampling(data: dict) -> tuple[float, float]:
    """(temperature, top_p) of a request: numbers, refused as the CLI refuses them
    (`check_sampling`)."""
    values = {}
    for name, default in (("temperature", 0.0), ("top_p", 1.0)):
        value = data.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int | float)):
            raise RequestError(name, f"{name} must be a number, got {value!r}")
        values[name] = default if value is None else float(value)
    try:
        check_sampling(**values)
    except ConfigError as e:
        raise RequestError(e.field, f"{e.field} {e.value}: {e.what}") from None
    return values["temperature"], values["top_p"]


def _response_format(data: dict) -> None:
    """Refuses a `response_format` other than text: replies are never constrained (to
    JSON or a schema), and a client that asks for that must not get free text."""
    fmt = data.get("response_format")
    if fmt is not None and fmt != {"type": "text"}:
        raise RequestError(
            "response_format",
            f'response_format {json.dumps(fmt)} is not supported: only {{"type": "text"}}',
        )


def _stop_strings(data: dict) -> list[str]:
    stop = data.get("stop")
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if (
        not isinstance(stops, list)
        or len(stops) > MAX_STOP_STRINGS
        or not all(isinstance(s, str) and s for s in stops)
    ):
        raise RequestError(
            "stop", f"stop must be a non-empty string or a list of up to {MAX_STOP_STRINGS}"
        )
    return stops


def _messages(data: dict) -> list[dict]:
    """The chat messages as `{"role", "content": str}`; text content parts are joined."""
    messages = data.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages", "messages must be a non-empty list of messages")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise RequestError(where, f"{where} must be an object with role and content")
        role = "system" if m.get("role") == "developer" else m.get("role")
        if role not in ROLES:
            raise RequestError(f"{where}.role", f"{where}.role must be one of {ROLES}")
        content = m.get("content")
        if isinstance(content, list):
            parts = []
            for j, part in enumerate(content):
                if not (isinstance(part, dict) and part.get("type") == "text"):
                    raise RequestError(
                        f"{where}.content[{j}]", "only text content parts are supported"
                    )
                if not isinstance(part.get("text"), str):
                    raise RequestError(f"{where}.content[{j}].text", "must be a string")
                parts.append(part["text"])
            content = "".join(parts)
        if not isinstance(content, str):
            raise RequestError(f"{where}.content", f"{where}.content must be a string")
        out.append({"role": role, "content": content})
    return out


def _prompt(data: dict, tokenizer, vocab: int | None) -> list[int]:
    """Token ids of a completion's `prompt`: a string, a list of one string, or token ids."""
    prompt = data.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise RequestError("prompt", "prompt is empty")
        return checked_ids(encode(tokenizer, prompt), vocab)
    if (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt)
    ):
        if vocab and (bad := next((t for t in prompt if t >= vocab), None)) is not None:
            raise RequestError(
                "prompt",
                f"prompt token id {bad} is outside the model's vocabulary of {vocab} tokens "
                f"(ids 0 to {vocab - 1})",
            )
        return list(prompt)
    raise RequestError("prompt", "prompt must be a non-empty string or a list of token ids")


# ---- the application ------------------------------------------------------------------


def build_app(
    engine: GenerationThread,
    model_id: str,
    default_max_tokens: int = 256,
) -> Starlette:
    """The Starlette application serving `engine`'s model as `model_id`.

    Args:
        engine: a started GenerationThread.
        model_id: the name `/v1/models` lists and replies carry.
        default_max_tokens: reply limit of requests that give no max_tokens (shortened to
            what the context leaves).
    """
    sm = engine.sm
    tokenizer = sm.tokenizer
    vocab = sm.store.config.get("vocab_size")
    context = sm.store.config.get("max_position_embeddings") or 1 << 30
    created = int(time.time())

    async def read_json(request: Request) -> dict:
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > MAX_BODY_BYTES:
                raise RequestError(None, f"the request body is over {MAX_BODY_BYTES} bytes", 413)
        try:
            data = json.loads(body)
        except (ValueError, RecursionError) as e:
            raise RequestError(None, f"the request body is not JSON ({e})") from None
        if not isinstance(data, dict):
            raise RequestError(None, "the request body must be a JSON object")
        return data

    def make_job(data: dict, ids: list[int]) -> Job:
        if (n := data.get("n")) is not None and n != 1:
            raise RequestError("n", "only n = 1 is supported")
        for name in ("logprobs", "echo", "tools", "suffix"):
            if data.get(name):
                raise RequestError(name, f"{name} is not supported")
        if not isinstance(data.get("model", ""), str):
            raise RequestError("model", "model must be a string")
        if not isinstance(data.get("stream", False), bool):
            raise RequestError("stream", "stream must be true or false")
        _response_format(data)
        temperature, top_p = _sampling(data)
        room = context - len(ids)
        if room < 1:
            raise RequestError(
                "messages" if "messages" in data else "prompt",
                f"the prompt ({len(ids)} tokens) fills the model's context of {context} tokens",
            )
        name = "max_completion_tokens" if "max_completion_tokens" in data else "max_tokens"
        max_tokens = _number(data, name, None, 1, 1 << 30, integer=True)
        if max_tokens is None:
            max_tokens = min(default_max_tokens, room)
        elif max_tokens > room:
            raise RequestError(
                name,
                f"prompt ({len(ids)} tokens) + {name} ({max_tokens}) exceeds the model's "
                f"context of {context} tokens",
            )
        return Job(
            prompt=ids,
            max_tokens=max_tokens,
            temperature=temperature,
            top_p=top_p,
            seed=_number(data, "seed", None, 0, 2**64 - 1, integer=True),
            stop=_stop_strings(data),
            loop=asyncio.get_running_loop(),
        )

    async def completion(request: Request, chat: bool):
        data = await read_json(request)
        if chat:
            messages = _messages(data)
            try:
                ids = chat_ids(tokenizer, messages, vocab)
            except ValueError as e:
                raise RequestError("messages", str(e)) from None
        else:
            try:
                ids = _prompt(data, tokenizer, vocab)
            except ValueError as e:
                raise RequestError("prompt", str(e)) from None
        job = make_job(data, ids)
        options = data.get("stream_options") or {}
        include_usage = isinstance(options, dict) and options.get("include_usage") is True
        try:
            engine.submit(job)
        except queue.Full:
            return error_response(
                f"the server is busy ({engine.queued()} requests queued); retry later",
                503,
                kind="server_busy",
                headers={"Retry-After": str(engine.retry_after())},
            )
        reply = _Reply(chat, model_id, job)
        if data.get("stream"):
            return StreamingResponse(
                reply.sse(include_usage),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache"},
            )
        return await reply.whole(request)

    async def chat_completions(request: Request):
        return await completion(request, chat=True)

    async def completions(request: Request):
        return await completion(request, chat=False)

    async def models(request: Request):
        entry = {"id": model_id, "object": "model", "created": created, "owned_by": "expertstream"}
        return JSONResponse({"object": "list", "data": [entry]})

    async def stats(request: Request):
        cache = engine.cache_stats()
        with engine.stats.lock:
            s = engine.stats
            served = {
                "requests": s.requests,
                "requests_refused": s.requests_refused,
                "completed": s.completed,
                "cancelled": s.cancelled,
                "failed": s.failed,
                "queued": engine.queued(),
                "generating": engine.busy(),
                "prompt_tokens": s.prompt_tokens,
                "completion_tokens": s.completion_tokens,
                "tokens_per_second": ratio(s.completion_tokens, s.generation_seconds),
                "last_prefill_tps": s.last_prefill_tps,
                "last_decode_tps": s.last_decode_tps,
            }
        return JSONResponse({"model": model_id, "cache": cache, "server": served})

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

    async def refused(request: Request, exc: RequestError):
        return error_response(exc.message, exc.status, exc.param)

    async def http_error(request: Request, exc: HTTPException):
        return error_response(exc.detail, exc.status_code, headers=exc.headers)

    async def internal_error(request: Request, exc: Exception):
        return error_response(f"internal error: {type(exc).__name__}: {exc}", 500)

    return Starlette(
        routes=[
            Route("/v1/chat/completions", chat_completions, methods=["POST"]),
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/v1/models", models, methods=["GET"]),
            Route("/v1/stats", stats, methods=["GET"]),
            Route("/v1/trace", trace, methods=["GET"]),
            Route("/health", health, methods=["GET"]),
        ],
        exception_handlers={
            RequestError: refused,
            HTTPException: http_error,
            Exception: internal_error,
        },
        lifespan=lifespan,
    )


class _Reply:
    """Turns a job's events into OpenAI's chat or text completion objects."""

    def __init__(self, chat: bool, model_id: str, job: Job):
        self.chat, self.model_id, self.job = chat, model_id, job
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())

    def _object(self, choices: list, chunk: bool, usage: dict | None = None) -> dict:
        kind = "chat.completion" if self.chat else "text_completion"
        out = {
            "id": self.id,
            "object": kind + (".chunk" if chunk and self.chat else ""),
            "created": self.created,
            "model": self.model_id,
            "choices": choices,
        }
        if usage is not None:
            out["usage"] = usage
        return out

    def _choice(self, text: str | None, finish: str | None, chunk: bool) -> dict:
        if not self.chat:
            return {"index": 0, "text": text or "", "finish_reason": finish, "logprobs": None}
        key = "delta" if chunk else "message"
        body = {} if text is None else {"content": text}
        if not chunk:
            body["role"] = "assistant"
        return {"index": 0, key: body, "finish_reason": finish, "logprobs": None}

    async def whole(self, request: Request) -> JSONResponse:
        """Waits for the whole reply; a client that disconnects meanwhile cancels it."""
        text = []
        try:
            while True:
                try:
                    event = await asyncio.wait_for(self.job.events.get(), 0.5)
                except TimeoutError:
                    if await request.is_disconnected():
                        self.job.cancel.set()
                        return error_response("the client disconnected", 499)
                    continue
                if event[0] == "text":
                    text.append(event[1])
                elif event[0] == "error":
                    return error_response(event[1], 500)
                else:
                    _, finish, usage = event
                    choice = self._choice("".join(text), finish, chunk=False)
                    return JSONResponse(self._object([choice], False, usage))
        except asyncio.CancelledError:
            self.job.cancel.set()
            raise

    async def sse(self, include_usage: bool) -> AsyncIterator[str]:
        """Server-sent events: one chunk per text piece, the finish reason, the usage
        (when asked), then `[DONE]`. Leaving early (the client went away) cancels the job."""

        def data(obj) -> str:
            return f"data: {json.dumps(obj)}\n\n"

        try:
            if self.chat:
                first = self._choice("", None, chunk=True)
                first["delta"]["role"] = "assistant"
                yield data(self._object([first], True))
            while True:
                event = await self.job.events.get()
                if event[0] == "text":
                    yield data(self._object([self._choice(event[1], None, True)], True))
                    continue
                if event[0] == "error":
                    yield data({"error": {"message": event[1], "type": "server_error"}})
                    break
                _, finish, usage = event
                yield data(self._object([self._choice(None, finish, True)], True))
                if include_usage:
                    yield data(self._object([], True, usage))
                break
            yield "data: [DONE]\n\n"
        finally:
            self.job.cancel.set()  # a no-op once the reply is over
