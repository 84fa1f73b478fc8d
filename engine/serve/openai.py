"""OpenAI's chat completions (`POST /v1/chat/completions`, with tools) and completions
(`POST /v1/completions`): SSE streaming or one JSON reply, OpenAI's error body."""

import asyncio
import dataclasses
import json
import threading
import time
import uuid
from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from engine.chat import checked_ids, encode
from engine.serve import bodies
from engine.serve.bodies import (
    MAX_TOP_LOGPROBS,
    Job,
    RequestError,
    Served,
    collect,
    event_stream,
    events,
    make_job,
    number,
    read_json,
    streamed,
    submit,
)
from engine.serve.messages import openai_messages, openai_tools
from engine.serve.tool_calls import ToolCall, ToolCallStream

# OpenAI's limit of `logprobs` on the (legacy) completions route.
MAX_COMPLETION_LOGPROBS = 5
# Choices (`n`) a request may ask for: each is a reply of its own in the queue.
MAX_CHOICES = 8


def error_response(e: RequestError) -> JSONResponse:
    """OpenAI's error body: `{"error": {"message", "type", "param", "code"}}`."""
    kind = e.kind or ("invalid_request_error" if e.status < 500 else "server_error")
    body = {"error": {"message": e.message, "type": kind, "param": e.param, "code": None}}
    return JSONResponse(body, status_code=e.status, headers=e.headers)


def endpoint(handler):
    """`handler` answering its RequestErrors in OpenAI's error format."""
    return bodies.endpoint(handler, error_response)


def routes(served: Served) -> list[Route]:
    """The chat completions and completions routes of `served`."""

    async def chat_completions(request: Request):
        data = await read_json(request)
        check_common(data)
        tools = openai_tools(data)
        messages = openai_messages(data.get("messages"))
        ids = served.chat_ids(messages, tools, "messages")
        top = chat_logprobs(data)
        jobs = jobs_of(served, data, ids, "messages", top)
        submit_all(served.engine, jobs)
        reply = ChatReply(served, jobs, tools, top is not None)
        if streamed(data):
            return sse(reply.chunks(include_usage(data)))
        return JSONResponse(reply.whole(await collect_all(request, jobs)))

    async def completions(request: Request):
        data = await read_json(request)
        check_common(data)
        for name in ("echo", "suffix", "tools"):
            if data.get(name):
                raise RequestError(name, f"{name} is not supported on /v1/completions")
        ids = prompt_ids(data.get("prompt"), served)
        top = number(data.get("logprobs"), "logprobs", None, 0, MAX_COMPLETION_LOGPROBS, True)
        jobs = jobs_of(served, data, ids, "prompt", top)
        submit_all(served.engine, jobs)
        reply = TextReply(served, jobs)
        if streamed(data):
            return sse(reply.chunks(include_usage(data)))
        return JSONResponse(reply.whole(await collect_all(request, jobs)))

    return [
        Route("/v1/chat/completions", endpoint(chat_completions), methods=["POST"]),
        Route("/v1/completions", endpoint(completions), methods=["POST"]),
    ]


def sse(chunks: AsyncIterator[dict]) -> StreamingResponse:
    """Server-sent events of `chunks`, then `[DONE]`."""

    async def lines():
        async for chunk in chunks:
            yield f"data: {json.dumps(chunk)}\n\n"
        yield "data: [DONE]\n\n"

    return event_stream(lines())


def check_common(data: dict) -> None:
    """The fields both routes refuse the same way: model, stream, response_format."""
    if not isinstance(data.get("model", ""), str):
        raise RequestError("model", "model must be a string")
    streamed(data)
    fmt = data.get("response_format")
    # Replies are never constrained (to JSON or a schema): a client that asks for that
    # must not get free text.
    if fmt is not None and fmt != {"type": "text"}:
        raise RequestError(
            "response_format",
            f'response_format {json.dumps(fmt)} is not supported: only {{"type": "text"}}',
        )


def include_usage(data: dict) -> bool:
    """A streamed reply ends with a usage chunk (`stream_options.include_usage`)."""
    options = data.get("stream_options") or {}
    return isinstance(options, dict) and options.get("include_usage") is True


def jobs_of(served: Served, data: dict, ids: list[int], prompt_name: str, top) -> list[Job]:
    """The jobs of an OpenAI request's prompt `ids` and sampling fields: one per choice
    (`n`), each a reply of its own (generated side by side, or one after another where
    the server generates one at a time: the prompt then comes from the prompt cache after
    the first); with a `seed`, choice i samples with seed + i, so that they differ and
    repeat.

    Raises:
        RequestError: naming the field.
    """
    n = number(data.get("n"), "n", 1, 1, MAX_CHOICES, integer=True)
    if n > served.engine.max_queue:
        raise RequestError(
            "n",
            f"n ({n}) is more than the server's --max-queue ({served.engine.max_queue}): "
            "a request's choices wait in the queue together",
        )
    name = "max_completion_tokens" if "max_completion_tokens" in data else "max_tokens"
    first = make_job(
        ids,
        served.context,
        served.default_max_tokens,
        max_tokens=data.get(name),
        max_tokens_name=name,
        prompt_name=prompt_name,
        temperature=data.get("temperature"),
        top_p=data.get("top_p"),
        seed=data.get("seed"),
        stop=data.get("stop"),
        logprobs=top,
    )
    seed = first.seed
    return [first] + [
        dataclasses.replace(
            first,
            seed=None if seed is None else (seed + i) % 2**64,
            events=asyncio.Queue(),
            cancel=threading.Event(),
        )
        for i in range(1, n)
    ]


def submit_all(engine, jobs: list[Job]) -> None:
    """Queues every job of a request, or none: when the queue is full before the last,
    those queued are cancelled (the thread skips them).

    Raises:
        RequestError: 503 (as `submit`).
    """
    for i, job in enumerate(jobs):
        try:
            submit(engine, job)
        except RequestError:
            for queued in jobs[:i]:
                queued.cancel.set()
            raise


async def collect_all(request: Request, jobs: list[Job]) -> list:
    """Every job's whole reply (`collect`), in order; a failure or a disconnect cancels
    the jobs not yet done."""
    try:
        return [await collect(request, job) for job in jobs]
    finally:
        for job in jobs:
            job.cancel.set()  # a no-op for the jobs done


def total_usage(usages: list[dict]) -> dict:
    """The usage of a request's choices: its prompt once, every choice's reply tokens."""
    first = usages[0]
    completion = sum(u["completion_tokens"] for u in usages)
    return first | {
        "completion_tokens": completion,
        "total_tokens": first["prompt_tokens"] + completion,
    }


def chat_logprobs(data: dict) -> int | None:
    """How many alternatives a chat request wants per token (`top_logprobs`), or None
    without `logprobs`."""
    wanted = data.get("logprobs")
    if wanted is not None and not isinstance(wanted, bool):
        raise RequestError("logprobs", "logprobs must be true or false")
    top = number(data.get("top_logprobs"), "top_logprobs", 0, 0, MAX_TOP_LOGPROBS, True)
    if top and not wanted:
        raise RequestError("top_logprobs", "top_logprobs needs logprobs: true")
    return top if wanted else None


def prompt_ids(prompt, served: Served) -> list[int]:
    """Token ids of a completion's `prompt`: a string, a list of one string, or token ids.

    Raises:
        RequestError: naming "prompt".
    """
    vocab = served.vocab
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise RequestError("prompt", "prompt is empty")
        if served.tokenizer is None:
            raise RequestError("prompt", "this model has no tokenizer: give token ids")
        try:
            return checked_ids(encode(served.tokenizer, prompt), vocab)
        except ValueError as e:
            raise RequestError("prompt", str(e)) from None
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


def openai_usage(usage: dict) -> dict:
    """OpenAI's usage object, the prompt cache's part in `prompt_tokens_details`."""
    return {
        "prompt_tokens": usage["prompt_tokens"],
        "completion_tokens": usage["completion_tokens"],
        "total_tokens": usage["total_tokens"],
        "prompt_tokens_details": {"cached_tokens": usage["cached_tokens"]},
    }


def reply_object(reply, kind: str, choices: list, usage: dict | None) -> dict:
    """The OpenAI object (`kind`: "chat.completion", "chat.completion.chunk" or
    "text_completion") of `reply` (a ChatReply or TextReply: its id, created, served)
    holding `choices`, and `usage` (the engine's) in OpenAI's shape when given."""
    out = {
        "id": reply.id,
        "object": kind,
        "created": reply.created,
        "model": reply.served.model_id,
        "choices": choices,
    }
    if usage is not None:
        out["usage"] = openai_usage(usage)
    return out


def token_bytes(token: str) -> list[int]:
    """A token's text as the UTF-8 bytes OpenAI's logprobs entries carry."""
    return list(token.encode("utf-8", "replace"))


def chat_logprobs_object(records: list[dict]) -> dict:
    """Chat's `logprobs`: `{"content": [{"token", "logprob", "bytes", "top_logprobs"}]}`."""
    return {
        "content": [
            {
                "token": r["token"],
                "logprob": r["logprob"],
                "bytes": token_bytes(r["token"]),
                "top_logprobs": [
                    {"token": t, "logprob": v, "bytes": token_bytes(t)} for t, v in r["top"]
                ],
            }
            for r in records
        ],
        "refusal": None,
    }


def text_logprobs_object(records: list[dict], top: int, offset: int) -> dict:
    """Completions' `logprobs`: tokens, token_logprobs, top_logprobs, text_offset (from
    `offset`, characters into the reply)."""
    offsets = []
    for r in records:
        offsets.append(offset)
        offset += len(r["token"])
    return {
        "tokens": [r["token"] for r in records],
        "token_logprobs": [r["logprob"] for r in records],
        "top_logprobs": [dict(r["top"]) for r in records] if top else None,
        "text_offset": offsets,
    }


class ChatReply:
    """A chat completion of a request's jobs (one per choice): the text split from the
    tool calls (with tools), as one object or as chunks."""

    def __init__(self, served: Served, jobs: list[Job], tools: list[dict] | None, logprobs: bool):
        self.served, self.jobs, self.tools, self.logprobs = served, jobs, tools, logprobs
        self.id = "chatcmpl-" + uuid.uuid4().hex
        self.created = int(time.time())

    def _object(self, choices: list, chunk: bool, usage: dict | None = None) -> dict:
        kind = "chat.completion" + (".chunk" if chunk else "")
        return reply_object(self, kind, choices, usage)

    def _split(self) -> ToolCallStream | None:
        return ToolCallStream(self.served.tokenizer, self.tools) if self.tools else None

    @staticmethod
    def _items(split: ToolCallStream | None, piece: str, last: bool) -> list:
        if split is None:
            return [piece] if piece else []
        return split.feed(piece) + (split.end() if last else [])

    @staticmethod
    def _finish(end: dict, split: ToolCallStream | None) -> str | None:
        if end["finish"] == "stop" and split is not None and split.calls:
            return "tool_calls"
        return end["finish"]

    def whole(self, gots: list) -> dict:
        """The chat.completion object of the collected replies, one choice each."""
        choices = []
        for index, got in enumerate(gots):
            split = self._split()
            items = self._items(split, "".join(got.pieces), last=True)
            said = "".join(i for i in items if isinstance(i, str))
            message = {"role": "assistant", "content": said}
            if calls := [i for i in items if isinstance(i, ToolCall)]:
                message["tool_calls"] = [openai_call(c) for c in calls]
            choices.append(
                {
                    "index": index,
                    "message": message,
                    "finish_reason": self._finish(got.end, split),
                    "logprobs": chat_logprobs_object(got.logprobs) if self.logprobs else None,
                }
            )
        return self._object(choices, False, total_usage([g.end["usage"] for g in gots]))

    async def chunks(self, include_usage: bool) -> AsyncIterator[dict]:
        """chat.completion.chunk objects, choice after choice: its role, one per text
        piece or tool call, its finish reason; then the usage (when asked)."""
        usages = []
        try:
            for index, job in enumerate(self.jobs):
                async for chunk in self._choice_chunks(index, job, usages):
                    yield chunk
                if len(usages) == index:  # the choice failed: its error was the last chunk
                    return
            if include_usage:
                yield self._object([], True, total_usage(usages))
        finally:
            for job in self.jobs:
                job.cancel.set()  # a no-op for the jobs done

    async def _choice_chunks(self, index: int, job: Job, usages: list) -> AsyncIterator[dict]:
        role = {"role": "assistant", "content": ""}
        yield self._object([{"index": index, "delta": role, "finish_reason": None}], True)
        split, calls, pending = self._split(), 0, []  # pending: log-probabilities not sent
        async for event in events(job):
            if event[0] == "error":
                yield {"error": {"message": event[1], "type": "server_error"}}
                return
            last = event[0] == "done"
            if not last:
                pending += event[2]
            for item in self._items(split, "" if last else event[1], last):
                delta = {"content": item}
                if isinstance(item, ToolCall):
                    delta = {"tool_calls": [openai_call(item) | {"index": calls}]}
                    calls += 1
                choice = {"index": index, "delta": delta, "finish_reason": None}
                if self.logprobs:
                    choice["logprobs"], pending = chat_logprobs_object(pending), []
                yield self._object([choice], True)
            if last:
                end = event[1]
                done = {"index": index, "delta": {}, "finish_reason": self._finish(end, split)}
                if self.logprobs and pending:
                    done["logprobs"] = chat_logprobs_object(pending)
                yield self._object([done], True)
                usages.append(end["usage"])


def openai_call(call: ToolCall) -> dict:
    """A tool call as OpenAI's `tool_calls` entry."""
    return {
        "id": call.id,
        "type": "function",
        "function": {"name": call.name, "arguments": call.arguments_json()},
    }


class TextReply:
    """A text completion of a request's jobs (one per choice), as one object or as
    chunks."""

    def __init__(self, served: Served, jobs: list[Job]):
        self.served, self.jobs = served, jobs
        self.top = jobs[0].logprobs
        self.id = "cmpl-" + uuid.uuid4().hex
        self.created = int(time.time())

    def _object(self, choices: list, usage: dict | None = None) -> dict:
        return reply_object(self, "text_completion", choices, usage)

    def _logprobs(self, records: list[dict], offset: int) -> dict | None:
        if self.top is None:
            return None
        return text_logprobs_object(records, self.top, offset)

    def whole(self, gots: list) -> dict:
        """The text_completion object of the collected replies, one choice each."""
        choices = [
            {
                "index": index,
                "text": "".join(got.pieces),
                "finish_reason": got.end["finish"],
                "logprobs": self._logprobs(got.logprobs, 0),
            }
            for index, got in enumerate(gots)
        ]
        return self._object(choices, total_usage([g.end["usage"] for g in gots]))

    async def chunks(self, include_usage: bool) -> AsyncIterator[dict]:
        """text_completion chunks, choice after choice: one per text piece, its finish
        reason; then the usage (when asked)."""
        usages = []
        try:
            for index, job in enumerate(self.jobs):
                offset = 0
                async for event in events(job):
                    if event[0] == "error":
                        yield {"error": {"message": event[1], "type": "server_error"}}
                        return
                    if event[0] == "text":
                        logprobs = self._logprobs(event[2], offset)
                        offset += len(event[1])
                        choice = {"index": index, "text": event[1], "finish_reason": None}
                        yield self._object([choice | {"logprobs": logprobs}])
                        continue
                    end = event[1]
                    choice = {"index": index, "text": "", "finish_reason": end["finish"]}
                    yield self._object([choice | {"logprobs": None}])
                    usages.append(end["usage"])
            if include_usage:
                yield self._object([], total_usage(usages))
        finally:
            for job in self.jobs:
                job.cancel.set()  # a no-op for the jobs done
