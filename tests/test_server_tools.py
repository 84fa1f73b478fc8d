"""Tool calls, log-probabilities and the prompt cache on the OpenAI routes, through the
official `openai` client. The tool model (tests/tool_model.py) is a real MoE model whose
greedy reply is a call in its template's format, and whose reply after a tool's result is
text."""

import json

import httpx
import mlx.core as mx
import openai
import pytest
from mlx_lm.generate import stream_generate

from engine.chat import chat_ids
from engine.config import StreamConfig
from engine.generate import prompt_tokens
from engine.model import load
from engine.serve.bodies import RequestError, tool_choice

from test_server import PROMPT, Served, http
from tool_model import ANSWER, CALL, TOOLS

ASK = [{"role": "user", "content": "weather in Paris?"}]


@pytest.fixture(scope="module")
def client(tool_served):
    return tool_served.client(max_retries=0)


def test_a_tool_call_whole(client):
    r = client.chat.completions.create(model="m", messages=ASK, tools=TOOLS)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == ""
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == CALL["name"]
    assert json.loads(call.function.arguments) == CALL["arguments"]
    assert r.usage.completion_tokens == 4  # <tool_call>, the JSON, </tool_call>, <eos>


def test_a_tool_call_streamed(client):
    chunks = list(client.chat.completions.create(model="m", messages=ASK, tools=TOOLS, stream=True))
    calls = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
    assert [(tc.index, tc.function.name, json.loads(tc.function.arguments)) for tc in calls] == [
        (0, CALL["name"], CALL["arguments"])
    ]
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == ""
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_the_tool_result_goes_back_through_the_template(client, tool_served):
    first = client.chat.completions.create(model="m", messages=ASK, tools=TOOLS)
    call = first.choices[0].message.tool_calls[0]
    history = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [call.model_dump()],
        },
        {"role": "tool", "tool_call_id": call.id, "content": "sunny"},
    ]
    r = client.chat.completions.create(model="m", messages=history, tools=TOOLS)
    assert r.choices[0].message.content == ANSWER
    assert r.choices[0].finish_reason == "stop" and r.choices[0].message.tool_calls is None
    # What the model saw: the tools, the call and the result, as the template renders them.
    tok = tool_served.engine.sm.tokenizer
    ids = chat_ids(tok, [*ASK, history[1] | {"tool_calls": [_parsed(call)]}, history[2]], 32, TOOLS)
    assert tok.decode(ids) == (
        "SYSTEM TOOLS get_weather END USER weather [UNK] [UNK] END ASSISTANT <tool_call> "
        + "[UNK] " * 5
        + "</tool_call> END TOOL sunny END ANSWER"
    )
    assert r.usage.prompt_tokens == len(ids)


def _parsed(call) -> dict:
    d = call.model_dump()
    d["function"]["arguments"] = json.loads(d["function"]["arguments"])
    return d


def test_without_tools_the_call_is_text(client):
    r = client.chat.completions.create(model="m", messages=ASK)
    assert r.choices[0].message.content == (
        '<tool_call> {"name": "get_weather", "arguments": {"city": "Paris"}} </tool_call>'
    )
    assert r.choices[0].finish_reason == "stop"
    none = client.chat.completions.create(model="m", messages=ASK, tools=TOOLS, tool_choice="none")
    assert none.choices[0].message.content == r.choices[0].message.content


def test_a_call_cut_by_max_tokens_is_given_back_as_text(client):
    r = client.chat.completions.create(model="m", messages=ASK, tools=TOOLS, max_tokens=2)
    assert r.choices[0].finish_reason == "length"
    assert r.choices[0].message.tool_calls is None
    assert r.choices[0].message.content == '<tool_call> {"name": "get_weather", "arguments": ' + (
        '{"city": "Paris"}}'
    )


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"tools": "x"}, "tools"),
        ({"tools": [{"type": "code"}]}, "tools[0].type"),
        ({"tools": [{"type": "function", "function": {}}]}, "tools[0].function.name"),
        ({"tools": TOOLS, "tool_choice": "required"}, "tool_choice"),
        (
            {
                "messages": [
                    {
                        "role": "assistant",
                        "tool_calls": [{"function": {"name": "f", "arguments": "{x"}}],
                    }
                ]
            },
            "messages[0].tool_calls[0].function.arguments",
        ),
    ],
)
def test_bad_tool_requests(tool_served, extra, param):
    body = {"messages": ASK} | extra
    status, reply = http("POST", f"{tool_served.url}/v1/chat/completions", body)
    assert status == 400 and reply["error"]["param"] == param, reply


@pytest.mark.parametrize(
    ("choice", "typed", "message"),
    [
        ("required", False, 'tool_choice "required" is not supported: only "auto" or "none"'),
        (
            {"type": "function", "function": {"name": "f"}},
            False,
            'tool_choice {"type": "function", "function": {"name": "f"}} is not supported',
        ),
        (
            {"type": "any"},
            True,
            'tool_choice {"type": "any"} is not supported: only {"type": "auto"} or '
            '{"type": "none"}',
        ),
    ],
)
def test_tool_choice_that_forces_a_call_is_refused_in_the_protocols_words(choice, typed, message):
    with pytest.raises(RequestError) as e:
        tool_choice(choice, typed)
    assert e.value.param == "tool_choice" and str(e.value).startswith(message), str(e.value)


def test_tool_choice_maps_every_protocols_spelling_onto_one_form():
    forms = [None, "auto", "none"]
    assert [tool_choice(c) for c in forms] == ["auto", "auto", "none"]
    typed = [None, {"type": "auto"}, {"type": "none", "x": 1}, "auto", "none"]
    assert [tool_choice(c, typed=True) for c in typed] == ["auto", "auto", "none", "auto", "none"]


def test_a_model_without_a_tool_template_refuses_tools():
    plain = Served()
    try:
        status, reply = http(
            "POST",
            f"{plain.url}/v1/chat/completions",
            {"messages": [{"role": "user", "content": PROMPT}], "tools": TOOLS},
        )
    finally:
        plain.close()
    assert status == 400 and reply["error"]["param"] == "tools"
    assert "cannot call tools" in reply["error"]["message"]


def test_the_prompt_cache_serves_a_continued_conversation(client, tool_served):
    """The second turn's prompt starts with the first turn's prompt and reply: only the
    rest is prefilled, and usage says how many tokens came from the cache."""
    before = tool_served.stats()
    first = client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "cat sat on mat"}], tools=TOOLS
    )
    call = first.choices[0].message.tool_calls[0]
    history = [
        {"role": "user", "content": "cat sat on mat"},
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "sunny"},
    ]
    second = client.chat.completions.create(model="m", messages=history, tools=TOOLS)
    assert second.choices[0].message.content == ANSWER
    # The first prompt ends "... END ASSISTANT", its reply starts "<tool_call>"; the
    # second prompt renders the call back as "ASSISTANT <tool_call> [UNK] ..." (the JSON
    # as other words than the model's one token): the first prompt and one reply token
    # are common.
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached == first.usage.prompt_tokens + 1
    after = tool_served.stats()
    assert after["server"]["cached_tokens"] - before["server"]["cached_tokens"] == cached + (
        first.usage.prompt_tokens_details.cached_tokens
    )
    assert 0 < after["prompt_cache"]["bytes"] <= after["prompt_cache"]["budget_bytes"]
    assert after["prompt_cache"]["entries"] >= 1
    # The same request again: all but its last token from the cache, the same reply.
    again = client.chat.completions.create(model="m", messages=history, tools=TOOLS)
    assert again.usage.prompt_tokens_details.cached_tokens == second.usage.prompt_tokens - 1
    assert again.choices[0].message.content == ANSWER


def test_logprobs_equal_mlx_lms():
    """The server's log-probabilities are mlx-lm's own (`GenerationResponse.logprobs`) for
    the same steps, on both routes, whole and streamed."""
    sm = load(None, StreamConfig(expert_slots=8))
    ids = prompt_tokens(sm, PROMPT, chat=False)
    want, top = [], []
    for r in stream_generate(sm.model, sm.tokenizer, mx.array(ids), max_tokens=5):
        want.append(r.logprobs[r.token].item())
        order = mx.argsort(-r.logprobs)[:3].tolist()
        top.append([(sm.tokenizer.decode([i]), r.logprobs[i].item()) for i in order])
    del sm
    served = Served()
    try:
        client = served.client(max_retries=0)
        r = client.completions.create(model="m", prompt=PROMPT, max_tokens=5, logprobs=3)
        lp = r.choices[0].logprobs
        assert lp.token_logprobs == pytest.approx(want, abs=1e-5)
        assert [list(d.items()) for d in lp.top_logprobs] == [
            [(t, pytest.approx(v, abs=1e-5)) for t, v in step] for step in top
        ]
        assert "".join(lp.tokens) == r.choices[0].text and lp.text_offset[0] == 0

        messages = [{"role": "user", "content": PROMPT}]
        chat = client.chat.completions.create(
            model="m", messages=messages, max_tokens=5, logprobs=True, top_logprobs=3
        )
        content = chat.choices[0].logprobs.content
        assert [c.logprob for c in content] == pytest.approx(want, abs=1e-5)
        assert [[t.token for t in c.top_logprobs] for c in content] == [
            [t for t, _ in step] for step in top
        ]
        stream = client.chat.completions.create(
            model="m", messages=messages, max_tokens=5, logprobs=True, stream=True
        )
        streamed = [
            e.logprob
            for c in stream
            if c.choices[0].logprobs
            for e in c.choices[0].logprobs.content
        ]
        assert streamed == pytest.approx(want, abs=1e-5)
        status, reply = http(
            "POST", f"{served.url}/v1/chat/completions", {"messages": messages, "top_logprobs": 2}
        )
        assert status == 400 and reply["error"]["param"] == "top_logprobs"
    finally:
        served.close()


def test_bad_requests_never_500(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model="m", messages=[{"role": "tool", "content": "x", "tool_call_id": 5}]
        )
    assert e.value.body["param"] == "messages[0].tool_call_id"


def test_replies_over_the_prompt_cache_equal_replies_without_it():
    """A conversation continued turn by turn, with stop strings, a reply cancelled midway
    and one cancelled during its prefill (either may leave some layers' KV ahead of
    others): the same text with the prompt cache as without, and the cache is used."""
    with_cache, without = Served(prompt_cache_bytes=256 << 20), Served()
    try:

        def turns(served) -> list[str]:
            client = served.client(max_retries=0, timeout=60)
            text, out = PROMPT, []
            for stop in ([". "], None, ["!"], ["."]):
                r = client.completions.create(model="m", prompt=text, max_tokens=20, stop=stop)
                out.append(r.choices[0].text)
                text += r.choices[0].text + " Then"
            # A stream left after a few pieces: cancelled mid-reply.
            with client.completions.with_streaming_response.create(
                model="m", prompt=text, max_tokens=400, stream=True
            ) as response:
                next(response.iter_lines())
            r = client.completions.create(model="m", prompt=text + " and", max_tokens=12)
            out.append(r.choices[0].text)
            # A client gone during a long prefill (no token within 0.2 s).
            text += " and the sun was warm." * 60
            body = {"prompt": text, "max_tokens": 4, "stream": True}
            with pytest.raises(httpx.ReadTimeout):
                httpx.post(f"{served.url}/v1/completions", json=body, timeout=0.2)
            r = client.completions.create(model="m", prompt=text + " So", max_tokens=12)
            return [*out, r.choices[0].text]

        cached = turns(with_cache)
        assert cached == turns(without)
        reused = with_cache.stats()["server"]["cached_tokens"]
        assert reused > 40 and without.stats()["server"]["cached_tokens"] == 0
    finally:
        with_cache.close()
        without.close()


def test_the_prompt_cache_stays_within_its_budget():
    """Different prompts each leave an entry; the least recently used go once their KV
    passes the budget."""
    from engine.resources import default_model_path
    from engine.serve.server import PROMPT_CACHE_ENTRIES

    config = json.loads((default_model_path() / "config.json").read_text())
    # An entry holds the KV of its prompt (5 tokens) and reply (2): float32 keys and
    # values of every layer, as the batch's KV gives them (`BatchKVCache.extract`).
    token = 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * config["head_dim"] * 4
    budget = int(2.5 * 7 * token)  # bytes: two entries
    served = Served(prompt_cache_bytes=budget)
    try:
        client = served.client(max_retries=0)
        words = "cat dog sun tree king ball cake fish bird frog boat hat".split()
        assert len(words) == PROMPT_CACHE_ENTRIES + 2
        shared = []  # tokens reused by each prompt: the start they all share
        for word in words:
            r = client.completions.create(model="m", prompt=f"{PROMPT} {word}", max_tokens=2)
            shared.append(r.usage.prompt_tokens_details.cached_tokens)
            cache = served.stats()["prompt_cache"]
            assert 0 < cache["bytes"] <= budget and cache["budget_bytes"] == budget
        assert shared == [0] + [4] * (len(words) - 1)  # "Once upon a": 4 tokens
        assert cache["entries"] == 2
        # The most recent prompt is kept: asked again, all but its last token are reused.
        again = client.completions.create(model="m", prompt=f"{PROMPT} hat", max_tokens=2)
        assert again.usage.prompt_tokens_details.cached_tokens == again.usage.prompt_tokens - 1
        # The first one is gone: only the start all share is reused.
        first = client.completions.create(model="m", prompt=f"{PROMPT} cat", max_tokens=2)
        assert first.usage.prompt_tokens_details.cached_tokens == 4
    finally:
        served.close()


def test_the_split_keeps_every_character_the_model_wrote_outside_its_calls(tool_model):
    """Through mlx-lm's own state machine and parser (the tool model's tokenizer also has
    reasoning markers): fed a character at a time, the text around the call comes back as
    written, reasoning markers included, and a call that does not parse comes back as
    its text."""
    from mlx_lm.utils import load_tokenizer

    from engine.serve.tool_calls import ToolCall, ToolCallStream

    tok = load_tokenizer(tool_model)
    assert tok.has_thinking and tok.has_tool_calling

    def split(reply: str) -> tuple[str, list]:
        stream = ToolCallStream(tok, TOOLS)
        items = [i for ch in reply for i in stream.feed(ch)] + stream.end()
        said = "".join(i for i in items if isinstance(i, str))
        return said, [(c.name, c.arguments) for c in items if isinstance(c, ToolCall)]

    call = '<tool_call> {"name": "get_weather", "arguments": {"city": "Paris"}} </tool_call>'
    said, calls = split(f"<think> which tool? </think> Checking. {call} Done <tool")
    assert said == "<think> which tool? </think> Checking.  Done <tool"
    assert calls == [("get_weather", {"city": "Paris"})]
    assert split("<tool_call> not json </tool_call> x") == (
        "<tool_call> not json </tool_call> x",
        [],
    )
    assert split('<tool_call> {"name": "f"') == ('<tool_call> {"name": "f"', [])
    # Arguments whose JSON escapes a lone surrogate ("\\ud800") parse to a string that no
    # reply (UTF-8 JSON) can carry: every whole route answered 500 with a traceback. The
    # call is given back as the text the model wrote, which can.
    odd = '<tool_call> {"name": "get_weather", "arguments": {"city": "\\ud800"}} </tool_call>'
    assert split(odd) == (odd, [])


def test_n_choices_whole_and_streamed():
    """`n` choices, each a reply of its own: greedy ones equal, seeded ones repeat per
    seed; usage counts the prompt once and every choice's tokens."""
    served = Served(prompt_cache_bytes=64 << 20)
    try:
        client = served.client(max_retries=0)
        one = client.completions.create(model="m", prompt=PROMPT, max_tokens=6).choices[0].text
        r = client.completions.create(model="m", prompt=PROMPT, max_tokens=6, n=3)
        assert [(c.index, c.text) for c in r.choices] == [(i, one) for i in range(3)]
        assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (4, 18)

        def sampled(**kwargs):
            return client.chat.completions.create(
                model="m",
                messages=[{"role": "user", "content": PROMPT}],
                max_tokens=8,
                temperature=1.0,
                seed=11,
                n=3,
                **kwargs,
            )

        whole = [c.message.content for c in sampled().choices]
        assert len(set(whole)) > 1 and whole == [c.message.content for c in sampled().choices]
        streamed = {}
        for chunk in sampled(stream=True, stream_options={"include_usage": True}):
            for c in chunk.choices:
                streamed[c.index] = streamed.get(c.index, "") + (c.delta.content or "")
            usage = chunk.usage
        assert [streamed[i] for i in range(3)] == whole
        assert usage.completion_tokens == 24 and usage.prompt_tokens == 4
    finally:
        served.close()


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("auto", "must be a size (e.g. 1GiB) or 0 (off), got 'auto'"),
        ("5XB", "must be a size (e.g. 1GiB) or 0 (off), got '5XB'"),
    ],
)
def test_serve_refuses_a_prompt_cache_that_is_not_a_size(capfd, value, message):
    from engine.cli import main

    with pytest.raises(SystemExit) as e:
        main(["serve", "--prompt-cache", value])
    _, err = capfd.readouterr()
    assert e.value.code == 2 and f"argument --prompt-cache: {message}" in err
    assert err.count("\n") == 1
