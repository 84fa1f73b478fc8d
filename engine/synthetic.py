"""Synthetic expert stores: real shapes, random weights, written directly as a store.

`write_store(out, config)` writes `dense.safetensors`, one `layerNN.blob` per MoE layer,
`config.json` and `manifest.json` (through `engine.store_writer`, the format of
docs/store-format.md) for a `qwen3_moe` config, without ever holding more than one
expert record in memory: the dense weights come from mlx-lm's own model class (random
init, quantized by mlx-lm's `quantize_model` with the experts left out), each expert
record is random 4-bit codes with scales and biases that give the dequantized weights the
spread of a default `nn.Linear` init. There is no tokenizer: feed token ids.

Presets: `QWEN3_30B_A3B` (the public Qwen3-30B-A3B config.json: 48 layers, 128 experts,
top-8, hidden 2048, expert intermediate 768, 32 heads, 4 KV heads, head_dim 128, vocab
151936; 4-bit, group 64, float32 scales and biases: about 18 GB of experts) and
`tiny_config(...)` for tests and cache-policy replays.

    python -m engine.synthetic OUT_DIR [--preset qwen3-30b-a3b] [--seed 0]
"""

import argparse
import contextlib
import io
import json
import math
import sys
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm.utils import _get_classes, quantize_model

from engine.memory import human_bytes
from engine.safe_io import fsync_path
from engine.store import (
    CONFIG_FILE,
    VERSION,
    Segment,
    is_store,
    layout_segments,
    store_version,
    stride_for,
)
from engine.store_writer import StoreWriter
from engine.validate import DEFAULT_QUANT_MODE

# The public config.json of Qwen/Qwen3-30B-A3B (fields mlx-lm reads).
QWEN3_30B_A3B = {
    "model_type": "qwen3_moe",
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "moe_intermediate_size": 768,
    "num_hidden_layers": 48,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "norm_topk_prob": True,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "vocab_size": 151936,
    "max_position_embeddings": 40960,
    "tie_word_embeddings": False,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
}
PRESETS = {"qwen3-30b-a3b": QWEN3_30B_A3B}


def tiny_config(
    layers: int,
    num_experts: int,
    top_k: int,
    hidden: int = 64,
    moe_intermediate: int = 32,
    vocab: int = 256,
) -> dict:
    """A small qwen3_moe config (records of a few KB at 4 bits, group 32)."""
    return {
        "model_type": "qwen3_moe",
        "hidden_size": hidden,
        "intermediate_size": 2 * moe_intermediate,
        "moe_intermediate_size": moe_intermediate,
        "num_hidden_layers": layers,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": hidden // 2,
        "num_experts": num_experts,
        "num_experts_per_tok": top_k,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "norm_topk_prob": True,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "vocab_size": vocab,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
    }


def expert_segments(config: dict, group_size: int, bits: int) -> tuple[Segment, ...]:
    """The record layout of one expert: gate, up, down, each weight/scales/biases,
    packed as mlx's affine quantization packs them (uint32 codes, float32 scales)."""
    d, f = config["hidden_size"], config["moe_intermediate_size"]
    shapes = {"gate_proj": (f, d), "up_proj": (f, d), "down_proj": (d, f)}
    parts = []
    for proj, (rows, cols) in shapes.items():
        if cols % group_size or (cols * bits) % 32:
            raise ValueError(
                f"{proj}: input size {cols} is not a multiple of group size "
                f"{group_size} (and of 32 / bits)"
            )
        parts += [
            (f"{proj}.weight", "uint32", (rows, cols * bits // 32)),
            (f"{proj}.scales", "float32", (rows, cols // group_size)),
            (f"{proj}.biases", "float32", (rows, cols // group_size)),
        ]
    return layout_segments(parts)


def store_bytes(config: dict, group_size: int = 64, bits: int = 4) -> int:
    """Bytes of all blob files of the store `write_store` would write."""
    record = sum(s.nbytes for s in expert_segments(config, group_size, bits))
    return stride_for(record) * config["num_experts"] * config["num_hidden_layers"]


def _random_record(
    rng: np.random.Generator, segments, fan_in: dict, bits: int, out: np.ndarray
) -> None:
    """Fills `out` (uint8, record_bytes) with one random expert: uniform codes, scales so
    that the dequantized weights have std 1/sqrt(fan_in), biases centring the codes."""
    levels = 2**bits
    code_std = math.sqrt((levels**2 - 1) / 12)
    scales = None
    for s in segments:
        view = out[s.offset : s.offset + s.nbytes]
        proj, param = s.key.split(".")
        if param == "weight":
            view[:] = np.frombuffer(rng.bytes(s.nbytes), np.uint8)
        elif param == "scales":
            base = 1.0 / (math.sqrt(fan_in[proj]) * code_std)
            scales = (base * rng.uniform(0.8, 1.2, s.shape)).astype(np.float32)
            view[:] = scales.view(np.uint8).reshape(-1)
        else:
            view[:] = (-(levels - 1) / 2 * scales).astype(np.float32).view(np.uint8).reshape(-1)


def _dense_weights(config: dict, group_size: int, bits: int) -> tuple[dict, dict]:
    """mlx-lm's model of `config` without its experts, randomly initialised and quantized
    by mlx-lm. Returns (evaluated weights under sanitized names, quantized config)."""
    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    for layer in model.layers:
        if "switch_mlp" in layer.mlp:
            layer.mlp.switch_mlp = nn.Module()
    with contextlib.redirect_stdout(io.StringIO()):
        model, qconfig = quantize_model(model, config, group_size, bits)
    weights = dict(tree_flatten(model.parameters()))
    for v in weights.values():
        mx.eval(v)
    return weights, qconfig


def write_store(
    out: str | Path,
    config: dict,
    *,
    group_size: int = 64,
    bits: int = 4,
    seed: int = 0,
    progress: Callable[[int, int], None] | None = None,
    force: bool = False,
) -> Path:
    """Writes a synthetic expert store of the `qwen3_moe` config `config` to `out`.

    Memory stays bounded by the dense weights plus one record. The store is written in
    a sibling temporary directory and renamed into place when complete.

    Args:
        out: the store directory to create (must not exist, unless `force`: replaced).
        group_size, bits: affine quantization of every weight (routers: 8 bits, as
            mlx-lm's qwen3_moe quantizes them).
        progress: `progress(done_bytes, total_bytes)` while writing blobs.

    Returns:
        `out` as a Path.

    Raises:
        FileExistsError: `out` exists and not `force`.
        ValueError: the config is not qwen3_moe or the shapes do not fit the group size.
    """
    out = Path(out)
    if config.get("model_type") != "qwen3_moe":
        raise ValueError(f"synthetic stores are qwen3_moe, got {config.get('model_type')!r}")
    if out.exists() and not force:
        raise FileExistsError(f"{out} exists")
    segments = expert_segments(config, group_size, bits)
    record_bytes = sum(s.nbytes for s in segments)
    num_experts, layers = config["num_experts"], config["num_hidden_layers"]
    fan_in = {
        "gate_proj": config["hidden_size"],
        "up_proj": config["hidden_size"],
        "down_proj": config["moe_intermediate_size"],
    }
    quant = {"group_size": group_size, "bits": bits, "mode": DEFAULT_QUANT_MODE}
    rng = np.random.default_rng(seed)
    record = np.zeros(record_bytes, np.uint8)
    stride = stride_for(record_bytes)
    total = stride * num_experts * layers

    def records(li: int):
        """The layer's random records, one buffer at a time (reported as written)."""
        for e in range(num_experts):
            _random_record(rng, segments, fan_in, bits, record)
            yield (record,)
            if progress is not None:
                progress((li * num_experts + e + 1) * stride, total)

    with StoreWriter(out, num_experts) as writer:
        dense, qconfig = _dense_weights(config, group_size, bits)
        writer.write_dense(dense)
        del dense
        qconfig.pop("quantization_config", None)
        (writer.path / CONFIG_FILE).write_text(json.dumps(qconfig, indent=2) + "\n")
        fsync_path(writer.path / CONFIG_FILE)
        for li in range(layers):
            writer.write_layer(
                li,
                f"model.layers.{li}.mlp.switch_mlp",
                segments,
                {proj: dict(quant) for proj in fan_in},
                records(li),
            )
        return writer.finish("qwen3_moe", config["num_experts_per_tok"], layers, force)


def ensure_store(out: str | Path, config: dict, **kwargs) -> Path:
    """`out` if it already holds a complete store of this build's format version, else
    `write_store(out, config)`, replacing a store an older build made there (a cache
    kept across upgrades would otherwise be refused for its version)."""
    out = Path(out)
    if is_store(out) and store_version(out) == VERSION:
        return out
    return write_store(out, config, force=is_store(out), **kwargs)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m engine.synthetic",
        description="Write a synthetic expert store (random weights).",
    )
    p.add_argument("out", help="store directory to create")
    p.add_argument("--preset", choices=sorted(PRESETS), default="qwen3-30b-a3b")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    config = PRESETS[args.preset]
    print(f"writing {args.out}: {human_bytes(store_bytes(config))} of experts", file=sys.stderr)

    def progress(done, total):
        if done == total or done % (1 << 30) < store_bytes(config) // (
            config["num_hidden_layers"] * config["num_experts"]
        ):
            print(f"  {human_bytes(done)} / {human_bytes(total)}", file=sys.stderr)

    write_store(args.out, config, seed=args.seed, progress=progress)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
