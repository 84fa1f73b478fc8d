"""The server's answers to clients that push at its edges (issue 26's defects), each found
by trying it as a hostile client would, on a loopback port."""

import pytest

from engine.config import StreamConfig
from engine.generate import generate, prompt_tokens
from engine.model import load

from test_server import PROMPT, Served


@pytest.fixture(scope="module")
def served():
    s = Served()
    yield s
    s.close()


@pytest.mark.parametrize("temperature", [1e-45, 1e-300, 5e-324, 1e-38])
def test_tiny_temperatures_are_greedy(temperature):
    """mlx-lm scales log-probabilities by 1 / temperature: past float32's range every one
    became -inf and the tokens were garbage (1e-45), where 1e-38 still gave the greedy
    text (`generate --temp` and the server both sample through engine.generate)."""
    sm = load(None, StreamConfig(expert_slots=8))
    ids = prompt_tokens(sm, PROMPT, chat=False)
    greedy = generate(sm, ids, 12)
    assert greedy.text.startswith(" time, there was")
    assert generate(sm, ids, 12, temperature=temperature).tokens == greedy.tokens


def test_tiny_temperature_over_http(served):
    client = served.client(max_retries=0)
    greedy = client.completions.create(model="m", prompt=PROMPT, max_tokens=10)
    tiny = client.completions.create(model="m", prompt=PROMPT, max_tokens=10, temperature=1e-45)
    assert tiny.choices[0].text == greedy.choices[0].text
