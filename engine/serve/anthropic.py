"""Anthropic's Messages API (`POST /v1/messages`, `POST /v1/messages/count_tokens`):
`system`, `max_tokens`, `stop_sequences`, sampling, `tools` with `tool_use` and
`tool_result` blocks, usage (tokens from the prompt cache as `cache_read_input_tokens`),
whole or as server-sent events; Anthropic's error body."""

import json
import uuid
from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from engine.chat import ASSISTANT, SYSTEM, TOOL, USER
from engine.serve.bodies import (
    RequestError,
    Served,
    collect,
    endpoint,
    event_stream,
    events,
    make_job,
    read_json,
    streamed,
    submit,
    text,
    tool_choice,
)
from engine.serve.messages import call_arguments, function_tool
from engine.serve.tool_calls import ToolCall, ToolCallStream

# Anthropic's error types by status.
_ERROR_TYPES = {
    400: "invalid_request_error",
    404: "not_found_error",
    408: "timeout_error",
    413: "request_too_large",
    499: "invalid_request_error",
    503: "overloaded_error",
}


def error_response(e: RequestError) -> JSONResponse:
    """Anthropic's error body, `{"type": "error", "error": {"type", "message"}}`; the
    field in error leads the message."""
    kind = _ERROR_TYPES.get(e.status, "api_error")
    body = {"type": "error", "error": {"type": kind, "message": e.named()}}
    return JSONResponse(body, status_code=e.status, headers=e.headers)


def routes(served: Served) -> list[Route]:
    """The Messages routes of `served`."""

    def prompt(data: dict) -> tuple[list[int], list[dict] | None]:
        tools = anthropic_tools(data)
        messages = anthropic_messages(data.get("messages"), data.get("system"))
        return served.chat_ids(messages, tools, "messages"), tools

    async def messages(request: Request):
        data = await read_json(request)
        stream = streamed(data)
        if data.get("max_tokens") is None:
            raise RequestError("max_tokens", "max_tokens is required")
        ids, tools = prompt(data)
        stops = data.get("stop_sequences")
        job = make_job(
            ids,
            served.context,
            served.default_max_tokens,
            max_tokens=data.get("max_tokens"),
            temperature=data.get("temperature"),
            top_p=data.get("top_p"),
            stop=stops if stops else None,
            stop_name="stop_sequences",
        )
        submit(served.engine, job)
        reply = MessageReply(served, job, tools)
        if stream:
            return event_stream(reply.events())
        return JSONResponse(reply.whole(await collect(request, job)))

    async def count_tokens(request: Request):
        data = await read_json(request)
        return JSONResponse({"input_tokens": len(prompt(data)[0])})

    return [
        Route("/v1/messages", endpoint(messages, error_response), methods=["POST"]),
        Route(
            "/v1/messages/count_tokens", endpoint(count_tokens, error_response), methods=["POST"]
        ),
    ]


def anthropic_tools(data: dict) -> list[dict] | None:
    """The request's tools as chat templates read them (OpenAI's function form); None
    without tools or with tool_choice "none".

    Raises:
        RequestError: naming the field; tool_choice "any" or a named tool (a call cannot
            be forced: replies are not constrained).
    """
    tools = data.get("tools")
    if tool_choice(data.get("tool_choice"), typed=True) == "none" or tools is None:
        return None
    if not isinstance(tools, list):
        raise RequestError("tools", "tools must be a list of tools")
    return [function_tool(t, f"tools[{i}]", "input_schema") for i, t in enumerate(tools)] or None


def _text_blocks(content, where: str) -> str:
    """A string, or text blocks joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise RequestError(where, f"{where} must be a string or a list of content blocks")
    parts = []
    for j, block in enumerate(content):
        if not (isinstance(block, dict) and block.get("type") == "text"):
            raise RequestError(f"{where}[{j}].type", "only text blocks are supported here")
        parts.append(text(block.get("text"), f"{where}[{j}].text"))
    return "".join(parts)


def anthropic_messages(messages, system) -> list[dict]:
    """Messages as the chat template reads them: the system prompt first; a user turn's
    `tool_result` blocks as tool messages and its text as a user message, in order; an
    assistant turn's `tool_use` blocks as its tool calls.

    Raises:
        RequestError: naming the field.
    """
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages", "messages must be a non-empty list of messages")
    out = []
    if system is not None and (prompt := _text_blocks(system, "system")):
        out.append({"role": SYSTEM, "content": prompt})
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in (USER, ASSISTANT):
            raise RequestError(f"{where}.role", f'{where}.role must be "user" or "assistant"')
        content = m.get("content")
        if isinstance(content, str):
            out.append({"role": m["role"], "content": content})
            continue
        if not isinstance(content, list):
            raise RequestError(f"{where}.content", "content must be a string or a list of blocks")
        said, calls = [], []
        for j, block in enumerate(content):
            here = f"{where}.content[{j}]"
            kind = block.get("type") if isinstance(block, dict) else None
            if kind == "text":
                said.append(text(block.get("text"), f"{here}.text"))
            elif kind == "tool_use" and m["role"] == ASSISTANT:
                calls.append(
                    {
                        "id": text(block.get("id", ""), f"{here}.id"),
                        "type": "function",
                        "function": {
                            "name": text(block.get("name"), f"{here}.name", empty=False),
                            "arguments": call_arguments(block.get("input", {}), f"{here}.input"),
                        },
                    }
                )
            elif kind == "tool_result" and m["role"] == USER:
                result = _text_blocks(block.get("content", ""), f"{here}.content")
                if block.get("is_error"):
                    result = f"Error: {result}"
                tool_id = text(block.get("tool_use_id"), f"{here}.tool_use_id", empty=False)
                out.append({"role": TOOL, "tool_call_id": tool_id, "content": result})
            elif kind not in ("thinking", "redacted_thinking"):  # past reasoning: not replayed
                raise RequestError(
                    f"{here}.type", f"{here}.type {kind!r} is not supported in a {m['role']} turn"
                )
        if said or calls:
            message = {"role": m["role"], "content": "".join(said)}
            if calls:
                message["tool_calls"] = calls
            out.append(message)
    return out


def anthropic_usage(usage: dict) -> dict:
    """Anthropic's usage: input_tokens the prompt tokens prefilled, the rest read from
    the prompt cache."""
    return {
        "input_tokens": usage["prompt_tokens"] - usage["cached_tokens"],
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": usage["cached_tokens"],
        "output_tokens": usage["completion_tokens"],
    }


def tool_use(call: ToolCall) -> dict:
    """A call as a `tool_use` block."""
    return {"type": "tool_use", "id": call.id, "name": call.name, "input": call.arguments}


class MessageReply:
    """A Messages reply of a job: whole, or as Anthropic's stream events."""

    def __init__(self, served: Served, job, tools: list[dict] | None):
        self.served, self.job = served, job
        self.split = ToolCallStream(served.tokenizer, tools) if tools else None
        self.id = "msg_" + uuid.uuid4().hex

    def _items(self, piece: str, last: bool) -> list:
        if self.split is None:
            return [piece] if piece else []
        return self.split.feed(piece) + (self.split.end() if last else [])

    def _stop(self, end: dict) -> dict:
        finish = end["finish"]
        if end["stop"] is not None:
            return {"stop_reason": "stop_sequence", "stop_sequence": end["stop"]}
        if finish == "length":
            return {"stop_reason": "max_tokens", "stop_sequence": None}
        if self.split is not None and self.split.calls:
            return {"stop_reason": "tool_use", "stop_sequence": None}
        return {"stop_reason": "end_turn", "stop_sequence": None}

    def _message(self, content: list, usage: dict) -> dict:
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.served.model_id,
            "content": content,
            "stop_reason": None,
            "stop_sequence": None,
            "usage": anthropic_usage(usage),
        }

    def whole(self, got) -> dict:
        """The message object of a collected reply."""
        content = []
        for item in self._items("".join(got.pieces), last=True):
            if isinstance(item, ToolCall):
                content.append(tool_use(item))
            elif content and content[-1]["type"] == "text":
                content[-1]["text"] += item
            else:
                content.append({"type": "text", "text": item})
        if not content:
            content = [{"type": "text", "text": ""}]
        return self._message(content, got.end["usage"]) | self._stop(got.end)

    async def events(self) -> AsyncIterator[str]:
        """message_start, a content block per run of text or per call (start, deltas,
        stop), message_delta (stop reason, usage), message_stop."""

        def event(kind: str, **body) -> str:
            return f"event: {kind}\ndata: {json.dumps({'type': kind, **body})}\n\n"

        index, open_text = 0, False
        # message_start waits for the reply's start, which says how much of the prompt the
        # prompt cache gave: its usage then agrees with message_delta's.
        async for e in events(self.job, start=True):
            if e[0] == "start":
                usage = {
                    "prompt_tokens": len(self.job.prompt),
                    "cached_tokens": e[1]["cached_tokens"],
                    "completion_tokens": 0,
                }
                yield event("message_start", message=self._message([], usage))
                continue
            if e[0] == "error":
                yield event("error", error={"type": "api_error", "message": e[1]})
                return
            last = e[0] == "done"
            for item in self._items("" if last else e[1], last):
                if isinstance(item, ToolCall):
                    if open_text:
                        yield event("content_block_stop", index=index)
                        index, open_text = index + 1, False
                    block = tool_use(item) | {"input": {}}
                    yield event("content_block_start", index=index, content_block=block)
                    delta = {"type": "input_json_delta", "partial_json": item.arguments_json()}
                    yield event("content_block_delta", index=index, delta=delta)
                    yield event("content_block_stop", index=index)
                    index += 1
                    continue
                if not open_text:
                    block = {"type": "text", "text": ""}
                    yield event("content_block_start", index=index, content_block=block)
                    open_text = True
                delta = {"type": "text_delta", "text": item}
                yield event("content_block_delta", index=index, delta=delta)
            if last:
                if open_text:
                    yield event("content_block_stop", index=index)
                end = e[1]
                usage = anthropic_usage(end["usage"])
                yield event("message_delta", delta=self._stop(end), usage=usage)
                yield event("message_stop")
