"""What every route of `expertstream serve` shares: reading a request body, the checks of
its fields (sampling, limits, stop strings, `tool_choice`) and the job it becomes, and
waiting for the job's events. Each protocol module (engine.serve.openai,
engine.serve.anthropic, engine.serve.responses, engine.serve.ollama) maps its own field
names onto these and writes `RequestError` in its own error format.

One rule for sampling fields the engine does not apply (penalties, `top_k`, `min_p`,
`logit_bias`, ...): every protocol leaves them unread, so a client that sends its
defaults is answered; replies are sampled with temperature, top_p and seed only. A null
optional field is an absent one.
"""

import asyncio
import json
import queue
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response, StreamingResponse

from engine.chat import chat_ids, has_tool_calling
from engine.config import ConfigError, check_sampling

MAX_BODY_BYTES = 1 << 20
MAX_STOP_STRINGS = 4
MAX_TOP_LOGPROBS = 20
# A body that has not arrived in this long is refused (408): a client that sends fewer
# bytes than its Content-Length would otherwise hold its connection open forever.
BODY_TIMEOUT_S = 30.0


class RequestError(Exception):
    """A request the server refuses: `status`, the field it names (`param`, None for the
    request as a whole), `kind` (an error type; None: from the status), `headers`."""

    def __init__(
        self,
        param: str | None,
        message: str,
        status: int = 400,
        kind: str | None = None,
        headers: dict | None = None,
    ):
        super().__init__(message)
        self.param, self.message, self.status = param, message, status
        self.kind, self.headers = kind, headers

    def named(self) -> str:
        """The message, led by the field it names unless it starts with it already (for
        error formats without a field of their own)."""
        if self.param and not self.message.startswith(self.param):
            return f"{self.param}: {self.message}"
        return self.message


@dataclass
class Served:
    """What every route knows of the served model.

    Attributes:
        engine: the started GenerationThread.
        model_id: the name replies carry.
        tokenizer: mlx-lm's TokenizerWrapper (None: the store has no tokenizer).
        vocab: the model's vocabulary size, or None.
        context: the model's context, tokens.
        default_max_tokens: reply limit of requests that set none.
        created: when the server started, Unix seconds.
        config: the model's config.json.
        size_bytes: the bytes of the model's weights on disk (`ExpertStore.size_bytes`).
    """

    engine: object
    model_id: str
    tokenizer: object
    vocab: int | None
    context: int
    default_max_tokens: int
    created: int
    config: dict
    size_bytes: int = 0

    @property
    def tools(self) -> bool:
        """The model can call tools (`engine.chat.has_tool_calling`)."""
        return has_tool_calling(self.tokenizer)

    def chat_ids(self, messages: list[dict], tools: list[dict] | None, param: str) -> list[int]:
        """The prompt of `messages` (and `tools`) through the chat template.

        Raises:
            RequestError: naming `param`, or "tools" for a model that cannot call tools.
        """
        if tools and not self.tools:
            raise RequestError(
                "tools",
                "this model cannot call tools: its chat template renders none in a format "
                "mlx-lm parses calls from",
            )
        try:
            return chat_ids(self.tokenizer, messages, self.vocab, tools)
        except ValueError as e:
            raise RequestError(param, str(e)) from None


def endpoint(
    handler: Callable[[Request], Awaitable[Response]],
    error: Callable[[RequestError], Response],
) -> Callable[[Request], Awaitable[Response]]:
    """`handler` with its RequestErrors answered as `error` writes them (a protocol's
    error format)."""

    async def run(request: Request) -> Response:
        try:
            return await handler(request)
        except RequestError as e:
            return error(e)

    return run


def event_stream(lines: AsyncIterator[str]) -> StreamingResponse:
    """A response of server-sent events, `lines` already in their wire format."""
    return StreamingResponse(
        lines, media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
    )


def _is_text(s: str) -> bool:
    """`s` holds no lone UTF-16 surrogate (UTF-8 takes it)."""
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def lone_surrogate(value, path: str = "") -> str | None:
    """The path (`messages[0].content`) of the first string in `value` (parsed JSON), key
    or value, that holds a lone UTF-16 surrogate ("\\ud800"), which JSON can spell but no
    text encoding (and so no tokenizer, and no JSON reply naming it) takes; None when there
    is none. A key in the path is spelled with such a surrogate escaped, so that the
    error naming it can be sent."""
    if isinstance(value, str):
        return None if _is_text(value) else (path or "body")
    if isinstance(value, dict):
        for k in value:
            if not _is_text(k):
                spelled = k.encode("utf-8", "backslashreplace").decode("utf-8")
                return f"{path}.{spelled}" if path else spelled
        items = ((f"{path}.{k}" if path else str(k), v) for k, v in value.items())
    elif isinstance(value, list):
        items = ((f"{path}[{i}]", v) for i, v in enumerate(value))
    else:
        return None
    for where, v in items:
        if (found := lone_surrogate(v, where)) is not None:
            return found
    return None


async def read_json(request: Request) -> dict:
    """The request's JSON object body.

    Raises:
        RequestError: 413 over `MAX_BODY_BYTES` (by its Content-Length, before reading),
            408 when the body does not arrive within `BODY_TIMEOUT_S`, 499 when the client
            left mid-body, 400 when it is not a JSON object or holds a string no text
            encoding takes (naming where).
    """
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > MAX_BODY_BYTES:
        raise RequestError(None, f"the request body is over {MAX_BODY_BYTES} bytes", 413)
    body = bytearray()
    try:
        async with asyncio.timeout(BODY_TIMEOUT_S):
            async for chunk in request.stream():
                body += chunk
                if len(body) > MAX_BODY_BYTES:
                    raise RequestError(
                        None, f"the request body is over {MAX_BODY_BYTES} bytes", 413
                    )
    except TimeoutError:
        raise RequestError(
            None, f"the request body did not arrive within {BODY_TIMEOUT_S:g} s", 408
        ) from None
    except ClientDisconnect:
        raise RequestError(None, "the client disconnected", 499) from None
    try:
        data = json.loads(body)
    except (ValueError, RecursionError) as e:
        raise RequestError(None, f"the request body is not JSON ({e})") from None
    if not isinstance(data, dict):
        raise RequestError(None, "the request body must be a JSON object")
    if (where := lone_surrogate(data)) is not None:
        raise RequestError(where, f"{where} holds a lone UTF-16 surrogate: not text")
    return data


def number(
    value, name: str, default, lo: float, hi: float, integer: bool = False
) -> int | float | None:
    """`value` checked as an integer (or any number) in [lo, hi]; `default` for None.

    Raises:
        RequestError: naming `name`.
    """
    if value is None:
        return default
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds) or not lo <= value <= hi:
        what = "an integer" if integer else "a number"
        raise RequestError(name, f"{name} must be {what} in [{lo}, {hi}], got {value!r}")
    return value


def sampling(temperature, top_p, names=("temperature", "top_p")) -> tuple[float, float]:
    """(temperature, top_p), defaults 0 (greedy) and 1, refused as the CLI refuses them
    (`check_sampling`).

    Raises:
        RequestError: naming the field (as `names` spells it).
    """
    values = {}
    for key, name, value, default in zip(
        ("temperature", "top_p"), names, (temperature, top_p), (0.0, 1.0), strict=True
    ):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int | float)):
            raise RequestError(name, f"{name} must be a number, got {value!r}")
        values[key] = default if value is None else float(value)
    try:
        check_sampling(**values)
    except ConfigError as e:
        name = dict(zip(("temperature", "top_p"), names, strict=True))[e.field]
        raise RequestError(name, f"{name} {e.value}: {e.what}") from None
    return values["temperature"], values["top_p"]


def stop_strings(stop, name: str = "stop") -> list[str]:
    """A string or a list of up to `MAX_STOP_STRINGS` non-empty strings, as a list.

    Raises:
        RequestError: naming `name`.
    """
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if (
        not isinstance(stops, list)
        or len(stops) > MAX_STOP_STRINGS
        or not all(isinstance(s, str) and s for s in stops)
    ):
        raise RequestError(
            name, f"{name} must be a non-empty string or a list of up to {MAX_STOP_STRINGS}"
        )
    return stops


def streamed(data: dict, default: bool = False) -> bool:
    """A request's `stream` flag; absent or null: `default` (the protocol's: Ollama streams,
    the others do not), as every optional field takes null for absent.

    Raises:
        RequestError: (param "stream") anything but true, false or null.
    """
    value = data.get("stream")
    if value is None:
        return default
    if not isinstance(value, bool):
        raise RequestError("stream", "stream must be true or false")
    return value


def text(value, name: str, empty: bool = True) -> str:
    """`value` checked as a string (not empty unless `empty`).

    Raises:
        RequestError: naming `name`.
    """
    if not isinstance(value, str) or (not empty and not value):
        raise RequestError(name, f"{name} must be a {'' if empty else 'non-empty '}string")
    return value


def tool_choice(choice, typed: bool = False) -> str:
    """A request's `tool_choice` in one form: "auto" (the model is told of the tools and may
    call one; also when the request sets none) or "none" (it is not told of them). OpenAI's
    protocols spell these as strings; Anthropic's as `{"type": "auto"}` (`typed`), where a
    bare string is taken too.

    Raises:
        RequestError: (param "tool_choice") any other choice, which would force a call
            ("required", "any", a named tool): replies are not constrained to a call, so
            that cannot be promised. The message spells the choices as the protocol does.
    """
    if choice is None:
        return "auto"
    kind = choice.get("type") if typed and isinstance(choice, dict) else choice
    if kind in ("auto", "none"):
        return kind
    auto, none = ({"type": "auto"}, {"type": "none"}) if typed else ("auto", "none")
    raise RequestError(
        "tool_choice",
        f"tool_choice {json.dumps(choice)} is not supported: only {json.dumps(auto)} or "
        f"{json.dumps(none)} (replies are not constrained to a call)",
    )


@dataclass(eq=False)  # a job is itself: hashed and compared by identity
class Job:
    """One request's generation.

    Attributes:
        prompt: token ids.
        max_tokens: reply length limit, tokens (>= 1).
        temperature, top_p: sampling (temperature 0: greedy).
        seed: MLX random seed set before this reply, or None.
        stop: strings that end the reply (not included in it).
        logprobs: None, or how many most likely alternatives to report per token (0 to
            MAX_TOP_LOGPROBS) along with each token's own log-probability.
        events: where the generation thread puts ("start", {"cached_tokens"}) when the
            reply's generation begins (cached_tokens: prompt tokens the prompt cache
            gave), ("text", str, logprobs) (logprobs: a
            list of `{"token", "logprob", "top": [(token, logprob)]}` for the tokens
            that text ends, empty without `logprobs`), then ("done", end) (end: dict with
            "finish" ("stop", "length" or None when the client went), "stop" (the stop string
            that cut the reply, or None), "usage" ({"prompt_tokens", "completion_tokens",
            "total_tokens", "cached_tokens"})) or ("error", message[, status]) (status:
            a whole reply's HTTP status, 503 when the server is shutting down, else 500);
            read on the event loop. ("gone",) is put there when the client disconnects (`watch`).
        cancel: set when the client has gone, or the server ends the reply; the
            generation ends at the next decode step of the batch (at the next MoE layer
            of a reply generated alone).
        ended_by: why the server set `cancel` (None: the client went): the reply then
            ends with ("error", message), so a client still reading learns it was cut.
    """

    prompt: list[int]
    max_tokens: int
    temperature: float
    top_p: float
    seed: int | None
    stop: list[str]
    loop: asyncio.AbstractEventLoop
    logprobs: int | None = None
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancel: threading.Event = field(default_factory=threading.Event)
    ended_by: str | None = None

    def emit(self, *event) -> None:
        """Hands `event` to the event loop (thread-safe; dropped once the loop is closed)."""
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:
            pass  # the loop has closed: the server is shutting down


def make_job(
    ids: list[int],
    context: int,
    default_max_tokens: int,
    *,
    max_tokens=None,
    max_tokens_name: str = "max_tokens",
    prompt_name: str = "messages",
    temperature=None,
    top_p=None,
    sampling_names=("temperature", "top_p"),
    seed=None,
    seed_name: str = "seed",
    stop=None,
    stop_name: str = "stop",
    logprobs: int | None = None,
) -> Job:
    """A job of prompt `ids`, its fields checked; `max_tokens` None: `default_max_tokens`
    or what the context leaves.

    Raises:
        RequestError: a field out of range (named as the protocol names it), or a prompt
            that fills the context (`prompt_name`).
    """
    temperature, top_p = sampling(temperature, top_p, sampling_names)
    room = context - len(ids)
    if room < 1:
        raise RequestError(
            prompt_name,
            f"the prompt ({len(ids)} tokens) fills the model's context of {context} tokens",
        )
    limit = number(max_tokens, max_tokens_name, None, 1, 1 << 30, integer=True)
    if limit is None:
        limit = min(default_max_tokens, room)
    elif limit > room:
        raise RequestError(
            max_tokens_name,
            f"prompt ({len(ids)} tokens) + {max_tokens_name} ({limit}) exceeds the model's "
            f"context of {context} tokens",
        )
    return Job(
        prompt=ids,
        max_tokens=limit,
        temperature=temperature,
        top_p=top_p,
        seed=number(seed, seed_name, None, 0, 2**64 - 1, integer=True),
        stop=stop_strings(stop, stop_name),
        loop=asyncio.get_running_loop(),
        logprobs=logprobs,
    )


def submit(engine, job: Job) -> None:
    """Queues `job` on `engine` (a GenerationThread).

    Raises:
        RequestError: 503 (kind "server_busy", a Retry-After header) when the queue is full.
    """
    try:
        engine.submit(job)
    except queue.Full:
        raise RequestError(
            None,
            f"the server is busy ({engine.queued()} requests queued); retry later",
            503,
            kind="server_busy",
            headers={"Retry-After": str(engine.retry_after())},
        ) from None


async def watch(request: Request, job: Job) -> None:
    """Waits for the client to disconnect, then cancels `job` and tells its reader
    (("gone",) on its events). For a whole (not streamed) reply, whose handler sends
    nothing until the end and so would not notice a client leaving."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    job.cancel.set()
    job.events.put_nowait(("gone",))


@dataclass
class Collected:
    """A whole reply: its text `pieces` as sent, their `logprobs` records, the job's `end`
    (see `Job.events`), and when its first text came (`time.monotonic_ns()`; None: none
    came)."""

    pieces: list[str]
    logprobs: list[dict]
    end: dict
    first_ns: int | None = None


async def collect(request: Request, job: Job) -> Collected:
    """The whole reply of a submitted `job`; the client disconnecting cancels it.

    Raises:
        RequestError: 499 when the client left, 500 when the generation failed, 503 when
            the server is shutting down.
    """
    watcher = asyncio.create_task(watch(request, job))
    pieces, records, first = [], [], None
    try:
        while True:
            event = await job.events.get()
            if event[0] == "text":
                pieces.append(event[1])
                records += event[2]
                first = first or time.monotonic_ns()
            elif event[0] == "start":
                continue
            elif event[0] == "done":
                return Collected(pieces, records, event[1], first)
            elif event[0] == "gone":
                raise RequestError(None, "the client disconnected", 499)
            else:
                status = event[2] if len(event) > 2 else 500
                raise RequestError(None, event[1], status, kind="server_error")
    finally:
        watcher.cancel()
        job.cancel.set()  # a no-op once the reply is over; else the handler was cancelled


async def events(job: Job, start: bool = False) -> AsyncIterator[tuple]:
    """A submitted job's events up to its ("done", end) or ("error", message), its
    ("start", ...) only when `start`; leaving early (the client went away: the streaming
    response stops iterating) cancels it."""
    try:
        while True:
            event = await job.events.get()
            if event[0] == "start" and not start:
                continue
            yield event
            if event[0] not in ("text", "start"):
                return
    finally:
        job.cancel.set()  # a no-op once the reply is over
