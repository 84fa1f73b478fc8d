"""`expertstream serve --pipeline` on loopback (engine.serve.pipeline), through the
official `openai` client.

`mlx.launch --backend ring -n 2` starts the server: rank 0 serves HTTP, rank 1 follows.
A greedy completion equals the single-process model's reply; a streamed one ends at its
stop string on every rank (the next reply is still right); a sampled one with a seed
equals one process's with that seed; `/v1/stats` holds both ranks' figures; Ctrl-C
(SIGINT to the launcher's process group, as a terminal sends it) ends every process,
rank 1 by rank 0's word. A follower killed while rank 0 idles ends rank 0 with an error.
Every wait is bounded.
"""

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import mlx.core as mx
import openai
import pytest

from engine.config import StreamConfig
from engine.convert import convert
from engine.generate import generate, prompt_tokens
from engine.model import load

from factories import write_tokenizer
from test_pipeline import LAUNCH, free_ports

pytestmark = pytest.mark.skipif(
    not mx.distributed.is_available(), reason="this MLX build has no distributed backend"
)

PROMPT = "The cat sat on the mat"
TOKENS = 12
SEED = 7
SLOTS = "3"  # of 8 experts: misses on every rank
START_TIMEOUT_S = 180  # two ranks loading on a loaded machine of few cores
RANK_LINE = "(pid "


@pytest.fixture(scope="module")
def store(model_dirs, tmp_path_factory):
    """The store of a 4-layer qwen3_moe model with a word-level tokenizer."""
    model_dir = model_dirs("qwen3_moe")
    write_tokenizer(model_dir)
    return convert(model_dir, tmp_path_factory.mktemp("st") / "qwen3")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_argv(store: Path) -> list[str]:
    return [sys.executable, "-m", "engine.cli", "serve", "--pipeline", "--model", str(store)]


def wait_ready(url: str, procs: list[subprocess.Popen], log: Path) -> None:
    """Waits until the server answers /health (bounded); fails with the log if a
    process ends first."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        assert all(p.poll() is None for p in procs), log.read_text()
        with contextlib.suppress(OSError):
            with urllib.request.urlopen(f"{url}/health", timeout=5) as r:
                if r.status == 200:
                    return
        time.sleep(0.5)
    pytest.fail(f"the server did not start within {START_TIMEOUT_S} s:\n{log.read_text()}")


def rank_pids(log: Path) -> dict[int, int]:
    """rank -> pid, from the "rank R/N (decoder layers ...) (pid P): ..." lines."""
    pids = {}
    for line in log.read_text().splitlines():
        if line.startswith("rank ") and RANK_LINE in line:
            rank = int(line.split()[1].split("/")[0])
            pids[rank] = int(line.split(RANK_LINE)[1].split(")")[0])
    return pids


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    # A child of ours that ended but was not reaped is gone too.
    with contextlib.suppress(ChildProcessError):
        return os.waitpid(pid, os.WNOHANG)[0] == pid
    return False


def test_two_ranks_serve_like_one_process(store, tmp_path):
    sm = load(store, StreamConfig(expert_slots=int(SLOTS)))
    ids = prompt_tokens(sm, PROMPT, False)
    single = generate(sm, ids, TOKENS)
    mx.random.seed(SEED)
    sampled = generate(sm, ids, TOKENS, temperature=1.0)
    assert sampled.tokens != single.tokens  # the sampling is seen
    del sm
    # A stop string that begins mid-reply: the first word not seen before, from the 4th
    # (one process stops after that word's token: its index + 1 tokens).
    words = single.text.split()
    at, stop = next((i, " " + w) for i, w in enumerate(words) if i >= 3 and w not in words[:i])
    cut = single.text[: single.text.index(stop)]

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = tmp_path / "launch.log"
    cmd = [str(LAUNCH), "--backend", "ring", "-n", "2", "--starting-port", str(free_ports(2))]
    cmd += ["--", *serve_argv(store), "--port", str(port), "--expert-slots", SLOTS]
    with log.open("w") as out:
        launcher = subprocess.Popen(
            [*cmd, "--log-level", "warning"],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group, as a terminal's job
        )
    try:
        wait_ready(url, [launcher], log)
        pids = rank_pids(log)
        assert sorted(pids) == [0, 1], log.read_text()
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)

        chunks = client.completions.create(
            model="any",
            prompt=PROMPT,
            max_tokens=TOKENS,
            stop=[stop],
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = list(chunks)
        assert "".join(c.choices[0].text for c in chunks[:-1]) == cut
        assert chunks[-2].choices[0].finish_reason == "stop"
        assert chunks[-1].usage.completion_tokens == at + 1  # as one process counts

        # After a reply that stopped early on every rank, the next is still bit-exact.
        r = client.completions.create(model="any", prompt=PROMPT, max_tokens=TOKENS)
        assert r.choices[0].text == single.text
        assert r.choices[0].finish_reason == "length"
        assert r.usage.completion_tokens == len(single.tokens) == TOKENS
        # Every rank samples with the request's seed: the tokens of one process.
        r = client.completions.create(
            model="any", prompt=PROMPT, max_tokens=TOKENS, temperature=1.0, seed=SEED
        )
        assert r.choices[0].text == sampled.text

        with urllib.request.urlopen(f"{url}/v1/stats", timeout=30) as resp:
            stats = json.loads(resp.read())
        ranks = stats["cache"]["ranks"]
        assert [r["layers"] for r in ranks] == [[2, 4], [0, 2]]
        assert all(r["bytes_read"] > 0 and r["misses"] > 0 for r in ranks)
        for key in ("hits", "misses", "bytes_read", "evictions"):
            assert stats["cache"][key] == sum(r[key] for r in ranks), key
        assert stats["server"]["completed"] == 3

        os.killpg(launcher.pid, signal.SIGINT)  # Ctrl-C: every local rank and the launcher
        stopped = time.monotonic()
        launcher.wait(timeout=60)
        while not all(gone(p) for p in pids.values()):
            assert time.monotonic() - stopped < 60, f"ranks left: {pids}"
            time.sleep(0.2)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(launcher.pid, signal.SIGKILL)
        launcher.wait()
    # Rank 1 ignores SIGINT and exits 0 on rank 0's "stop" (the launcher warns of a rank
    # that ends otherwise).
    assert "Node with rank 1" not in log.read_text(), log.read_text()


def test_killed_follower_ends_rank_0_with_an_error(store, tmp_path):
    """Ranks started as mlx.launch starts them, without the launcher (which would stop
    rank 0 itself); rank 1 is killed while rank 0 waits for requests."""
    base, port = free_ports(2), free_port()
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(json.dumps([[f"127.0.0.1:{base}"], [f"127.0.0.1:{base + 1}"]]))
    logs = [tmp_path / f"rank{r}.log" for r in (0, 1)]
    procs = []
    for r in (0, 1):
        with logs[r].open("w") as out:
            procs.append(
                subprocess.Popen(
                    [*serve_argv(store), "--port", str(port), "--log-level", "warning"],
                    env=os.environ | {"MLX_RANK": str(r), "MLX_HOSTFILE": str(hostfile)},
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                )
            )
    try:
        wait_ready(f"http://127.0.0.1:{port}", procs, logs[0])
        procs[1].send_signal(signal.SIGKILL)
        # Noticed at the next idle round (every 2 s): an error from MLX, or at worst the
        # round's bound (engine.serve.pipeline.STEP_TIMEOUT_S, 60 s).
        assert procs[0].wait(timeout=90) == 2
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert "expertstream: error: rank 0: " in logs[0].read_text()
