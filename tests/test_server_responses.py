"""OpenAI's Responses API (what Codex speaks) through the `openai` client's `responses`
methods: text and function calls, whole and as streamed events, instructions,
max_output_tokens, and OpenAI's errors."""

import json

import openai
import pytest

from test_server import PROMPT, http
from tool_model import ANSWER, CALL

TOOLS = [
    {
        "type": "function",
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    }
]


def test_text_whole_and_streamed(served):
    client = served.client(max_retries=0)
    want = client.completions.create(model="m", prompt=PROMPT, max_tokens=8).choices[0].text
    r = client.responses.create(model="m", input=PROMPT, max_output_tokens=8)
    assert r.output_text == want
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert (r.usage.input_tokens, r.usage.output_tokens, r.usage.total_tokens) == (4, 8, 12)
    events = list(
        client.responses.create(model="m", input=PROMPT, max_output_tokens=8, stream=True)
    )
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == want
    assert events[-1].response.output_text == want


def test_instructions(served):
    client = served.client(max_retries=0)
    messages = [{"role": "user", "content": PROMPT}]
    r = client.responses.create(
        model="m", input=messages, instructions="Be brief.", max_output_tokens=6
    )
    # No chat template: instructions (a system prompt) have no place in the text.
    assert (
        r.output_text
        == client.responses.create(model="m", input=PROMPT, max_output_tokens=6).output_text
    )


def test_function_calls_whole_and_streamed_then_the_output(tool_served):
    client = tool_served.client(max_retries=0)
    ask = [{"role": "user", "content": "weather in Paris?"}]
    r = client.responses.create(model="m", input=ask, tools=TOOLS)
    [call] = r.output
    assert (call.type, call.name, json.loads(call.arguments)) == (
        "function_call",
        CALL["name"],
        CALL["arguments"],
    )
    assert r.status == "completed" and r.output_text == ""
    events = list(client.responses.create(model="m", input=ask, tools=TOOLS, stream=True))
    done = [e.item for e in events if e.type == "response.output_item.done"]
    assert [(i.type, i.name, json.loads(i.arguments)) for i in done] == [
        ("function_call", "get_weather", CALL["arguments"])
    ]
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert json.loads("".join(deltas)) == CALL["arguments"]
    assert events[-1].type == "response.completed"
    with client.responses.stream(model="m", input=ask, tools=TOOLS) as stream:
        final = stream.get_final_response()
    assert [(o.type, o.name, json.loads(o.arguments)) for o in final.output] == [
        ("function_call", "get_weather", CALL["arguments"])
    ]

    history = [
        *ask,
        {
            "type": "function_call",
            "call_id": call.call_id,
            "name": call.name,
            "arguments": call.arguments,
        },
        {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"},
    ]
    answer = client.responses.create(model="m", input=history, tools=TOOLS)
    assert answer.output_text == ANSWER and answer.output[0].type == "message"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({}, "input"),
        ({"input": ""}, "input"),
        ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role"),
        ({"input": [{"type": "image_generation_call"}]}, "input[0].type"),
        ({"input": PROMPT, "max_output_tokens": 0}, "max_output_tokens"),
        ({"input": PROMPT, "previous_response_id": "resp_1"}, "previous_response_id"),
        ({"input": PROMPT, "tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"input": PROMPT, "tools": TOOLS, "tool_choice": "required"}, "tool_choice"),
        ({"input": PROMPT, "top_p": 2}, "top_p"),
        ({"input": PROMPT, "text": {"format": {"type": "json_object"}}}, "text.format"),
        ({"input": PROMPT, "text": "plain"}, "text"),
        (
            {"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{"}]},
            "input[0].arguments",
        ),
    ],
)
def test_bad_requests_get_400_naming_the_field(served, body, param):
    status, reply = http("POST", f"{served.url}/v1/responses", body)
    assert status == 400 and reply["error"]["param"] == param, reply


def test_tools_on_a_model_that_cannot_call_them(served):
    with pytest.raises(openai.BadRequestError) as e:
        served.client(max_retries=0).responses.create(model="m", input=PROMPT, tools=TOOLS)
    assert e.value.body["param"] == "tools"
