"""Shared fixtures: small real models and their stores, built once per session."""

import os

import pytest

from engine.convert import convert
from engine.store import ExpertStore

from factories import make_random_model
from tool_model import make_tool_model

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")


@pytest.fixture(scope="session", autouse=True)
def _store_cache(tmp_path_factory):
    """Converted stores of model directories go to a temporary cache, not ~/.cache."""
    os.environ["EXPERTSTREAM_CACHE"] = str(tmp_path_factory.mktemp("store-cache"))


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory):
    """A function (model_type, **options) -> mlx-lm model dir, memoised per session."""
    made = {}

    def get(model_type: str, **options):
        key = (model_type, tuple(sorted(options.items())))
        if key not in made:
            out = tmp_path_factory.mktemp(model_type) / "model"
            made[key] = make_random_model(out, model_type, **options)
        return made[key]

    return get


@pytest.fixture(params=[True, False], ids=["io_uring", "threads"])
def io_uring(request) -> bool:
    """StreamConfig.io_uring for a test of the demand read path, run both ways: through
    io_uring (where the kernel has it) and through the reader threads (the fallback)."""
    return request.param


@pytest.fixture(scope="session")
def qwen_store(model_dirs, tmp_path_factory):
    """ExpertStore of a 4-layer, 8-expert, top-2 quantized qwen3_moe model."""
    dest = tmp_path_factory.mktemp("stores") / "qwen3"
    return ExpertStore(convert(model_dirs("qwen3_moe"), dest))


@pytest.fixture(scope="module")
def served():
    """`test_server.Served`: the server on the embedded model, on a free loopback port,
    one per test module."""
    from test_server import Served

    s = Served()
    yield s
    s.close()


@pytest.fixture(scope="module")
def tool_served(tool_model):
    """`test_server.Served` on the tool-calling model (`tool_model`), with a prompt cache
    of 64 MiB, one per test module."""
    from test_server import Served

    s = Served(model=tool_model, prompt_cache_bytes=64 << 20)
    yield s
    s.close()


@pytest.fixture(scope="session")
def tool_model(tmp_path_factory):
    """A tiny model that calls a tool (tests/tool_model.py)."""
    return make_tool_model(tmp_path_factory.mktemp("tool-model") / "model")
