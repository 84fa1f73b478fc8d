"""Ollama's API through the official `ollama` client: tags, show, chat and generate,
streamed (NDJSON) and not, options, tool calls, and Ollama's errors."""

import ollama
import pytest

from test_server import PROMPT, Served, http
from tool_model import ANSWER, CALL, TOOLS


@pytest.fixture(scope="module")
def client(served):
    return ollama.Client(host=served.url)


@pytest.fixture(scope="module")
def completion(served):
    """The OpenAI route's greedy 8 tokens after PROMPT: what every Ollama reply must say."""
    r = served.client().completions.create(model="m", prompt=PROMPT, max_tokens=8)
    return r.choices[0].text


def test_tags_show_and_version(client):
    [model] = client.list().models
    assert model.model == "tinystories-moe" and model.size > 0
    shown = client.show("tinystories-moe")
    assert "completion" in shown.capabilities and "tools" not in shown.capabilities
    assert shown.modelinfo["general.architecture"] == shown.details.family
    assert http("GET", client._client.base_url.join("/api/version").__str__())[0] == 200


def test_generate_streamed_and_not(client, completion):
    r = client.generate(model="m", prompt=PROMPT, options={"num_predict": 8})
    assert r.response == completion and r.done and r.done_reason == "length"
    assert (r.prompt_eval_count, r.eval_count) == (4, 8)
    assert 0 < r.prompt_eval_duration < r.total_duration and r.eval_duration > 0
    parts = list(client.generate(model="m", prompt=PROMPT, options={"num_predict": 8}, stream=True))
    assert "".join(p.response for p in parts) == completion
    assert [p.done for p in parts].count(True) == 1 and parts[-1].done
    assert parts[-1].eval_count == 8 and parts[-1].total_duration > 0


def test_chat_streamed_and_not(client, completion):
    messages = [{"role": "user", "content": PROMPT}]
    r = client.chat(model="m", messages=messages, options={"num_predict": 8})
    assert r.message.role == "assistant" and r.message.content == completion
    parts = list(client.chat(model="m", messages=messages, options={"num_predict": 8}, stream=True))
    assert "".join(p.message.content for p in parts) == completion
    assert parts[-1].done_reason == "length"


def test_options_stop_seed_temperature(client):
    options = {"num_predict": 24}
    full = client.generate(model="m", prompt=PROMPT, options=options).response
    cut = client.generate(model="m", prompt=PROMPT, options=options | {"stop": ["."]})
    assert cut.response == full[: full.index(".")] and cut.done_reason == "stop"
    sampled = options | {"temperature": 1.0, "seed": 7}
    first = client.generate(model="m", prompt=PROMPT, options=sampled).response
    assert client.generate(model="m", prompt=PROMPT, options=sampled).response == first
    # Options this server has no use for are ignored, as Ollama ignores them.
    assert (
        client.generate(model="m", prompt=PROMPT, options=options | {"num_ctx": 4096}).response
        == full
    )


def test_num_predict_past_the_context_stops_at_it(tool_model):
    """Front ends send one num_predict whatever the prompt: Ollama stops at the context
    rather than refusing it (the OpenAI routes refuse such a max_tokens). The tool model
    (a 512-token context) answers "The cat sat on mat" after "ANSWER"; 509 prompt tokens
    leave room for 3."""
    served = Served(model=tool_model)
    try:
        client = ollama.Client(host=served.url)
        prompt = " ".join(["cat"] * 508 + ["ANSWER"])
        for num_predict in (1_000_000, -1):
            options = {"num_predict": num_predict}
            r = client.generate(model="m", prompt=prompt, raw=True, options=options)
            assert (r.response, r.done_reason) == ("The cat sat", "length")
            assert (r.prompt_eval_count, r.eval_count) == (509, 3)
    finally:
        served.close()


def test_an_empty_prompt_loads_the_model(client):
    r = client.generate(model="m", prompt="")
    assert r.done and r.done_reason == "load" and r.response == ""


def test_tool_calls_then_the_result(tool_model):
    served = Served(model=tool_model)
    try:
        client = ollama.Client(host=served.url)
        assert "tools" in client.show("m").capabilities
        ask = [{"role": "user", "content": "weather in Paris?"}]
        r = client.chat(model="m", messages=ask, tools=TOOLS)
        [call] = r.message.tool_calls
        assert (call.function.name, dict(call.function.arguments)) == (
            CALL["name"],
            CALL["arguments"],
        )
        parts = list(client.chat(model="m", messages=ask, tools=TOOLS, stream=True))
        calls = [c for p in parts for c in (p.message.tool_calls or [])]
        assert [(c.function.name, dict(c.function.arguments)) for c in calls] == [
            (CALL["name"], CALL["arguments"])
        ]
        history = [
            *ask,
            {"role": "assistant", "content": "", "tool_calls": [call.model_dump()]},
            {"role": "tool", "content": "sunny", "tool_name": "get_weather"},
        ]
        assert client.chat(model="m", messages=history, tools=TOOLS).message.content == ANSWER
    finally:
        served.close()


@pytest.mark.parametrize(
    ("route", "body", "field"),
    [
        ("/api/chat", {"messages": []}, "messages"),
        ("/api/chat", {"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
        ("/api/generate", {"prompt": PROMPT, "options": {"num_predict": 0}}, "options.num_predict"),
        (
            "/api/generate",
            {"prompt": PROMPT, "options": {"temperature": "hot"}},
            "options.temperature",
        ),
        ("/api/generate", {"prompt": PROMPT, "options": {"stop": [""]}}, "options.stop"),
        ("/api/generate", {"prompt": PROMPT, "options": {"seed": -3}}, "options.seed"),
        ("/api/generate", {"prompt": PROMPT, "options": ["num_predict"]}, "options"),
        # an empty list (or 0, "") is no object either: it was taken as no options
        ("/api/generate", {"prompt": PROMPT, "options": []}, "options"),
        ("/api/chat", {"messages": [{"role": "user", "content": "x"}], "options": 0}, "options"),
        ("/api/generate", {"prompt": PROMPT, "format": "json"}, "format"),
        ("/api/generate", {"prompt": 5}, "prompt"),
        ("/api/chat", {"messages": [{"role": "user", "content": "x"}], "tools": TOOLS}, "tools"),
    ],
)
def test_bad_requests_get_ollamas_400_naming_the_field(served, route, body, field):
    status, reply = http("POST", served.url + route, body | {"stream": False})
    assert status == 400 and reply["error"].startswith(field), reply


def test_the_client_raises_response_error(client):
    with pytest.raises(ollama.ResponseError) as e:
        client.generate(model="m", prompt=PROMPT, options={"num_predict": -5})
    assert e.value.status_code == 400
    # -1 (Ollama's "no limit") is taken, so the message offers it
    assert e.value.error == (
        "options.num_predict must be -1 (up to the context) or an integer >= 1, got -5"
    )
    for value, shown in ((1.5, "1.5"), ("8", '"8"'), (True, "true")):
        with pytest.raises(ollama.ResponseError) as e:
            client.generate(model="m", prompt=PROMPT, options={"num_predict": value})
        assert e.value.status_code == 400 and e.value.error.endswith(f"got {shown}")
