"""Anthropic's Messages API through the official `anthropic` client: text whole and
streamed, system, stop_sequences, max_tokens, tool_use and tool_result blocks, usage, and
Anthropic's errors."""

import anthropic
import pytest

from test_server import PROMPT, http
from tool_model import ANSWER, CALL

TOOLS = [
    {
        "name": "get_weather",
        "description": "The weather in a city",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
    }
]


def client_of(served) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=served.url, api_key="unused", max_retries=0)


def test_text_whole_and_streamed_equal_the_completion(served):
    client = client_of(served)
    messages = [{"role": "user", "content": PROMPT}]
    m = client.messages.create(model="m", max_tokens=8, messages=messages)
    want = served.client().completions.create(model="m", prompt=PROMPT, max_tokens=8)
    assert m.content[0].type == "text" and m.content[0].text == want.choices[0].text
    assert (m.role, m.stop_reason, m.stop_sequence) == ("assistant", "max_tokens", None)
    assert (m.usage.input_tokens, m.usage.output_tokens) == (4, 8)
    with client.messages.stream(model="m", max_tokens=8, messages=messages) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == m.content[0].text == final.content[0].text
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 8


def test_stop_sequences_and_system(served):
    client = client_of(served)
    messages = [{"role": "user", "content": PROMPT}]
    full = client.messages.create(model="m", max_tokens=24, messages=messages).content[0].text
    m = client.messages.create(model="m", max_tokens=24, messages=messages, stop_sequences=["."])
    assert m.content[0].text == full[: full.index(".")]
    assert (m.stop_reason, m.stop_sequence) == ("stop_sequence", ".")
    # The embedded model has no chat template: a system prompt has no place in its text.
    s = client.messages.create(model="m", max_tokens=24, messages=messages, system="Be brief.")
    assert s.content[0].text == full


def test_tool_use_whole_and_streamed_then_the_result(tool_served):
    client = client_of(tool_served)
    ask = [{"role": "user", "content": "weather in Paris?"}]
    m = client.messages.create(model="m", max_tokens=32, messages=ask, tools=TOOLS)
    assert m.stop_reason == "tool_use"
    [use] = m.content
    assert (use.type, use.name, use.input) == ("tool_use", CALL["name"], CALL["arguments"])
    with client.messages.stream(model="m", max_tokens=32, messages=ask, tools=TOOLS) as stream:
        final = stream.get_final_message()
    [streamed] = final.content
    assert (streamed.type, streamed.name, streamed.input) == (
        "tool_use",
        "get_weather",
        CALL["arguments"],
    )
    assert final.stop_reason == "tool_use"

    history = [
        *ask,
        {"role": "assistant", "content": [use.model_dump()]},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "sunny"}],
        },
    ]
    r = client.messages.create(model="m", max_tokens=32, messages=history, tools=TOOLS)
    assert [(b.type, b.text) for b in r.content] == [("text", ANSWER)]
    assert r.stop_reason == "end_turn"
    # The conversation so far came from the prompt cache.
    assert r.usage.cache_read_input_tokens > 0
    prompt = client.messages.count_tokens(model="m", messages=history, tools=TOOLS)
    assert r.usage.input_tokens + r.usage.cache_read_input_tokens == prompt.input_tokens


def test_tool_choice_none_keeps_the_tools_from_the_model(tool_served):
    client = client_of(tool_served)
    ask = [{"role": "user", "content": "weather in Paris?"}]
    plain = client.messages.create(model="m", max_tokens=32, messages=ask)
    none = client.messages.create(
        model="m", max_tokens=32, messages=ask, tools=TOOLS, tool_choice={"type": "none"}
    )
    assert [(b.type, b.text) for b in none.content] == [("text", plain.content[0].text)]
    assert plain.content[0].text.startswith("<tool_call>") and none.stop_reason == "end_turn"


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"messages": [{"role": "user", "content": "hi"}]}, "max_tokens"),
        ({"max_tokens": 0, "messages": [{"role": "user", "content": "hi"}]}, "max_tokens"),
        ({"max_tokens": 4, "messages": []}, "messages"),
        ({"max_tokens": 4, "messages": [{"role": "system", "content": "x"}]}, "messages[0].role"),
        (
            {"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "image"}]}]},
            "messages[0].content[0].type",
        ),
        (
            {"max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], "temperature": -1},
            "temperature",
        ),
        (
            {"max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], "tools": TOOLS},
            "tools",
        ),
        (
            {"max_tokens": 4, "messages": [{"role": "user", "content": "\ud800"}]},
            "messages[0].content",
        ),
        (
            {
                "max_tokens": 4,
                "messages": [{"role": "user", "content": "hi"}],
                "tool_choice": {"type": "any"},
            },
            "tool_choice",
        ),
    ],
)
def test_bad_requests_get_anthropics_400_naming_the_field(served, body, field):
    status, reply = http("POST", f"{served.url}/v1/messages", body)
    assert status == 400 and reply["type"] == "error", reply
    assert reply["error"]["type"] == "invalid_request_error"
    assert reply["error"]["message"].startswith(field), reply


def test_the_client_raises_on_a_bad_request(served):
    with pytest.raises(anthropic.BadRequestError) as e:
        client_of(served).messages.create(
            model="m",
            max_tokens=4,
            messages=[{"role": "user", "content": "hi"}],
            extra_body={"stop_sequences": [""]},
        )
    assert e.value.status_code == 400 and "stop_sequences" in str(e.value)


def test_count_tokens(served):
    client = client_of(served)
    n = client.messages.count_tokens(model="m", messages=[{"role": "user", "content": PROMPT}])
    assert n.input_tokens == 4
