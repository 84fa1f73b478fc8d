"""Ollama's API, for the front ends that speak it (Open WebUI, Continue, the `ollama`
client, VS Code's Ollama provider): `GET /` (and `HEAD /`, which Ollama's client checks
first), `GET /api/tags`, `GET /api/version`, `POST /api/show`, `POST /api/chat` (with
tools), `POST /api/generate`; streamed as NDJSON (Ollama's default) or one JSON object;
Ollama's error body (`{"error": message}`).

`options` maps onto the shared checks: `num_predict` (absent: the server's default limit;
-1, or more than the context leaves: up to the context, as Ollama stops there),
`temperature`, `top_p`, `seed`, `stop`. Options that tune what this server does
not do (`num_ctx`, `num_gpu`, penalties, ...) are ignored, as Ollama ignores the options
a model does not use.
"""

import json
import time
from collections.abc import AsyncIterator
from datetime import UTC, datetime

from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.routing import Route

from engine.chat import ASSISTANT, ROLES, SYSTEM, TOOL, USER, checked_ids, encode
from engine.serve.bodies import (
    RequestError,
    Served,
    collect,
    endpoint,
    events,
    make_job,
    read_json,
    streamed,
    submit,
    text,
)
from engine.serve.messages import call_arguments, openai_tools
from engine.serve.tool_calls import ToolCall, ToolCallStream

# The Ollama version whose API these routes implement, which `/api/version` answers:
# clients gate on it (VS Code's provider needs 0.6.4), not on this package's version.
# 0.6.4 is the first whose /api/show lists the model's capabilities.
OLLAMA_API_VERSION = "0.6.4"


def error_response(e: RequestError) -> JSONResponse:
    """Ollama's error body, `{"error": message}`; the field in error leads the message."""
    return JSONResponse({"error": e.named()}, status_code=e.status, headers=e.headers)


def now() -> str:
    """The time as Ollama's `created_at` writes it (RFC 3339, UTC)."""
    return datetime.now(UTC).isoformat().replace("+00:00", "Z")


def routes(served: Served) -> list[Route]:
    """The Ollama routes of `served`."""
    family = str(served.config.get("model_type", ""))
    details = {
        "format": "expertstream",
        "family": family,
        "families": [family],
        "parameter_size": "",
        "quantization_level": str((served.config.get("quantization") or {}).get("bits", "")),
    }
    modified = datetime.fromtimestamp(served.created, UTC).isoformat().replace("+00:00", "Z")

    async def tags(request: Request):
        entry = {
            "name": served.model_id,
            "model": served.model_id,
            "modified_at": modified,
            "size": served.size_bytes,
            "digest": "",
            "details": details,
        }
        return JSONResponse({"models": [entry]})

    async def root(request: Request):
        return PlainTextResponse("Ollama is running")

    async def api_version(request: Request):
        return JSONResponse({"version": OLLAMA_API_VERSION})

    async def show(request: Request):
        await read_json(request)
        capabilities = ["completion"]
        if served.tools:
            capabilities.append("tools")
        return JSONResponse(
            {
                "modelfile": "",
                "parameters": "",
                "template": str(getattr(served.tokenizer, "chat_template", None) or ""),
                "details": details,
                "model_info": {
                    "general.architecture": family,
                    "general.basename": served.model_id,
                    f"{family}.context_length": served.context,
                },
                "capabilities": capabilities,
                "modified_at": modified,
            }
        )

    async def chat(request: Request):
        data = await read_json(request)
        check_common(data)
        tools = openai_tools(data)
        ids = served.chat_ids(ollama_messages(data.get("messages")), tools, "messages")
        return await reply(request, data, ids, tools, "message")

    async def generate(request: Request):
        data = await read_json(request)
        check_common(data)
        prompt = text(data.get("prompt", ""), "prompt")
        if not prompt:  # how Ollama clients ask for the model to be loaded
            body = {"model": served.model_id, "created_at": now(), "response": ""}
            return JSONResponse(body | {"done": True, "done_reason": "load"})
        system = text(data.get("system", ""), "system")
        raw = data.get("raw", False)
        if not isinstance(raw, bool):
            raise RequestError("raw", "raw must be true or false")
        if raw:
            try:
                ids = checked_ids(encode(served.tokenizer, prompt), served.vocab)
            except ValueError as e:
                raise RequestError("prompt", str(e)) from None
        else:
            turn = [{"role": SYSTEM, "content": system}] if system else []
            ids = served.chat_ids([*turn, {"role": USER, "content": prompt}], None, "prompt")
        return await reply(request, data, ids, None, "response")

    async def reply(request, data, ids, tools, key):
        options = data.get("options")
        options = {} if options is None else options
        if not isinstance(options, dict):
            raise RequestError("options", "options must be an object")
        limit = options.get("num_predict")
        integer = isinstance(limit, int) and not isinstance(limit, bool)
        if limit is not None and (not integer or (limit < 1 and limit != -1)):
            raise RequestError(
                "options.num_predict",
                "options.num_predict must be -1 (up to the context) or an integer >= 1, "
                f"got {json.dumps(limit)}",
            )
        if limit == -1:  # Ollama's "no limit": as far as the context goes
            limit = max(1, served.context - len(ids))
        elif isinstance(limit, int) and not isinstance(limit, bool) and limit > 0:
            # Ollama stops at the context rather than refusing a larger num_predict (front
            # ends send one fixed value whatever the prompt).
            limit = min(limit, max(1, served.context - len(ids)))
        job = make_job(
            ids,
            served.context,
            served.default_max_tokens,
            max_tokens=limit,
            max_tokens_name="options.num_predict",
            prompt_name="messages" if key == "message" else "prompt",
            temperature=options.get("temperature"),
            top_p=options.get("top_p"),
            sampling_names=("options.temperature", "options.top_p"),
            seed=options.get("seed"),
            seed_name="options.seed",
            stop=options.get("stop") or None,
            stop_name="options.stop",
        )
        t0 = time.monotonic_ns()
        submit(served.engine, job)
        out = OllamaReply(served, job, tools, key, t0)
        if streamed(data, default=True):
            return StreamingResponse(out.lines(), media_type="application/x-ndjson")
        return JSONResponse(out.whole(await collect(request, job)))

    def guarded(handler):
        return endpoint(handler, error_response)

    return [
        Route("/", root, methods=["GET"]),
        Route("/api/tags", guarded(tags), methods=["GET"]),
        Route("/api/version", guarded(api_version), methods=["GET"]),
        Route("/api/show", guarded(show), methods=["POST"]),
        Route("/api/chat", guarded(chat), methods=["POST"]),
        Route("/api/generate", guarded(generate), methods=["POST"]),
    ]


def check_common(data: dict) -> None:
    """Fields /api/chat and /api/generate refuse alike: stream, format, think, images."""
    streamed(data, default=True)
    if data.get("format"):
        raise RequestError(
            "format",
            f"format {json.dumps(data['format'])} is not supported: replies are not "
            "constrained (to JSON or a schema)",
        )
    if data.get("think"):
        raise RequestError("think", "think is not supported: the reply has no separate thinking")
    if data.get("images"):
        raise RequestError("images", "images are not supported: the model reads text")


def ollama_messages(messages) -> list[dict]:
    """Ollama's chat messages as the chat template reads them: an assistant's
    `tool_calls` (`[{"function": {"name", "arguments"}}]`), a tool result's `tool_name`.

    Raises:
        RequestError: naming the field.
    """
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages", "messages must be a non-empty list of messages")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise RequestError(f"{where}.role", f"{where}.role must be one of {ROLES}")
        if m.get("images"):
            raise RequestError(f"{where}.images", "images are not supported: the model reads text")
        content = m.get("content") or ""  # absent or null in a turn that only calls tools
        message = {"role": m["role"], "content": text(content, f"{where}.content")}
        if m["role"] == ASSISTANT and m.get("tool_calls"):
            calls = m["tool_calls"]
            if not isinstance(calls, list):
                raise RequestError(f"{where}.tool_calls", "tool_calls must be a list")
            message["tool_calls"] = []
            for j, c in enumerate(calls):
                here = f"{where}.tool_calls[{j}].function"
                f = c.get("function") if isinstance(c, dict) else None
                if not isinstance(f, dict):
                    raise RequestError(here, f"{here} must be an object")
                message["tool_calls"].append(
                    {
                        "type": "function",
                        "function": {
                            "name": text(f.get("name"), f"{here}.name", empty=False),
                            "arguments": call_arguments(
                                f.get("arguments", {}), f"{here}.arguments"
                            ),
                        },
                    }
                )
        if m["role"] == TOOL and m.get("tool_name") is not None:
            message["name"] = text(m["tool_name"], f"{where}.tool_name")
        out.append(message)
    return out


class OllamaReply:
    """An Ollama chat (`key` "message") or generate (`key` "response") reply of a job."""

    def __init__(self, served: Served, job, tools, key: str, t0: int):
        self.served, self.job, self.key, self.t0 = served, job, key, t0
        self.split = ToolCallStream(served.tokenizer, tools) if tools else None
        self.first: int | None = None  # when the first text came, ns

    def _items(self, piece: str, last: bool) -> list:
        if self.split is None:
            return [piece] if piece else []
        return self.split.feed(piece) + (self.split.end() if last else [])

    def _body(self, content: str, calls: list[ToolCall]) -> dict:
        out = {"model": self.served.model_id, "created_at": now()}
        if self.key == "response":
            return out | {"response": content}
        message = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = [
                {"function": {"name": c.name, "arguments": c.arguments}} for c in calls
            ]
        return out | {"message": message}

    def _done(self, end: dict) -> dict:
        """The final object's fields: done, why, the counts and durations (ns)."""
        t = time.monotonic_ns()
        first = self.first if self.first is not None else t
        usage = end["usage"]
        # As Ollama counts them: the whole prompt, and apart (when any) the tokens of it
        # taken from the prompt cache.
        cached = {"prompt_eval_cached_count": n} if (n := usage["cached_tokens"]) else {}
        return {
            "done": True,
            "done_reason": "length" if end["finish"] == "length" else "stop",
            "total_duration": t - self.t0,
            "load_duration": 0,
            "prompt_eval_count": usage["prompt_tokens"],
            "prompt_eval_duration": first - self.t0,
            "eval_count": usage["completion_tokens"],
            "eval_duration": t - first,
        } | cached

    def whole(self, got) -> dict:
        """The one object of a collected reply."""
        self.first = got.first_ns
        items = self._items("".join(got.pieces), last=True)
        said = "".join(i for i in items if isinstance(i, str))
        calls = [i for i in items if isinstance(i, ToolCall)]
        return self._body(said, calls) | self._done(got.end)

    async def lines(self) -> AsyncIterator[str]:
        """NDJSON: one object per text piece or call, then the final one."""
        async for e in events(self.job):
            if e[0] == "error":
                yield json.dumps({"error": e[1]}) + "\n"
                return
            if self.first is None:
                self.first = time.monotonic_ns()
            last = e[0] == "done"
            for item in self._items("" if last else e[1], last):
                calls = [item] if isinstance(item, ToolCall) else []
                body = self._body("" if calls else item, calls)
                yield json.dumps(body | {"done": False}) + "\n"
            if last:
                yield json.dumps(self._body("", []) | self._done(e[1])) + "\n"
