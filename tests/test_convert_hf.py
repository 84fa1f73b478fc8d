"""convert() goes through each family's own `sanitize`: Hugging Face checkpoint layouts.

Each case writes an mlx-lm model directory, rewrites its experts the way the family's
Hugging Face checkpoints hold them (per-expert tensors, fused gate/up, gpt-oss's
interleaved mxfp4 blocks under a `quantization_config`), and converts both directories:
the stores must hold the same records and dense weights, and the one from the Hugging
Face layout streams bit-exact against mlx-lm loading that same directory.
"""

import json

import mlx.core as mx
import pytest
from mlx_lm.utils import load_model

from engine.config import StreamConfig
from engine.convert import convert
from engine.model import load
from engine.store import ExpertStore

from factories import make_family_model, unstack_experts
from moe_families import FAMILIES
from test_equality import assert_same, greedy_logits

PROMPT = [3, 17, 42, 5, 9, 33, 21, 60]


def per_expert(weights, config):
    """qwen3_moe: `mlp.experts.<e>.<proj>.weight`, one tensor per expert."""
    return unstack_experts(weights, "qwen3_moe"), config


def _fuse(weights, blocks, gate_up, down):
    """Each (stacked-experts prefix, checkpoint prefix) of `blocks`: gate and up
    concatenated into `<checkpoint prefix>.<gate_up>`, down as `<checkpoint prefix>.<down>`."""
    out = {k: v for k, v in weights.items() if not any(k.startswith(f"{m}.") for m, _ in blocks)}
    for mine, theirs in blocks:
        gate, up = (weights[f"{mine}.{n}.weight"] for n in ("gate_proj", "up_proj"))
        out[f"{theirs}.{gate_up}"] = mx.concatenate([gate, up], axis=1)
        out[f"{theirs}.{down}"] = weights[f"{mine}.down_proj.weight"]
    return out


def granite_fused(weights, config):
    """granitemoe: gate and up fused in `input_linear`, down in `output_linear`."""
    layers = range(config["num_hidden_layers"])
    prefixes = [f"model.layers.{i}.block_sparse_moe" for i in layers]
    blocks = [(f"{p}.switch_mlp", p) for p in prefixes]
    return _fuse(weights, blocks, "input_linear.weight", "output_linear.weight"), config


def gemma4_fused(weights, config):
    """gemma4: `model.language_model.layers.<n>.experts.gate_up_proj` and `.down_proj`."""
    layers = range(config["text_config"]["num_hidden_layers"])
    blocks = [
        (
            f"language_model.model.layers.{i}.experts.switch_glu",
            f"model.language_model.layers.{i}.experts",
        )
        for i in layers
    ]
    return _fuse(weights, blocks, "gate_up_proj", "down_proj"), config


def _interleave(a, b):
    """Rows of `a` and `b` alternating on axis 1 (gate, up, gate, up, ...)."""
    return mx.stack([a, b], axis=2).reshape(a.shape[0], -1, *a.shape[2:])


def _blocks(q):
    """mxfp4 weight as uint32 (E, out, in/8) -> OpenAI's uint8 blocks (E, out, in/32, 16)."""
    return q.view(mx.uint8).reshape(*q.shape[:2], -1, 16)


def gpt_oss_mxfp4(weights, config):
    """gpt-oss as OpenAI ships it: mxfp4 `*_blocks` / `*_scales` with gate and up rows
    interleaved in `gate_up_proj`, biases beside them, and a `quantization_config`."""
    out = {k: v for k, v in weights.items() if ".experts." not in k}
    for layer in range(config["num_hidden_layers"]):
        p = f"model.layers.{layer}.mlp.experts"
        gate, up, down = (
            {k: weights[f"{p}.{proj}.{k}"] for k in ("weight", "scales", "bias")}
            for proj in ("gate_proj", "up_proj", "down_proj")
        )
        out[f"{p}.gate_up_proj_blocks"] = _interleave(
            _blocks(gate["weight"]), _blocks(up["weight"])
        )
        out[f"{p}.gate_up_proj_scales"] = _interleave(gate["scales"], up["scales"])
        out[f"{p}.gate_up_proj_bias"] = _interleave(gate["bias"], up["bias"])
        out[f"{p}.down_proj_blocks"] = _blocks(down["weight"])
        out[f"{p}.down_proj_scales"] = down["scales"]
        out[f"{p}.down_proj_bias"] = down["bias"]
    config = {k: v for k, v in config.items() if k != "quantization"}
    return out, config | {"quantization_config": {"quant_method": "mxfp4"}}


def experts_only(mode):
    return {"mode": mode, "group_size": None, "bits": None, "quant_predicate": _experts}


def _experts(path, module):
    return ".experts." in f"{path}."


CASES = {
    "qwen3_moe": (per_expert, None),
    "granitemoe": (granite_fused, None),
    "gemma4": (gemma4_fused, None),
    "gpt_oss": (gpt_oss_mxfp4, experts_only("mxfp4")),
}


@pytest.mark.parametrize("model_type", sorted(CASES))
def test_hf_layout_converts_through_sanitize(tmp_path, model_type):
    to_hf, quantization = CASES[model_type]
    mlx_dir = make_family_model(tmp_path / "mlx", FAMILIES[model_type], quantization=quantization)
    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    config = json.loads((mlx_dir / "config.json").read_text())
    weights, config = to_hf(dict(mx.load(str(mlx_dir / "model.safetensors"))), config)
    assert weights.keys() != dict(mx.load(str(mlx_dir / "model.safetensors"))).keys()
    mx.save_safetensors(str(hf_dir / "model.safetensors"), weights)
    (hf_dir / "config.json").write_text(json.dumps(config))

    want = ExpertStore(convert(mlx_dir, tmp_path / "s-mlx"))
    got = ExpertStore(convert(hf_dir, tmp_path / "s-hf"))
    for a, b in zip(want.manifest.layers, got.manifest.layers, strict=True):
        assert (a.module, a.segments, a.quantization, a.checksums) == (
            b.module,
            b.segments,
            b.quantization,
            b.checksums,
        )
    dense_want, dense_got = want.dense_weights(), got.dense_weights()
    assert dense_want.keys() == dense_got.keys()
    assert all(mx.array_equal(dense_want[k], dense_got[k]).item() for k in dense_want)

    resident = greedy_logits(load_model(hf_dir)[0], PROMPT, 3)
    sm = load(got.path, StreamConfig(expert_slots=2))
    assert_same(resident, greedy_logits(sm.model, PROMPT, 3))
