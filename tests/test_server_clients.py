"""What real clients of `expertstream serve` tripped on (litellm, `llm`, langchain, the
VS Code Ollama provider, Ollama's own client, openai's `models.retrieve`): each through
the raw protocol the client speaks, on a loopback port."""

import json
import urllib.request

import httpx
import ollama
import openai
import pytest

from test_server import PROMPT, Served, http

ASK = [{"role": "user", "content": "weather in Paris?"}]


def sse_data(text: str) -> list[dict]:
    """The JSON objects of a server-sent event stream's `data:` lines."""
    return [
        json.loads(line.removeprefix("data: "))
        for line in text.splitlines()
        if line.startswith("data: ") and line != "data: [DONE]"
    ]


def test_ollama_counts_the_whole_prompt_and_its_cache_hits_apart(tool_served):
    """The second identical /api/chat prefills one token; Ollama's prompt_eval_count is
    still the whole prompt, and prompt_eval_cached_count the tokens the cache gave."""
    ask = [{"role": "user", "content": "the cat sat on the mat"}]  # asked only here
    body = {"messages": ask, "stream": False, "options": {"num_predict": 2}}
    url = f"{tool_served.url}/api/chat"
    first = http("POST", url, body)[1]
    second = http("POST", url, body)[1]
    prompt = first["prompt_eval_count"]
    assert prompt > 2 and "prompt_eval_cached_count" not in first
    assert second["prompt_eval_count"] == prompt
    assert second["prompt_eval_cached_count"] == prompt - 1  # the last token is fed again
    client = ollama.Client(host=tool_served.url)
    assert client.chat(model="m", messages=ask, options={"num_predict": 2}).prompt_eval_count == (
        prompt
    )


NULL_TOOLS = {
    "/v1/chat/completions": (
        {"tools": [{"type": "function", "function": {"name": "get_weather"}}]},
        "function",
        ("description", "parameters"),
    ),
    "/v1/responses": (
        {"tools": [{"type": "function", "name": "get_weather"}]},
        None,
        ("description", "parameters"),
    ),
    "/v1/messages": (
        {"tools": [{"name": "get_weather"}]},
        None,
        ("description", "input_schema"),
    ),
    "/api/chat": (
        {"tools": [{"type": "function", "function": {"name": "get_weather"}}]},
        "function",
        ("description", "parameters"),
    ),
}
BODIES = {
    "/v1/chat/completions": {"messages": ASK, "max_tokens": 2},
    "/v1/responses": {"input": ASK, "max_output_tokens": 2},
    "/v1/messages": {"messages": ASK, "max_tokens": 2},
    "/api/chat": {"messages": ASK, "options": {"num_predict": 2}, "stream": False},
}


def prompt_tokens(route: str, reply: dict) -> int:
    """The prompt length a route's whole reply reports."""
    if route == "/api/chat":
        return reply["prompt_eval_count"]
    usage = reply["usage"]
    if route == "/v1/messages":
        return usage["input_tokens"] + usage["cache_read_input_tokens"]
    return usage.get("prompt_tokens", usage.get("input_tokens"))


@pytest.mark.parametrize("route", NULL_TOOLS)
def test_a_tool_with_a_null_description_or_schema_is_a_tool_without_them(tool_served, route):
    """`llm` sends `"description": null` for a function without a docstring: null is
    absent, so the prompt equals the one of a tool that leaves both out."""
    tools, key, fields = NULL_TOOLS[route]
    absent = BODIES[route] | tools
    status, plain = http("POST", tool_served.url + route, absent)
    assert status == 200, plain
    nulled = json.loads(json.dumps(absent))
    tool = nulled["tools"][0][key] if key else nulled["tools"][0]
    tool.update(dict.fromkeys(fields))
    status, reply = http("POST", tool_served.url + route, nulled)
    assert status == 200, reply
    assert prompt_tokens(route, reply) == prompt_tokens(route, plain)


def test_ollama_version_and_show_name_the_api_and_the_model(served):
    """Clients gate on the Ollama version (VS Code's provider needs 0.6.4, the first with
    /api/show's capabilities); /api/show's model_info names the model."""
    assert http("GET", f"{served.url}/api/version") == (200, {"version": "0.6.4"})
    shown = http("POST", f"{served.url}/api/show", {"model": "m"})[1]
    assert shown["model_info"]["general.basename"] == "tinystories-moe"


def test_the_root_says_ollama_is_running(served):
    """Ollama's own client checks `HEAD /` before anything else."""
    for method in ("GET", "HEAD"):
        with urllib.request.urlopen(urllib.request.Request(served.url + "/", method=method)) as r:
            assert r.status == 200
            assert r.read() == (b"Ollama is running" if method == "GET" else b"")


def test_anthropic_streams_agree_on_the_prompt_cache_from_the_first_event(tool_served):
    """message_start's usage and message_delta's say the same of the prompt cache."""
    body = {"messages": ASK, "max_tokens": 2, "stream": True}
    url = f"{tool_served.url}/v1/messages"
    for _ in range(2):  # the second one's prompt comes from the prompt cache
        events = sse_data(httpx.post(url, json=body, timeout=60).text)
    start = events[0]["message"]["usage"]
    [final] = [e["usage"] for e in events if e["type"] == "message_delta"]
    assert start["cache_read_input_tokens"] > 0
    for key in ("input_tokens", "cache_read_input_tokens", "cache_creation_input_tokens"):
        assert start[key] == final[key], key


def test_more_choices_than_the_queue_holds_is_a_400_naming_n():
    """`n` choices wait in the queue at once: more than --max-queue can never be served,
    which a 503 "retry later" would hide."""
    small = Served(max_queue=2)
    try:
        body = {"prompt": PROMPT, "max_tokens": 1, "n": 3}
        status, reply = http("POST", f"{small.url}/v1/completions", body)
        assert status == 400 and reply["error"]["param"] == "n", reply
        assert "--max-queue (2)" in reply["error"]["message"]
        assert http("POST", f"{small.url}/v1/completions", body | {"n": 2})[0] == 200
    finally:
        small.close()


@pytest.mark.parametrize(
    ("route", "body", "streams"),
    [
        ("/v1/completions", {"prompt": PROMPT, "max_tokens": 2}, False),
        ("/v1/chat/completions", {"messages": ASK, "max_tokens": 2}, False),
        ("/v1/responses", {"input": PROMPT, "max_output_tokens": 2}, False),
        ("/v1/messages", {"messages": ASK, "max_tokens": 2}, False),
        ("/api/chat", {"messages": ASK, "options": {"num_predict": 2}}, True),
        ("/api/generate", {"prompt": PROMPT, "options": {"num_predict": 2}}, True),
    ],
)
def test_a_null_stream_is_the_protocols_default(served, route, body, streams):
    r = httpx.post(served.url + route, json=body | {"stream": None}, timeout=60)
    assert r.status_code == 200, r.text
    if streams:  # Ollama streams NDJSON unless told not to
        lines = r.text.splitlines()
        assert len(lines) > 1 and json.loads(lines[-1])["done"]
    else:
        assert r.headers["content-type"] == "application/json" and r.json()


def test_a_model_is_retrieved_by_its_id(served):
    client = served.client(max_retries=0)
    model = client.models.retrieve("tinystories-moe")
    assert (model.id, model.object, model.owned_by) == ("tinystories-moe", "model", "expertstream")
    with pytest.raises(openai.NotFoundError, match="tinystories-moe"):
        client.models.retrieve("gpt-4")


@pytest.mark.parametrize(
    ("route", "body", "ignored"),
    [
        ("/v1/messages", {"messages": ASK, "max_tokens": 6}, {"top_k": 5}),
        (
            "/v1/chat/completions",
            {"messages": ASK, "max_tokens": 6},
            {"presence_penalty": 1.5, "frequency_penalty": 0.5, "top_k": 5, "min_p": 0.1},
        ),
        (
            "/api/chat",
            {"messages": ASK, "stream": False, "options": {"num_predict": 6}},
            {"options": {"num_predict": 6, "top_k": 5, "repeat_penalty": 1.3, "min_p": 0.1}},
        ),
    ],
)
def test_sampling_fields_the_engine_does_not_apply_are_ignored_on_every_protocol(
    served, route, body, ignored
):
    """One rule (docs/server.md, "Sampling fields"): top_k, min_p and the penalties are accepted
    and ignored everywhere; Anthropic's top_k was refused while the others were not."""
    status, plain = http("POST", served.url + route, body)
    assert status == 200
    status, reply = http("POST", served.url + route, body | ignored)
    assert status == 200, reply
    assert reply_text(route, reply) == reply_text(route, plain) != ""


def reply_text(route: str, reply: dict) -> str:
    """The text of a route's whole reply."""
    if route == "/api/chat":
        return reply["message"]["content"]
    if route == "/v1/messages":
        return reply["content"][0]["text"]
    return reply["choices"][0]["message"]["content"]
