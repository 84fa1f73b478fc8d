"""OpenAI's Responses API (`POST /v1/responses`), which Codex speaks: `input` as text or
items (messages, `function_call`, `function_call_output`), `instructions`, function
`tools`, `max_output_tokens`, sampling; the reply whole or as its stream of typed events;
OpenAI's error body. Nothing is stored: `previous_response_id` is refused, the client
sends the conversation.
"""

import json
import time
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
    event_stream,
    events,
    make_job,
    read_json,
    streamed,
    submit,
    text,
    tool_choice,
)
from engine.serve.messages import call_arguments, content_text, function_tool
from engine.serve.openai import endpoint
from engine.serve.tool_calls import ToolCall, ToolCallStream

_TEXT_PARTS = ("input_text", "output_text", "text")


def routes(served: Served) -> list[Route]:
    """The Responses route of `served`."""

    async def responses(request: Request):
        data = await read_json(request)
        stream = streamed(data)
        if data.get("previous_response_id") is not None:
            raise RequestError(
                "previous_response_id",
                "previous_response_id is not supported: responses are not stored; send the "
                "conversation as input",
            )
        options = data.get("text") or {}
        if not isinstance(options, dict):
            raise RequestError("text", "text must be an object (its format)")
        if (fmt := options.get("format")) not in (None, {"type": "text"}):
            raise RequestError(
                "text.format",
                f'text.format {json.dumps(fmt)} is not supported: only {{"type": "text"}}',
            )
        tools = responses_tools(data)
        instructions = data.get("instructions")
        messages = responses_input(data.get("input"), instructions)
        ids = served.chat_ids(messages, tools, "input")
        job = make_job(
            ids,
            served.context,
            served.default_max_tokens,
            max_tokens=data.get("max_output_tokens"),
            max_tokens_name="max_output_tokens",
            prompt_name="input",
            temperature=data.get("temperature"),
            top_p=data.get("top_p"),
        )
        submit(served.engine, job)
        reply = ResponsesReply(served, job, tools, data)
        if stream:
            return event_stream(reply.events())
        return JSONResponse(reply.whole(await collect(request, job)))

    return [Route("/v1/responses", endpoint(responses), methods=["POST"])]


def responses_tools(data: dict) -> list[dict] | None:
    """The function tools (`{"type": "function", "name", "parameters", ...}`) as chat
    templates read them; None without tools or with tool_choice "none".

    Raises:
        RequestError: naming the field; a tool of another type, or a tool_choice that
            forces a call.
    """
    tools = data.get("tools")
    if tool_choice(data.get("tool_choice")) == "none" or not tools:
        return None
    if not isinstance(tools, list):
        raise RequestError("tools", "tools must be a list of function tools")
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type") != "function":
            kind = t.get("type") if isinstance(t, dict) else t
            raise RequestError(
                f"tools[{i}].type", f"tools[{i}].type {kind!r} is not supported: only function"
            )
        out.append(function_tool(t, f"tools[{i}]"))
    return out


def responses_input(items, instructions) -> list[dict]:
    """`input` (a string, or items) after `instructions` as chat messages.

    Raises:
        RequestError: naming the field.
    """
    out = []
    if instructions is not None and text(instructions, "instructions"):
        out.append({"role": SYSTEM, "content": instructions})
    if isinstance(items, str):
        if not items:
            raise RequestError("input", "input is empty")
        return [*out, {"role": USER, "content": items}]
    if not isinstance(items, list) or not items:
        raise RequestError("input", "input must be a non-empty string or list of items")
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise RequestError(where, f"{where} must be an object")
        kind = item.get("type", "message")
        if kind == "message":
            role = SYSTEM if item.get("role") == "developer" else item.get("role")
            if role not in (SYSTEM, USER, ASSISTANT):
                raise RequestError(
                    f"{where}.role", f"{where}.role must be user, assistant, system or developer"
                )
            content = content_text(item.get("content"), f"{where}.content", _TEXT_PARTS)
            out.append({"role": role, "content": content})
        elif kind == "function_call":
            call = {
                "id": text(item.get("call_id"), f"{where}.call_id", empty=False),
                "type": "function",
                "function": {
                    "name": text(item.get("name"), f"{where}.name", empty=False),
                    "arguments": call_arguments(item.get("arguments", ""), f"{where}.arguments"),
                },
            }
            if out and out[-1]["role"] == ASSISTANT:  # one turn's calls, one message
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": ASSISTANT, "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            result = content_text(output, f"{where}.output", _TEXT_PARTS)
            call_id = text(item.get("call_id"), f"{where}.call_id", empty=False)
            out.append({"role": TOOL, "tool_call_id": call_id, "content": result})
        elif kind != "reasoning":  # past reasoning: not replayed
            raise RequestError(f"{where}.type", f"{where}.type {kind!r} is not supported")
    return out


class ResponsesReply:
    """A response object of a job: whole, or as the Responses stream's events."""

    def __init__(self, served: Served, job, tools: list[dict] | None, data: dict):
        self.served, self.job, self.data = served, job, data
        self.split = ToolCallStream(served.tokenizer, tools) if tools else None
        self.id = "resp_" + uuid.uuid4().hex
        self.created = int(time.time())

    def _items(self, piece: str, last: bool) -> list:
        if self.split is None:
            return [piece] if piece else []
        return self.split.feed(piece) + (self.split.end() if last else [])

    def _response(self, status: str, output: list, end: dict | None) -> dict:
        out = {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "model": self.served.model_id,
            "output": output,
            "instructions": self.data.get("instructions"),
            "max_output_tokens": self.job.max_tokens,
            "temperature": self.job.temperature,
            "top_p": self.job.top_p,
            "parallel_tool_calls": False,
            "tool_choice": self.data.get("tool_choice") or "auto",
            "tools": self.data.get("tools") or [],
            "error": None,
            "incomplete_details": None,
            "usage": None,
        }
        if end is not None:
            if end["finish"] == "length":
                out["status"] = "incomplete"
                out["incomplete_details"] = {"reason": "max_output_tokens"}
            usage = end["usage"]
            out["usage"] = {
                "input_tokens": usage["prompt_tokens"],
                "input_tokens_details": {"cached_tokens": usage["cached_tokens"]},
                "output_tokens": usage["completion_tokens"],
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": usage["total_tokens"],
            }
        return out

    @staticmethod
    def _message(text_: str, status: str = "completed") -> dict:
        content = [{"type": "output_text", "text": text_, "annotations": [], "logprobs": []}]
        return {
            "type": "message",
            "id": "msg_" + uuid.uuid4().hex,
            "status": status,
            "role": "assistant",
            "content": content if status == "completed" else [],
        }

    @staticmethod
    def _call(call: ToolCall) -> dict:
        return {
            "type": "function_call",
            "id": "fc_" + uuid.uuid4().hex,
            "call_id": call.id,
            "name": call.name,
            "arguments": call.arguments_json(),
            "status": "completed",
        }

    def whole(self, got) -> dict:
        """The response object of a collected reply."""
        output = []
        for item in self._items("".join(got.pieces), last=True):
            if isinstance(item, ToolCall):
                output.append(self._call(item))
            elif output and output[-1]["type"] == "message":
                output[-1]["content"][0]["text"] += item
            else:
                output.append(self._message(item))
        return self._response("completed", output, got.end)

    async def events(self) -> AsyncIterator[str]:
        """response.created, .in_progress; per message its item and part added, text
        deltas, text and part and item done; per call its item added, its arguments, its
        item done; then response.completed (or .incomplete, cut by max_output_tokens)."""
        number = 0

        def event(kind: str, **body) -> str:
            nonlocal number
            number += 1
            data = {"type": kind, "sequence_number": number - 1, **body}
            return f"event: {kind}\ndata: {json.dumps(data)}\n\n"

        yield event("response.created", response=self._response("in_progress", [], None))
        yield event("response.in_progress", response=self._response("in_progress", [], None))
        output: list[dict] = []
        message = None  # the message item being written, and its text

        def close_message():
            item = message | {"status": "completed"}
            item["content"] = self._message(self._text)["content"]
            output.append(item)
            index, part = len(output) - 1, item["content"][0]
            where = {"item_id": item["id"], "output_index": index}
            return [
                event(
                    "response.output_text.done",
                    **where,
                    content_index=0,
                    text=self._text,
                    logprobs=[],
                ),
                event("response.content_part.done", **where, content_index=0, part=part),
                event("response.output_item.done", output_index=index, item=item),
            ]

        async for e in events(self.job):
            if e[0] == "error":
                yield event("error", code="server_error", message=e[1], param=None)
                return
            last = e[0] == "done"
            for item in self._items("" if last else e[1], last):
                if isinstance(item, ToolCall):
                    if message is not None:
                        for line in close_message():
                            yield line
                        message = None
                    call = self._call(item)
                    index = len(output)
                    added = call | {"arguments": "", "status": "in_progress"}
                    yield event("response.output_item.added", output_index=index, item=added)
                    where = {"item_id": call["id"], "output_index": index}
                    yield event(
                        "response.function_call_arguments.delta", **where, delta=call["arguments"]
                    )
                    yield event(
                        "response.function_call_arguments.done",
                        **where,
                        arguments=call["arguments"],
                    )
                    output.append(call)
                    yield event("response.output_item.done", output_index=index, item=call)
                    continue
                if message is None:
                    message, self._text = self._message("", "in_progress"), ""
                    index = len(output)
                    yield event("response.output_item.added", output_index=index, item=message)
                    part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
                    where = {"item_id": message["id"], "output_index": index}
                    yield event("response.content_part.added", **where, content_index=0, part=part)
                self._text += item
                where = {"item_id": message["id"], "output_index": len(output)}
                yield event(
                    "response.output_text.delta", **where, content_index=0, delta=item, logprobs=[]
                )
            if last:
                if message is not None:
                    for line in close_message():
                        yield line
                done = self._response("completed", output, e[1])
                kind = (
                    "response.incomplete"
                    if done["status"] == "incomplete"
                    else "response.completed"
                )
                yield event(kind, response=done)
