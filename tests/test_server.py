"""`expertstream serve` through the official `openai` client, on a loopback port.

The server runs in this process (uvicorn in a thread, the model on the server's own
generation thread) with the embedded default model.
"""

import contextlib
import json
import socket
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import uvicorn
from starlette.applications import Starlette

from engine.config import StreamConfig
from engine.model import load
from engine.serve.reply import Reply, StopMatcher
from engine.serve.server import GenerationThread, bind, build_app, uvicorn_server

PROMPT = "Once upon a"


def http(method: str, url: str, body: bytes | dict | None = None) -> tuple[int, dict]:
    """Status and JSON body of one plain HTTP request (no client-side checks)."""
    data = json.dumps(body).encode() if isinstance(body, dict) else body
    request = urllib.request.Request(url, data=data, method=method)
    try:
        with urllib.request.urlopen(request, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        text = e.read()
        return e.code, json.loads(text) if text.startswith(b"{") else {}


def raw_post(base: str, body: bytes, length: int | None = None, path="/v1/completions") -> bytes:
    """The raw HTTP answer to a POST of `body` declared as `length` bytes (default: its
    length), read until the server closes the connection or 10 s pass."""
    host, port = base.removeprefix("http://").split(":")
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body) if length is None else length}\r\n"
        "Connection: close\r\n\r\n"
    )
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(head.encode())
        with contextlib.suppress(OSError):  # the server may answer and close before the end
            sock.sendall(body)
        answer = b""
        # A server that answers before reading the whole body may reset the connection
        # once it closes: what arrived before the reset is the answer.
        with contextlib.suppress(TimeoutError, ConnectionResetError):
            while chunk := sock.recv(65536):
                answer += chunk
    return answer


class Served:
    """A server of `model` (a model directory; None: the embedded model) on a free
    127.0.0.1 port; `url` is its base URL."""

    def __init__(
        self,
        max_queue: int = 32,
        trace_tokens: int = 0,
        model=None,
        prompt_cache_bytes=0,
        max_batch: int = 8,
        **config,
    ):
        self.engine = GenerationThread(
            lambda: load(model, StreamConfig(**{"expert_slots": 8} | config)),
            max_queue,
            trace_tokens,
            prompt_cache_bytes,
            max_batch,
        )
        self.engine.start()
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        app = build_app(self.engine, "tinystories-moe")
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]})
        self.thread.start()
        while not self.server.started:
            time.sleep(0.01)

    def client(self, **kwargs) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", **kwargs)

    def stats(self) -> dict:
        return http("GET", f"{self.url}/v1/stats")[1]

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        assert not self.engine.thread.is_alive()


@pytest.fixture(scope="module")
def client(served):
    return served.client(max_retries=0)


def test_models(client):
    assert [m.id for m in client.models.list().data] == ["tinystories-moe"]


def test_completion_and_its_stream(client):
    r = client.completions.create(model="any", prompt=PROMPT, max_tokens=8)
    text = r.choices[0].text
    assert text.startswith(" time")  # the first token's leading space is kept
    assert r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (4, 8, 12)
    assert r.model == "tinystories-moe"

    chunks = list(
        client.completions.create(
            model="any",
            prompt=PROMPT,
            max_tokens=8,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 8


def test_chat_and_its_stream(client):
    messages = [{"role": "user", "content": PROMPT}]
    r = client.chat.completions.create(model="any", messages=messages, max_tokens=6)
    # The embedded model has no chat template: the chat continues the text.
    completion = client.completions.create(model="any", prompt=PROMPT, max_tokens=6)
    assert r.choices[0].message.content == completion.choices[0].text
    assert r.choices[0].message.role == "assistant"
    assert r.usage.completion_tokens == 6

    stream = client.chat.completions.create(
        model="any", messages=messages, max_tokens=6, stream=True
    )
    deltas = [c.choices[0].delta for c in stream]
    assert deltas[0].role == "assistant"
    assert "".join(d.content or "" for d in deltas) == r.choices[0].message.content


def test_seeded_sampling_repeats(client):
    def sample(seed):
        r = client.completions.create(
            model="any", prompt=PROMPT, max_tokens=12, temperature=1.0, top_p=0.9, seed=seed
        )
        return r.choices[0].text

    assert sample(7) == sample(7)
    assert len({sample(s) for s in range(4)}) > 1


def test_stop_string(client):
    full = client.completions.create(model="any", prompt=PROMPT, max_tokens=24).choices[0].text
    assert "." in full
    r = client.completions.create(model="any", prompt=PROMPT, max_tokens=24, stop=["."])
    assert r.choices[0].text == full[: full.index(".")]
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens < 24
    streamed = client.completions.create(
        model="any", prompt=PROMPT, max_tokens=24, stop=[". "], stream=True
    )
    assert "".join(c.choices[0].text for c in streamed) == full[: full.index(". ")]


def test_stop_matcher_holds_back_a_possible_stop():
    m = StopMatcher(["END", "xy"])
    assert m.add("abc E") == "abc "  # "E" may start "END"
    assert m.add("N") == ""
    assert m.add("Dzz") == "" and m.hit
    m = StopMatcher(["END"])
    assert m.add("abE") == "ab" and m.add("x") == "Ex" and m.flush() == ""
    assert StopMatcher(["E"]).add("abE") == "ab"


def test_cancelled_stream_stops_generating(served, client):
    before = served.stats()["server"]
    with client.completions.with_streaming_response.create(
        model="any", prompt=PROMPT, max_tokens=1500, stream=True
    ) as response:
        lines = response.iter_lines()
        got = [line for line, _ in zip(lines, range(6), strict=False) if line]
    assert got and json.loads(got[0].removeprefix("data: "))["choices"]
    s = wait_cancelled(served, before, 20)
    assert s["cancelled"] == before["cancelled"] + 1 and not s["generating"]
    assert s["completion_tokens"] - before["completion_tokens"] < 500
    assert client.completions.create(model="any", prompt=PROMPT, max_tokens=2).usage


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": PROMPT, "max_tokens": -1}, "max_tokens"),
        ({"prompt": PROMPT, "max_tokens": 0}, "max_tokens"),
        ({"prompt": PROMPT, "max_tokens": 5000}, "max_tokens"),
        ({"prompt": PROMPT, "max_tokens": True}, "max_tokens"),
        ({"prompt": PROMPT, "temperature": "hot"}, "temperature"),
        ({"prompt": PROMPT, "top_p": 1.5}, "top_p"),
        ({"prompt": PROMPT, "stop": [1]}, "stop"),
        ({"prompt": PROMPT, "stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"prompt": PROMPT, "n": 9}, "n"),
        ({"prompt": PROMPT, "n": 0}, "n"),
        ({"prompt": PROMPT, "seed": -1}, "seed"),
        ({"prompt": ""}, "prompt"),
        ({"prompt": {"file": "/etc/passwd"}}, "prompt"),
        ({"prompt": [1, 2, 99999]}, "prompt"),
        ({}, "prompt"),
        ({"prompt": PROMPT, "top_p": 0}, "top_p"),
        ({"prompt": PROMPT, "response_format": {"type": "json_object"}}, "response_format"),
        (b'{"prompt": "Once", "temperature": NaN}', "temperature"),
        (b'{"prompt": "Once", "temperature": Infinity}', "temperature"),
    ],
)
def test_bad_completion_requests(served, body, param):
    status, reply = http("POST", f"{served.url}/v1/completions", body)
    assert status == 400 and reply["error"]["param"] == param, reply


def test_refusals_name_the_field_and_value_as_the_cli_does(served):
    vocab = served.engine.sm.store.config["vocab_size"]
    url = f"{served.url}/v1/completions"
    status, reply = http("POST", url, {"prompt": [5, 99999999]})
    assert status == 400 and reply["error"]["param"] == "prompt"
    assert reply["error"]["message"] == (
        f"prompt token id 99999999 is outside the model's vocabulary of {vocab} tokens "
        f"(ids 0 to {vocab - 1})"
    )
    status, reply = http("POST", url, {"prompt": PROMPT, "top_p": 0})
    assert reply["error"]["message"] == "top_p 0.0: must be in (0, 1]"  # the CLI's words
    status, reply = http("POST", url, {"prompt": PROMPT, "response_format": {"type": "x"}})
    assert 'response_format {"type": "x"} is not supported' in reply["error"]["message"]
    body = {"prompt": PROMPT, "max_tokens": 1, "response_format": {"type": "text"}}
    assert http("POST", url, body)[0] == 200
    assert http("POST", url, {"prompt": PROMPT, "max_tokens": 1, "temperature": 3})[0] == 200


def test_health_reports_the_last_failure_until_a_reply_succeeds(served, monkeypatch):
    from engine.serve.batch import BatchLoop

    def failing(*args, **kwargs):
        raise ValueError("layer01.blob (layer 1, expert 3): checksum mismatch")

    url = f"{served.url}/v1/completions"
    with monkeypatch.context() as m:
        m.setattr(BatchLoop, "_prefill", failing)
        assert http("POST", url, {"prompt": PROMPT, "max_tokens": 2})[0] == 500
        status, health = http("GET", f"{served.url}/health")
    assert status == 200 and health == {
        "status": "ok",
        "last_error": "generation failed: ValueError: layer01.blob (layer 1, expert 3): "
        "checksum mismatch",
    }
    assert http("POST", url, {"prompt": PROMPT, "max_tokens": 1})[0] == 200
    assert http("GET", f"{served.url}/health") == (200, {"status": "ok"})


def test_a_single_token_reply_has_no_decode_rate(served):
    assert http("POST", f"{served.url}/v1/completions", {"prompt": PROMPT, "max_tokens": 1})[0]
    assert served.stats()["server"]["last_decode_tps"] is None


def test_stats_of_nothing_are_null_not_zero():
    """A fresh server (8 slots, no side slots: no prefetch) has looked nothing up and
    generated nothing: its rates are null, not a 0.0 that reads as measured; after a
    reply the hit rate and tokens/s are figures, the prefetch accuracy still null."""
    fresh = Served()
    try:
        s = fresh.stats()
        assert s["cache"]["hits"] == s["cache"]["misses"] == 0
        assert s["cache"]["hit_rate"] is None and s["cache"]["prefetch_accuracy"] is None
        for key in ("tokens_per_second", "last_prefill_tps", "last_decode_tps"):
            assert s["server"][key] is None, key
        assert http("POST", f"{fresh.url}/v1/completions", {"prompt": PROMPT, "max_tokens": 4})
        s = fresh.stats()
        c = s["cache"]
        assert c["hit_rate"] == c["hits"] / (c["hits"] + c["misses"]) and c["misses"] > 0
        assert c["prefetch_issued"] == c["prefetch_wasted"] == 0
        assert c["prefetch_accuracy"] is None
        assert s["server"]["tokens_per_second"] > 0 and s["server"]["last_prefill_tps"] > 0
    finally:
        fresh.close()


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"messages": []}, "messages"),
        ({"messages": "hi"}, "messages"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            "messages[0].content[0]",
        ),
    ],
)
def test_bad_chat_requests(served, body, param):
    status, reply = http("POST", f"{served.url}/v1/chat/completions", body)
    assert status == 400 and reply["error"]["param"] == param, reply


def test_bodies_that_are_not_requests(served):
    url = f"{served.url}/v1/completions"
    for content in (b"{", b"[]", b"\xff\xfe", b"[" * 100_000 + b"]" * 100_000):
        status, reply = http("POST", url, content)
        assert status == 400 and reply["error"]["message"]
    # Refused by its Content-Length, before the rest of its bytes come.
    assert raw_post(served.url, b" " * 1000, length=2 << 20).startswith(b"HTTP/1.1 413 ")
    assert http("GET", url)[0] == 405
    # `model` picks nothing: a path is not opened, the reply names the served model.
    status, reply = http("POST", url, {"model": "/etc/passwd", "prompt": PROMPT, "max_tokens": 1})
    assert status == 200 and reply["model"] == "tinystories-moe"
    assert http("GET", f"{served.url}/health") == (200, {"status": "ok"})


def test_load_16_clients_4_requests_each(served):
    client = served.client(max_retries=0, timeout=120)
    before = served.stats()["server"]

    def one_client(i):
        out = []
        for j in range(4):
            n = 1 + (i + j) % 5
            if j % 2:
                r = client.chat.completions.create(
                    model="any", messages=[{"role": "user", "content": PROMPT}], max_tokens=n
                )
                text = r.choices[0].message.content
            else:
                r = client.completions.create(model="any", prompt=f"{PROMPT} {i}", max_tokens=n)
                text = r.choices[0].text
            out.append((n, r.usage.completion_tokens, r.choices[0].finish_reason, text))
        return out

    with ThreadPoolExecutor(16) as pool:
        replies = [r for rs in pool.map(one_client, range(16)) for r in rs]
    assert len(replies) == 64
    assert all(n == got and finish == "length" and text for n, got, finish, text in replies)
    after = served.stats()
    assert after["server"]["completed"] - before["completed"] == 64
    assert after["server"]["failed"] == before["failed"]
    assert after["server"]["queued"] == 0 and after["cache"]["hits"] > 0
    assert http("GET", f"{served.url}/health") == (200, {"status": "ok"})


def wait_cancelled(served, before: dict, seconds: float) -> dict:
    """The server's stats (`/v1/stats`' "server") once a reply more than in `before` was
    cancelled and none generates, or after `seconds`, whichever comes first."""
    deadline = time.monotonic() + seconds
    while True:
        s = served.stats()["server"]
        if (s["cancelled"] > before["cancelled"] and not s["generating"]) or (
            time.monotonic() >= deadline
        ):
            return s
        time.sleep(0.05)


def hold_replies(monkeypatch) -> threading.Event:
    """An event that every reply's start waits for (the generation thread is held, its
    first job generating and the next ones queued), until it is set."""
    gate = threading.Event()
    start = Reply.start
    monkeypatch.setattr(Reply, "start", lambda self, cached: (gate.wait(), start(self, cached)))
    return gate


def test_full_queue_answers_503_with_retry_after(monkeypatch):
    """A second server whose queue holds one job: with one reply generating (held at a
    gate) and one waiting, the third request is refused and told when to retry; the two
    accepted ones are answered once the gate opens."""
    small = Served(max_queue=1, max_batch=1)
    gate = hold_replies(monkeypatch)
    try:
        client = small.client(max_retries=0)
        with ThreadPoolExecutor(2) as pool:
            accepted = [
                pool.submit(client.completions.create, model="any", prompt=PROMPT, max_tokens=2)
            ]
            while not small.engine.busy():
                time.sleep(0.01)
            accepted.append(
                pool.submit(client.completions.create, model="any", prompt=PROMPT, max_tokens=3)
            )
            while small.engine.queued() < 1:
                time.sleep(0.01)
            with pytest.raises(openai.APIStatusError) as refused:
                client.completions.create(model="any", prompt=PROMPT, max_tokens=1)
            gate.set()
            assert [f.result().usage.completion_tokens for f in accepted] == [2, 3]
        assert refused.value.status_code == 503
        assert int(refused.value.response.headers["retry-after"]) >= 1
        assert refused.value.body["type"] == "server_busy"
        stats = small.stats()["server"]
        assert (stats["requests"], stats["requests_refused"], stats["completed"]) == (2, 1, 2)
    finally:
        gate.set()
        small.close()


def test_on_start_is_called_once_the_port_listens():
    """`serving on ...` was said from the app's lifespan, which uvicorn starts before it
    listens: a client that connected on reading it was refused."""

    class Idle:
        def cancel_all(self):
            pass

    connected = []
    with bind("127.0.0.1", 0) as sock:

        def on_start():
            with socket.create_connection(sock.getsockname(), timeout=10):
                connected.append(True)
            server.should_exit = True

        server = uvicorn_server(Starlette(), Idle(), "warning", on_start)
        server.run(sockets=[sock])
    assert connected == [True]


def test_pipelined_rates_of_nothing_are_null():
    """Every rank's counters summed: no lookup, no prefetch gives null rates (a pipelined
    reply's JSON); counts give their ratio."""
    from engine.pipeline import _SUMMED, combine_stats

    rank = {"layers": [0, 2], **dict.fromkeys(_SUMMED, 0), "peak_memory_bytes": 1}
    rank |= {"prefill_tps": None, "decode_tps": None}
    out = combine_stats([rank, rank | {"layers": [2, 4]}])
    assert out["hit_rate"] is None and out["prefetch_accuracy"] is None
    out = combine_stats([rank | {"hits": 3, "misses": 1, "prefetch_issued": 2}, rank])
    assert out["hit_rate"] == 0.75 and out["prefetch_accuracy"] == 0.0


def test_a_shutdown_ends_the_stream_in_progress_with_an_error():
    """Ctrl+C or SIGTERM (`cancel_all`) while a reply streams: the reply stops at its next
    MoE layer and its stream ends with an error saying so and how many tokens were sent,
    not with a chunk whose finish_reason is null (which reads like an ordinary end)."""
    small = Served()
    try:
        with small.client().completions.with_streaming_response.create(
            model="any", prompt=PROMPT, max_tokens=1500, stream=True
        ) as response:
            lines = (line for line in response.iter_lines() if line)
            first = json.loads(next(lines).removeprefix("data: "))
            assert first["choices"][0]["text"]
            small.engine.cancel_all()
            *_, last = [
                json.loads(line.removeprefix("data: ")) for line in lines if line != "data: [DONE]"
            ]
        message = last["error"]["message"]
        assert message.startswith("the server is shutting down: the reply was cut after ")
        sent = int(message.rsplit(" ", 2)[1])
        assert 1 <= sent < 1500
        s = small.stats()["server"]
        assert (s["cancelled"], s["completed"], s["completion_tokens"]) == (1, 0, sent)
        # A job taken from the queue after the shutdown began fails too, not generated,
        # and a whole reply says so with 503 (unavailable), not 500 (failed).
        with pytest.raises(openai.APIStatusError, match="the server is shutting down") as e:
            small.client(max_retries=0).completions.create(model="any", prompt=PROMPT)
        assert e.value.status_code == 503
        assert small.stats()["server"]["cancelled"] == 2
    finally:
        small.close()
