"""Expert stores in every MLX quantization mode, and dtypes the CPU backend cannot multiply.

mxfp4 (what gpt-oss ships), mxfp8 and nvfp4 pack the experts with uint8 scales and no
biases; their stores load and stream bit-exact, a long prompt's calls expert-major too.
Unquantized bfloat16 experts and nvfp4 global scales have no CPU kernel (mlx-lm's own
model fails inside the first MoE layer): load refuses them first, with a message that
says what to do.
"""

import mlx.core as mx
import pytest
from mlx_lm.utils import load_model

from engine.config import StreamConfig
from engine.convert import convert
from engine.model import load
from engine.store import ExpertStore

from factories import make_family_model
from moe_families import FAMILIES
from test_equality import assert_same, greedy_logits

# The repro: a 2-layer qwen3_moe, hidden 64, expert width 64, 8 experts, top-2.
CONFIG = FAMILIES["qwen3_moe"] | {"moe_intermediate_size": 64}
PROMPT = [3, 17, 42, 5, 9, 33, 21, 60]
ON_CPU = mx.default_device() == mx.cpu


def quantized(mode, **extra):
    return {"mode": mode, "group_size": None, "bits": None} | extra


@pytest.mark.parametrize(
    ("mode", "group_size", "bits"), [("mxfp4", 32, 4), ("mxfp8", 32, 8), ("nvfp4", 16, 4)]
)
def test_fp_modes_load_and_stream_bit_exact(tmp_path, mode, group_size, bits):
    model_dir = make_family_model(tmp_path / "m", CONFIG, quantization=quantized(mode))
    store = ExpertStore(convert(model_dir, tmp_path / "s"))
    spec = store.manifest.layers[0]
    want = {"group_size": group_size, "bits": bits, "mode": mode}
    assert spec.quantization == dict.fromkeys(("gate_proj", "up_proj", "down_proj"), want)
    segments = {s.key: s for s in spec.segments}
    assert segments["gate_proj.scales"].dtype == "uint8"
    assert not any(key.endswith(".biases") for key in segments)
    resident = greedy_logits(load_model(model_dir)[0], PROMPT, 4)
    for slots in (1, 2, 8):
        sm = load(store.path, StreamConfig(expert_slots=slots))
        assert_same(resident, greedy_logits(sm.model, PROMPT, 4))
    # A prompt long enough to be computed expert-major (4 pairs per expert).
    long = PROMPT * 2
    sm = load(store.path, StreamConfig(expert_major="on"))
    assert_same(greedy_logits(load_model(model_dir)[0], long, 2), greedy_logits(sm.model, long, 2))
    assert set(sm.compute.same_bits.values()) == {True}


def test_nvfp4_global_scales_are_streamed(tmp_path):
    """One float32 tensor scale per expert and projection is a segment of the record."""
    q = quantized("nvfp4", global_scale=True)
    model_dir = make_family_model(tmp_path / "m", CONFIG, quantization=q)
    store = ExpertStore(convert(model_dir, tmp_path / "s"))
    segments = {s.key: s for s in store.manifest.layers[1].segments}
    for proj in ("gate_proj", "up_proj", "down_proj"):
        assert (segments[f"{proj}.global_scale"].dtype, segments[f"{proj}.global_scale"].shape) == (
            "float32",
            (),
        )
    resident, _ = load_model(model_dir)
    if ON_CPU:
        with pytest.raises(ValueError, match="Global scale is only supported on the GPU"):
            mx.eval(resident(mx.array([PROMPT])))
        with pytest.raises(ValueError, match=r"global_scale: .*nvfp4 .*only on the GPU"):
            load(store.path, StreamConfig(expert_slots=2))
    else:
        sm = load(store.path, StreamConfig(expert_slots=2))
        assert_same(greedy_logits(resident, PROMPT, 4), greedy_logits(sm.model, PROMPT, 4))


@pytest.mark.skipif(not ON_CPU, reason="the CPU backend's gather_mm is float32 only")
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
def test_half_precision_experts_on_cpu_refused_before_any_work(tmp_path, dtype):
    model_dir = make_family_model(tmp_path / "m", CONFIG, dtype=dtype)
    resident, _ = load_model(model_dir)
    with pytest.raises(RuntimeError, match="only supports float32"):
        mx.eval(resident(mx.array([PROMPT])))
    name = "bfloat16" if dtype == mx.bfloat16 else "float16"
    with pytest.raises(ValueError, match=rf"unquantized {name}.*CPU.*--dtype float32.*-q") as e:
        load(model_dir, StreamConfig(expert_slots=2))
    assert "model.layers.0.mlp.switch_mlp.gate_proj.weight" in str(e.value)
