"""`expertstream serve` generating several replies at once (engine.serve.batch): each
reply in the batch is the one the request gets alone, greedy or seeded, through every
path of the expert cache; requests join a running batch and leave it."""

import json
import time
from concurrent.futures import ThreadPoolExecutor

import mlx.core as mx
import pytest

from engine.config import StreamConfig
from engine.generate import generate, keyed_sampler, prompt_tokens, sampler
from engine.model import load
from engine.serve.batch import BatchLoop
from engine.serve.reply import Reply

from test_server import PROMPT, Served, hold_replies, http, wait_cancelled

# Prompts of different lengths (2 to 13 tokens) and reply limits, so that the rows are
# padded apart and leave the batch at different steps; two of them sampled, with seeds.
REQUESTS = [
    {"prompt": "Once upon a time", "max_tokens": 30},
    {"prompt": "The little dog ran to the park and", "max_tokens": 12, "stop": ["."]},
    {
        "prompt": "Lily had a red ball. One day",
        "max_tokens": 25,
        "temperature": 0.9,
        "top_p": 0.9,
        "seed": 7,
    },
    {"prompt": "Tom", "max_tokens": 7},
    {"prompt": "The cat sat", "max_tokens": 1},  # ends at its prefill's first token
    {
        "prompt": "A big bear lived in the woods. He liked honey and",
        "max_tokens": 20,
        "temperature": 1.0,
        "seed": 11,
    },
]


def alone(sm, request: dict) -> tuple[str, int, str]:
    """(text, tokens, finish reason) of `request` generated alone by
    engine.generate.generate, as `expertstream generate --seed` does, cut at its stop
    string as the server cuts it."""
    if (seed := request.get("seed")) is not None:
        mx.random.seed(seed)
    ids = prompt_tokens(sm, request["prompt"], chat=False)
    r = generate(
        sm, ids, request["max_tokens"], request.get("temperature", 0.0), request.get("top_p", 1.0)
    )
    text, finish = r.text, r.finish_reason
    for stop in request.get("stop", []):
        if stop in text:
            # the server stops at the token after the one that completed the stop string
            text, finish = text[: text.index(stop)], "stop"
            return text, None, finish
    return text, len(r.tokens), finish


def held_at_once(served, gate, requests: list[dict]) -> list:
    """`requests` (completions arguments) sent together while every reply's start is
    held (`hold_replies`): the first is taken and held, the rest queued, then the gate
    opens; their replies, in order."""
    client = served.client(max_retries=0, timeout=120)
    with ThreadPoolExecutor(len(requests)) as pool:
        futures = [pool.submit(client.completions.create, model="m", **r) for r in requests]
        while not (served.engine.busy() and served.engine.queued() == len(requests) - 1):
            time.sleep(0.01)
        gate.set()
        return [f.result() for f in futures]


@pytest.mark.parametrize(
    ("slots", "step"),
    [(8, None), (None, None), (8, 3)],
    ids=["over-capacity", "resident", "3-token-prefill-forwards"],
)
def test_replies_in_a_batch_equal_each_request_alone(monkeypatch, slots, step):
    """Six requests held in the queue, then let go at once: they prefill together
    (padded), decode side by side and leave at different steps. With 8 slots a step's
    union of experts (up to 6 x top-4) exceeds the slots (the over-capacity path); with
    every expert resident it is the table path. With 3 prompt tokens per prefill
    forward, the short prompts end their prefill and decode while the long ones still
    prefill. Each reply equals the request alone on the CPU, sampled ones included (each
    row keeps its own seeded key)."""
    served = Served(expert_slots=slots)
    if step is not None:
        served.engine.prefill_step_size = step
    gate = hold_replies(monkeypatch)
    try:
        replies = held_at_once(served, gate, REQUESTS)
        stats = served.stats()
        stats, overcap = stats["server"], stats["cache"]["overcap_calls"]
    finally:
        gate.set()
        served.close()
    assert stats["mean_batch"] > 2, stats  # they did run side by side
    # 8 MoE layers: beyond the prefill's forwards, steps of one token a row whose union
    # of experts overflowed the slots; none with every expert resident.
    prefill_forwards = 1 if step is None else 4  # the 13-token prompt's 12 tokens
    assert overcap > 8 * prefill_forwards if slots else overcap == 0
    sm = load(None, StreamConfig(expert_slots=slots))
    for request, reply in zip(REQUESTS, replies, strict=True):
        text, tokens, finish = alone(sm, request)
        choice = reply.choices[0]
        assert (choice.text, choice.finish_reason) == (text, finish), request
        if tokens is not None:
            assert reply.usage.completion_tokens == tokens, request


def test_a_request_joins_a_running_reply_and_leaves_before_it(served):
    """A short reply asked for while a long one streams joins the batch and ends first
    (no client waits for another's whole reply), equal to the request alone; /v1/stats
    shows the reply in progress; the long one's client leaving drops its row."""
    client = served.client(max_retries=0, timeout=120)
    before = served.stats()["server"]
    with client.completions.with_streaming_response.create(
        model="m", prompt=PROMPT, max_tokens=1500, stream=True
    ) as response:
        lines = (line for line in response.iter_lines() if line)
        first = json.loads(next(lines).removeprefix("data: "))
        assert first["choices"][0]["text"]
        [generating] = served.stats()["server"]["replies"]
        assert generating["prompt_tokens"] == 4 and generating["generated_tokens"] >= 1
        short = client.completions.create(model="m", prompt="Tom went", max_tokens=8)
        after = json.loads(next(lines).removeprefix("data: "))
        assert after["choices"][0]["finish_reason"] is None  # still streaming
    sm = load(None, StreamConfig(expert_slots=8))
    text, tokens, finish = alone(sm, {"prompt": "Tom went", "max_tokens": 8})
    assert (short.choices[0].text, short.usage.completion_tokens) == (text, tokens)
    s = wait_cancelled(served, before, 20)
    assert (s["cancelled"], s["completed"]) == (before["cancelled"] + 1, before["completed"] + 1)
    assert s["replies"] == [] and s["completion_tokens"] - before["completion_tokens"] < 500
    assert http("GET", f"{served.url}/health") == (200, {"status": "ok"})


def test_a_joining_request_gets_its_first_token_out_of_its_prefill(served, monkeypatch):
    """A request that joins a running reply gets its first token out of its own prefill:
    between the generation thread taking it and its first token, the running reply gets
    no token (no decode step of the batch comes between); then both go on side by side.
    Seen through the thread's own calls, in its order, not through timing."""
    events = []  # ("taken", job) when the thread takes a job; a job for each token it gets
    begin, respond = served.engine._begin, Reply.respond

    def taken(job):
        events.append(("taken", job))
        return begin(job)

    def responded(self, *args):
        events.append(self.job)
        return respond(self, *args)

    monkeypatch.setattr(served.engine, "_begin", taken)
    monkeypatch.setattr(Reply, "respond", responded)
    client = served.client(max_retries=0, timeout=120)
    with client.completions.with_streaming_response.create(
        model="m", prompt=PROMPT, max_tokens=1500, stream=True
    ) as response:
        lines = (line for line in response.iter_lines() if line)
        next(lines)  # the running reply's text flows
        short = client.completions.create(model="m", prompt="Tom went to the park", max_tokens=4)
    assert short.usage.completion_tokens == 4
    running, joining = [e[1] for e in events if isinstance(e, tuple)]
    at = events.index(("taken", joining))
    first = next(i for i in range(at, len(events)) if events[i] is joining)
    assert [e is running for e in events[at:first]] == [False]  # only the taking
    assert sum(e is joining for e in events) == 4
    assert sum(e is running for e in events[first:]) >= 3  # side by side with the others


def test_a_request_cancelled_while_it_prefills_leaves_before_its_next_forward(monkeypatch):
    """With 2 prompt tokens a prefill forward, a 13-token prompt whose job is cancelled
    after its first forward is in no later one; the prompt cache keeps the KV prefilled
    so far (the same prompt asked again prefills only the rest), and the reply beside it
    goes on, equal to the request alone."""
    served = Served(prompt_cache_bytes=1 << 26)
    served.engine.prefill_step_size = 2
    long = REQUESTS[-1]["prompt"]
    widths = []  # rows of each prefill forward, by prompt length
    prefill = BatchLoop._prefill

    def cancelling(self):
        widths.append(sorted(len(row.reply.job.prompt) for row in self.prefill.rows))
        prefill(self)
        for row in self.prefill.rows:
            if len(row.reply.job.prompt) == 13:
                row.reply.job.cancel.set()

    monkeypatch.setattr(BatchLoop, "_prefill", cancelling)
    gate = hold_replies(monkeypatch)
    try:
        asked = [{"prompt": p, "max_tokens": 8} for p in ("Once upon a time", long)]
        kept, cancelled = held_at_once(served, gate, asked)
        stats = served.stats()["server"]
        monkeypatch.setattr(BatchLoop, "_prefill", prefill)
        again = served.client(max_retries=0, timeout=120).completions.create(
            model="m", prompt=long, max_tokens=8
        )
    finally:
        gate.set()
        served.close()
    assert widths == [[5, 13], [5]]  # the long prompt gone after its first forward
    assert (cancelled.usage.completion_tokens, cancelled.choices[0].finish_reason) == (0, None)
    assert (stats["completed"], stats["cancelled"]) == (1, 1)
    assert again.usage.prompt_tokens_details.cached_tokens == 2
    sm = load(None, StreamConfig(expert_slots=8))
    for prompt, reply in (("Once upon a time", kept), (long, again)):
        text, tokens, _ = alone(sm, {"prompt": prompt, "max_tokens": 8})
        assert (reply.choices[0].text, reply.usage.completion_tokens) == (text, tokens)


@pytest.mark.parametrize(("temperature", "top_p", "seed"), [(0.8, 0.9, 7), (1.0, 1.0, 2**64 - 1)])
def test_a_keyed_sampler_samples_as_the_global_key_seeded(temperature, top_p, seed):
    """A row's own key gives the tokens `expertstream generate --seed` gives alone."""
    logprobs = mx.log(mx.softmax(mx.random.normal((1, 4096), key=mx.random.key(3)), axis=-1))
    mx.random.seed(seed)
    shared = sampler(temperature, top_p)
    want = [shared(logprobs).item() for _ in range(8)]
    own = keyed_sampler(temperature, top_p, seed)
    mx.random.seed(0)  # the global key does not matter to it
    assert [own(logprobs).item() for _ in range(8)] == want
    assert len(set(want)) > 1


def test_the_routing_trace_of_a_batch_marks_only_prompts_as_prefill(monkeypatch, tmp_path):
    """Two 5-token prompts prefilled together (one forward of 2 x 4 tokens), then decode
    steps of one token per reply: only the prompts' rows are marked prefill."""
    import urllib.request

    from engine.trace import load_trace

    served = Served(trace_tokens=4096)
    gate = hold_replies(monkeypatch)
    try:
        prompts = ([11, 12, 13, 14, 15], [21, 22, 23, 24, 25])
        replies = held_at_once(served, gate, [{"prompt": p, "max_tokens": 6} for p in prompts])
        assert [r.usage.completion_tokens for r in replies] == [6, 6]
        with urllib.request.urlopen(f"{served.url}/v1/trace", timeout=60) as r:
            (tmp_path / "t.npz").write_bytes(r.read())
    finally:
        gate.set()
        served.close()
    trace = load_trace(tmp_path / "t.npz")
    assert trace.prefill[:8].tolist() == [1] * 8 and trace.prefill[8:].sum() == 0
    assert len(trace.prefill) - 8 >= 2 * 6 and trace.segments.tolist() == [0]


def test_requests_wait_beyond_the_queue_only_while_the_batch_is_full(monkeypatch):
    """--max-queue counts the requests that wait while the batch is full: with one reply
    generating (held at its start, as in a long prefill forward) and 3 of 4 rows free, a
    server of queue 1 takes 3 requests for the free rows and 1 to wait, and refuses the
    next with 503; every accepted one is answered once the reply goes on. The queue
    alone is not the bound: a request finds a free row while one is free."""
    small = Served(max_queue=1, max_batch=4)
    gate = hold_replies(monkeypatch)
    try:
        client = small.client(max_retries=0, timeout=120)
        with ThreadPoolExecutor(5) as pool:
            accepted = [pool.submit(client.completions.create, model="m", prompt=PROMPT)]
            while not small.engine.busy():
                time.sleep(0.01)
            for n in range(1, 5):
                accepted.append(
                    pool.submit(client.completions.create, model="m", prompt=PROMPT, max_tokens=n)
                )
                while small.engine.queued() < n and not accepted[-1].done():  # done: refused
                    time.sleep(0.01)
            status, refused = http("POST", f"{small.url}/v1/completions", {"prompt": PROMPT})
            gate.set()
            tokens = [f.result().usage.completion_tokens for f in accepted]
        assert status == 503 and refused["error"]["type"] == "server_busy", refused
        assert tokens[1:] == [1, 2, 3, 4]
        s = small.stats()["server"]
        assert (s["requests"], s["requests_refused"], s["completed"]) == (5, 1, 5)
    finally:
        gate.set()
        small.close()
