"""Every supported mlx-lm MoE family, streamed, gives mlx-lm's own tokens and logits.

One test per model_type of `moe_families.FAMILIES`: a tiny random model of that family is
written by mlx-lm's own save functions, converted and loaded through the real path, and
compared step by step (np.array_equal) with mlx-lm's resident model: 4-bit and float32,
expert_slots 1, top-k, half and all, every expert with the prompt computed expert-major,
then once more with prefetch on. The prompt is long
enough (64 routed pairs) for SwitchGLU's sorted gather and the over-capacity path.
"""

import gc
import re
import weakref
from pathlib import Path

import numpy as np
import pytest
from mlx_lm.utils import load_model

from engine.config import StreamConfig
from engine.experts import UNSUPPORTED, find_experts, instantiate, router_logits, top_k
from engine.model import load

from factories import make_family_model
from moe_families import FAMILIES
from test_equality import assert_same, greedy_logits

PROMPT = [int(t) for t in np.random.default_rng(0).integers(1, 64, 32)]
STEPS = 3
Q4 = {"group_size": 32, "bits": 4}


def greedy(model):
    return greedy_logits(model, PROMPT, STEPS)


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_family_streams_bit_exact(tmp_path, model_type):
    config = FAMILIES[model_type]
    model = instantiate(config, model_type)
    experts = find_experts(model)
    num_experts = experts[0].num_experts
    k = top_k(config, num_experts, model_type)
    assert len(experts) >= 2, "prefetch needs a second MoE layer to target"
    assert all(router_logits(model, e) is not None for e in experts), "predictor finds no router"
    resident = {}
    for quantization in (Q4, None):
        name = "q4" if quantization else "f32"
        model_dir = make_family_model(tmp_path / name, config, quantization=quantization)
        resident[name] = greedy(load_model(model_dir)[0])
        for slots in sorted({1, k, num_experts // 2, num_experts}):
            sm = load(model_dir, StreamConfig(expert_slots=slots))
            assert_same(resident[name], greedy(sm.model))
            assert sm.cache.check() == ""
        # The prompt's calls computed expert-major (the table path, every expert cached).
        sm = load(model_dir, StreamConfig(expert_major="on"))
        assert_same(resident[name], greedy(sm.model))
        assert set(sm.compute.same_bits.values()) == {True}
    cfg = StreamConfig(expert_slots=1, side_slots=2, prefetch=True, ahead_lo=1, ahead_hi=1)
    sm = load(tmp_path / "q4", cfg)
    assert_same(resident["q4"], greedy(sm.model))
    sm.cache.drain()
    assert sm.cache.check() == ""
    assert sm.snapshot().totals()["prefetch_issued"] > 0


def test_a_dropped_model_is_freed_without_the_garbage_collector(tmp_path):
    """No reference cycle through the streamed layers or the predictor's routers: the
    model, and with it the pools, go with the last reference, not at the next gc run."""
    model_dir = make_family_model(tmp_path / "m", FAMILIES["gemma4"], quantization=Q4)
    sm = load(model_dir, StreamConfig(expert_slots=1, side_slots=2, prefetch=True))
    greedy(sm.model)
    model, predictor = weakref.ref(sm.model), weakref.ref(sm.predictor)
    gc.disable()
    try:
        del sm
        assert model() is None and predictor() is None
    finally:
        gc.enable()


def test_models_page_lists_the_tested_families():
    """docs/models.md's supported and unsupported model types are exactly the tested ones
    and engine.experts.UNSUPPORTED."""
    readme = (Path(__file__).parents[1] / "docs" / "models.md").read_text()

    def paragraph(heading):
        return readme.split(heading, 1)[1].split("\n\n", 2)[1]

    supported = re.findall(r"`([A-Za-z0-9_]+)`", paragraph("Supported model types"))
    assert sorted(supported) == sorted(FAMILIES)
    refused = re.findall(r"^- `([A-Za-z0-9_]+)`", paragraph("Not supported"), re.M)
    assert sorted(refused) == sorted(UNSUPPORTED)
