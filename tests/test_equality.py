"""The streamed model gives the resident model's tokens and logits, bit for bit.

The yardstick of the engine: same model, same prompt, greedy decoding; every step's
logits must be identical (np.array_equal) at every capacity and in every prefetch mode.
"""

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import load_model

from engine.config import StreamConfig
from engine.model import load

from factories import MODEL_TYPES

PROMPT = [3, 17, 42, 5, 99, 64, 1, 8, 23, 77, 12, 50]
DECODE_STEPS = 32


def greedy_logits(model, prompt=PROMPT, steps=DECODE_STEPS):
    """Prefill logits, then (steps) decode logits, as numpy arrays, and the tokens."""
    cache = make_prompt_cache(model)
    logits = model(mx.array([prompt]), cache=cache)[:, -1]
    out, tokens = [np.array(logits)], []
    for _ in range(steps):
        token = mx.argmax(logits, axis=-1)
        tokens.append(int(token.item()))
        logits = model(token[:, None], cache=cache)[:, -1]
        out.append(np.array(logits))
    return out, tokens


def assert_same(resident, streamed):
    (ref_logits, ref_tokens), (got_logits, got_tokens) = resident, streamed
    assert got_tokens == ref_tokens
    for step, (a, b) in enumerate(zip(ref_logits, got_logits, strict=True)):
        assert np.array_equal(a, b), f"logits differ at step {step}"


@pytest.fixture(scope="module")
def resident(model_dirs):
    cached = {}

    def get(model_type, **options):
        key = (model_type, tuple(sorted(options.items())))
        if key not in cached:
            # mlx-lm itself refuses a stray quantized lm_head (it drops only
            # lm_head.weight), so the reference loads that one case non-strictly.
            strict = not options.get("stray_lm_head", False)
            model, _ = load_model(model_dirs(model_type, **options), strict=strict)
            cached[key] = greedy_logits(model)
        return cached[key]

    return get


# expert_slots: 1, top-k, a quarter, all (8 experts, top-2 -> 1, 2, 2, 8) plus 3 and 5
# for capacities that are neither.
@pytest.mark.parametrize("model_type", MODEL_TYPES)
@pytest.mark.parametrize("slots", [1, 2, 3, 5, 8])
def test_streamed_equals_resident(model_dirs, resident, model_type, slots):
    sm = load(model_dirs(model_type), StreamConfig(expert_slots=slots))
    assert_same(resident(model_type), greedy_logits(sm.model))
    assert sm.cache.check() == ""


@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral"])
@pytest.mark.parametrize("slots", [1, 2, 8])
@pytest.mark.parametrize("side_lfu", [True, False])
@pytest.mark.parametrize("sync", [True, False])
@pytest.mark.parametrize("spec", [1, 6])
def test_prefetch_modes_equal_resident(
    model_dirs, resident, model_type, slots, side_lfu, sync, spec
):
    cfg = StreamConfig(
        expert_slots=slots,
        side_slots=spec,
        prefetch=True,
        side_lfu=side_lfu,
        sync=sync,
        ahead_lo=1,
        ahead_hi=2,
        cutoff=2,
    )
    sm = load(model_dirs(model_type), cfg)
    assert_same(resident(model_type), greedy_logits(sm.model))
    sm.cache.drain()
    assert sm.cache.check() == ""
    totals = sm.snapshot().totals()
    if slots < 8:  # with every expert cacheable the predictor finds all of them resident
        assert totals["prefetch_issued"] > 0
    assert totals["inflight"] == 0


@pytest.mark.parametrize("sync", [True, False])
def test_prefetch_riding_on_acquire_equals_resident(model_dirs, resident, sync):
    """The GPU arrangement run on the CPU: primitives on the CPU stream, and each prefetch
    scalar an input of its layer's acquire there instead of an mx.depends of the layer's
    output."""
    cfg = StreamConfig(expert_slots=2, side_slots=2, prefetch=True, sync=sync, cutoff=2)
    sm = load(model_dirs("qwen3_moe"), cfg)
    sm.predictor.cpu_stream = True
    assert_same(resident("qwen3_moe"), greedy_logits(sm.model))
    sm.cache.drain()
    assert sm.cache.check() == ""
    totals = sm.snapshot().totals()
    assert totals["prefetch_issued"] > 0 and totals["prefetch_used"] > 0


def test_dense_layers_and_expert_bias(model_dirs, resident):
    """MoE index != decoder index (mlp_only_layers) and olmoe experts with bias."""
    for model_type, options in [
        ("qwen3_moe", {"mlp_only_layers": (0, 2)}),
        ("olmoe", {"expert_bias": True}),
        ("qwen3_moe", {"tie_word_embeddings": True, "stray_lm_head": True}),
        ("mixtral", {"quantized": False}),
    ]:
        sm = load(
            model_dirs(model_type, **options),
            StreamConfig(expert_slots=2, side_slots=2, prefetch=True),
        )
        assert_same(resident(model_type, **options), greedy_logits(sm.model))


@pytest.mark.parametrize("layer_scratch", [False, True], ids=["streamed", "layer scratch"])
def test_long_prefill_reads_each_expert_once_and_keeps_working_set(model_dirs, layer_scratch):
    """An over-capacity prefill streams each missing expert once per layer through the
    scratch rows and leaves the real region's pinned working set in place."""
    sm = load(model_dirs("qwen3_moe"), StreamConfig(expert_slots=3, scratch_slots=2))
    sm.predictor.layer_scratch = layer_scratch
    for li in range(sm.cache.num_layers):
        sm.cache.pin(li, 0)
    prompt = list(range(1, 100))
    model, _ = load_model(model_dirs("qwen3_moe"))
    want = np.array(model(mx.array([prompt])))
    got = np.array(sm.model(mx.array([prompt])))
    assert np.array_equal(want, got)
    snap = sm.snapshot()
    assert (snap.stats["overcap_calls"] == 1).all()
    # 8 experts, at most 3 resident (expert 0 pinned): every other expert read once.
    assert (snap.stats["loads"] <= 8).all()
    assert all(0 in row for row in snap.slot_expert)
