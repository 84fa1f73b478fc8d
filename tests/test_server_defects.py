"""The server's answers to clients that push at its edges, each tried as a hostile client
would, on a loopback port."""

import logging
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Route

import engine.serve.bodies
from engine.config import StreamConfig
from engine.generate import generate, prompt_tokens
from engine.model import load
from engine.serve.bodies import Job
from engine.serve.server import GenerationThread, uvicorn_server

from test_server import PROMPT, Served, hold_replies, http, raw_post, wait_cancelled


@pytest.mark.parametrize("temperature", [1e-45, 1e-300, 5e-324, 1e-38])
def test_tiny_temperatures_are_greedy(temperature):
    """mlx-lm scales log-probabilities by 1 / temperature: a temperature whose reciprocal
    is past float32's range samples greedily, as its limit does, instead of turning every
    log-probability into -inf (`generate --temp` and the server both sample through
    engine.generate)."""
    sm = load(None, StreamConfig(expert_slots=8))
    ids = prompt_tokens(sm, PROMPT, chat=False)
    greedy = generate(sm, ids, 12)
    assert greedy.text.startswith(" time, there was")
    assert generate(sm, ids, 12, temperature=temperature).tokens == greedy.tokens


def test_generate_temp_1e_300_is_greedy(capfd):
    """`expertstream generate --temp 1e-300` prints the greedy text."""
    from engine.cli import main

    def run(*flags) -> str:
        assert main(["generate", "--prompt", PROMPT, "--max-tokens", "10", *flags]) == 0
        return capfd.readouterr().out

    greedy = run()
    assert greedy.startswith(PROMPT + " time, there was") and run("--temp", "1e-300") == greedy


def test_tiny_temperature_over_http(served):
    client = served.client(max_retries=0)
    greedy = client.completions.create(model="m", prompt=PROMPT, max_tokens=10)
    tiny = client.completions.create(model="m", prompt=PROMPT, max_tokens=10, temperature=1e-45)
    assert tiny.choices[0].text == greedy.choices[0].text


@pytest.mark.parametrize(
    ("route", "body", "param"),
    [
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "a\ud800b"}]},
            "messages[0].content",
        ),
        ("/v1/completions", {"prompt": "\ud800", "max_tokens": 2}, "prompt"),
        ("/v1/completions", {"prompt": PROMPT, "stop": ["\udfff"]}, "stop[0]"),
        # in a key: the error named it as it was, and its JSON could not be written (500)
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x", "\ud800": "\udc01"}]},
            "messages[0].\\ud800",
        ),
        ("/v1/completions", {"prompt": PROMPT, "\ud800": 1}, "\\ud800"),
        # escaped inside a call's JSON arguments text, which the body's check did not see:
        # the chat template was blamed for what the tokenizer refused
        (
            "/v1/chat/completions",
            {
                "messages": [
                    {"role": "user", "content": "x"},
                    {
                        "role": "assistant",
                        "tool_calls": [
                            {
                                "id": "a",
                                "type": "function",
                                "function": {"name": "f", "arguments": '{"\\ud800": 1}'},
                            }
                        ],
                    },
                ]
            },
            "messages[1].tool_calls[0].function.arguments",
        ),
    ],
)
def test_a_lone_surrogate_is_refused_naming_the_field(served, route, body, param):
    """JSON can spell a lone surrogate ("\\ud800"), which no text encoding takes: the
    request gets a 400 naming the field, before the tokenizer sees it."""
    status, reply = http("POST", served.url + route, body)
    assert status == 400 and reply["error"]["param"] == param, reply
    assert "surrogate" in reply["error"]["message"]


def test_a_disconnect_cancels_a_whole_reply(served):
    """A non-streamed reply whose client left is cancelled while it generates, not run
    to its last token."""
    before = served.stats()["server"]
    client = served.client(max_retries=0, timeout=1.0)
    with pytest.raises(openai.APITimeoutError):
        client.completions.create(model="m", prompt=PROMPT, max_tokens=1500)
    s = wait_cancelled(served, before, 30)
    assert (s["cancelled"], s["completed"]) == (before["cancelled"] + 1, before["completed"])
    assert s["completion_tokens"] - before["completion_tokens"] < 500


def test_a_body_longer_than_the_limit_is_refused_by_its_length(served):
    """A Content-Length of 999999999 with a 2-byte body is refused from the header, not
    waited for."""
    t0 = time.monotonic()
    answer = raw_post(served.url, b"{}", length=999_999_999)
    assert answer.startswith(b"HTTP/1.1 413 ") and b"over 1048576 bytes" in answer
    assert time.monotonic() - t0 < 5


@pytest.fixture
def uvicorn_errors():
    """The records uvicorn's error logger gets (where it writes an app's tracebacks)."""
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("uvicorn.error")
    logger.addHandler(handler)
    yield records
    logger.removeHandler(handler)


def test_a_stalled_body_is_refused_in_time_and_a_leaving_client_is_quiet(
    served, monkeypatch, uvicorn_errors
):
    """A body that stops coming is answered 408 after BODY_TIMEOUT_S; a client that
    leaves mid-body leaves no ClientDisconnect traceback."""
    monkeypatch.setattr(engine.serve.bodies, "BODY_TIMEOUT_S", 1.0)
    t0 = time.monotonic()
    answer = raw_post(served.url, b'{"prompt"', length=100)
    assert answer.startswith(b"HTTP/1.1 408 ") and 1.0 <= time.monotonic() - t0 < 5
    host, port = served.url.removeprefix("http://").split(":")
    for _ in range(3):
        with socket.create_connection((host, int(port))) as sock:
            sock.sendall(
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{"
            )
            time.sleep(0.2)
    time.sleep(0.5)
    assert [r.getMessage() for r in uvicorn_errors] == []
    assert http("GET", f"{served.url}/health") == (200, {"status": "ok"})


def test_retry_after_counts_the_queued_replies_not_past_long_ones():
    """Retry-After was the mean time of every reply so far times the queue: after a few
    long prompts it said 122 s for a queue of short replies that drained in 3.6 s. Each
    waiting reply is now estimated from its own prompt and limit at the rates seen."""
    thread = GenerationThread(lambda: None, max_queue=8)
    s = thread.stats
    # Four replies of 4,000-token prompts and 4 tokens each: 30 s apiece, nearly all prefill.
    s.completed, s.generation_seconds = 4, 120.0
    s.prompt_tokens = s.prefill_tokens = 16_000
    s.prefill_seconds = 119.0
    s.completion_tokens = s.decode_tokens = 16
    s.decode_seconds = 1.0
    loop = None
    for _ in range(3):  # three short requests wait: 8 prompt tokens, up to 4 tokens each
        thread.submit(Job([1] * 8, 4, 0.0, 1.0, None, [], loop))
    # 3 x (8 / 134.5 + 4 / 16) s = 0.93 s; the old estimate: 30 s x (3 + 1) = 120 s.
    assert thread.retry_after() == 1


def test_access_log_lines_go_to_stderr(capfd):
    """uvicorn's access log (one line per request at --log-level info) goes to stderr:
    stdout is the command's output."""

    class Idle:
        def cancel_all(self):
            pass

    app = Starlette(routes=[Route("/ping", lambda request: PlainTextResponse("pong"))])
    server = uvicorn_server(app, Idle(), "info")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]})
        thread.start()
        while not server.started:
            time.sleep(0.01)
        assert httpx.get(f"http://127.0.0.1:{port}/ping").text == "pong"
        server.should_exit = True
        thread.join(10)
    out, err = capfd.readouterr()
    assert '"GET /ping HTTP/1.1" 200' in err
    assert "/ping" not in out


def test_every_protocol_shares_the_queue_and_refuses_in_its_own_format(monkeypatch):
    """One generation queue behind every route: with one reply generating (held at a
    gate) and one waiting, each protocol's next request gets 503, a Retry-After, and its
    own error body."""
    small = Served(max_queue=1, max_batch=1)
    gate = hold_replies(monkeypatch)
    url = small.url
    try:
        with ThreadPoolExecutor(2) as pool:
            accepted = [
                pool.submit(
                    http, "POST", f"{url}/api/generate", {"prompt": PROMPT, "stream": False}
                )
            ]
            while not small.engine.busy():
                time.sleep(0.01)
            body = {"max_tokens": 2, "messages": [{"role": "user", "content": PROMPT}]}
            accepted.append(pool.submit(http, "POST", f"{url}/v1/messages", body))
            while small.engine.queued() < 1:
                time.sleep(0.01)
            refused = {
                "/v1/completions": {"prompt": PROMPT},
                "/v1/responses": {"input": PROMPT},
                "/v1/messages": body,
                "/api/chat": {"messages": body["messages"], "stream": False},
            }
            answers = {}
            for route, request in refused.items():
                r = httpx.post(url + route, json=request, timeout=30)
                answers[route] = (r.status_code, int(r.headers["retry-after"]) >= 1, r.json())
            gate.set()
            assert [f.result()[0] for f in accepted] == [200, 200]
        assert {route: a[:2] for route, a in answers.items()} == dict.fromkeys(refused, (503, True))
        assert answers["/v1/completions"][2]["error"]["type"] == "server_busy"
        assert answers["/v1/responses"][2]["error"]["type"] == "server_busy"
        assert answers["/v1/messages"][2]["error"]["type"] == "overloaded_error"
        assert answers["/api/chat"][2]["error"].startswith("the server is busy")
        assert small.stats()["server"]["requests_refused"] == 4
    finally:
        gate.set()
        small.close()


ROUTES = {
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
    "/v1/completions": {"prompt": "hi", "max_tokens": 2},
    "/v1/responses": {"input": "hi", "max_output_tokens": 2},
    "/v1/messages": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
    "/api/chat": {"messages": [{"role": "user", "content": "hi"}], "options": {"num_predict": 2}},
    "/api/generate": {"prompt": "hi", "options": {"num_predict": 2}},
}
FIELDS = (
    "messages", "prompt", "input", "max_tokens", "max_output_tokens", "tools", "tool_choice",
    "stop", "stop_sequences", "system", "instructions", "options", "temperature", "top_p",
    "seed", "logprobs", "top_logprobs", "stream_options", "response_format", "text", "n",
    "raw", "format", "think", "top_k",
)  # fmt: skip


@pytest.mark.parametrize("route", ROUTES)
def test_no_field_value_gets_a_5xx(tool_model, route):
    """Every field of every route as null, a negative number, a string, a list, an object
    or a lone surrogate: an answer below 500 (a reply, or the protocol's 400)."""
    served = Served(model=tool_model)
    try:
        statuses = set()
        for name in FIELDS:
            for value in (None, -1, "x", [], [{}], {"a": 1}, "\ud800"):
                body = ROUTES[route] | {name: value, "stream": False}
                status, reply = http("POST", served.url + route, body)
                assert status < 500, (name, value, reply)
                statuses.add(status)
        assert statuses == {200, 400}
    finally:
        served.close()
