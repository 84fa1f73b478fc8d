"""Small random mlx-lm MoE models on disk, built with mlx-lm's own classes.

`make_random_model` writes a directory exactly as `mlx_lm.convert` does
(`model.safetensors`, its index, `config.json`); `mlx_lm.utils.load_model`
loads it. No tokenizer: tests feed token ids, or add a word-level one with
`write_tokenizer`.
"""

import contextlib
import io
import json
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.utils import _get_classes, load_model, quantize_model, save_config, save_model
from tokenizers import Tokenizer, models, pre_tokenizers

MODEL_TYPES = ("qwen3_moe", "qwen2_moe", "mixtral", "olmoe")
GROUP_SIZE = 32
BITS = 4

# mixtral's checkpoint names for gate/down/up.
_MIXTRAL_NAMES = {"gate_proj": "w1", "down_proj": "w2", "up_proj": "w3"}


# A role-tagged template over plain words of the `write_tokenizer` vocabulary.
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m.role | upper }} {{ m.content }} END {% endfor %}"
    "{% if add_generation_prompt %}ASSISTANT{% endif %}"
)


def write_tokenizer(directory: str | Path, chat_template: str | None = None) -> None:
    """A word-level tokenizer of 128 words (the test models' vocabulary): "[UNK]", "The",
    "cat", "sat", "on", "mat", "SYSTEM", "USER", "ASSISTANT", "END", then "w10".."w127";
    split on whitespace, decoded with spaces between words. `chat_template` (a Jinja
    template, e.g. CHAT_TEMPLATE) goes into tokenizer_config.json."""
    words = ["[UNK]", "The", "cat", "sat", "on", "mat", "SYSTEM", "USER", "ASSISTANT", "END"]
    vocab = {w: i for i, w in enumerate(words + [f"w{i}" for i in range(len(words), 128)])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(Path(directory) / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast"}
    if chat_template:
        config["chat_template"] = chat_template
    (Path(directory) / "tokenizer_config.json").write_text(json.dumps(config))


def make_config(
    model_type: str,
    *,
    num_layers: int = 4,
    num_experts: int = 8,
    top_k: int = 2,
    hidden: int = 64,
    moe_intermediate: int = 32,
    vocab: int = 128,
    mlp_only_layers: tuple[int, ...] = (),
    tie_word_embeddings: bool = False,
    expert_bias: bool = False,
) -> dict:
    """A valid `config.json` dict for a tiny model of `model_type`.

    Raises:
        ValueError: unknown `model_type`, or an option the type cannot express
            (`mlp_only_layers` is qwen3_moe only, `expert_bias` olmoe only).
    """
    if model_type not in MODEL_TYPES:
        raise ValueError(f"model_type {model_type!r} not in {MODEL_TYPES}")
    if mlp_only_layers and model_type != "qwen3_moe":
        raise ValueError("mlp_only_layers needs qwen3_moe")
    if expert_bias and model_type != "olmoe":
        raise ValueError("expert_bias needs olmoe")
    config = {
        "model_type": model_type,
        "hidden_size": hidden,
        "num_hidden_layers": num_layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-6,
        "vocab_size": vocab,
        "rope_theta": 10000.0,
        "max_position_embeddings": 512,
        "tie_word_embeddings": tie_word_embeddings,
        "num_experts_per_tok": top_k,
    }
    if model_type == "qwen3_moe":
        config |= {
            "num_experts": num_experts,
            "moe_intermediate_size": moe_intermediate,
            "intermediate_size": 2 * moe_intermediate,
            "head_dim": hidden // 4,
            "decoder_sparse_step": 1,
            "mlp_only_layers": list(mlp_only_layers),
            "norm_topk_prob": True,
        }
    elif model_type == "qwen2_moe":
        config |= {
            "num_experts": num_experts,
            "moe_intermediate_size": moe_intermediate,
            "intermediate_size": 2 * moe_intermediate,
            "shared_expert_intermediate_size": 2 * moe_intermediate,
        }
    elif model_type == "mixtral":
        config |= {
            "num_local_experts": num_experts,
            "intermediate_size": moe_intermediate,
        }
    else:
        config |= {
            "num_experts": num_experts,
            "intermediate_size": moe_intermediate,
            "mlp_bias": expert_bias,
            "norm_topk_prob": False,
        }
    return config


def make_random_model(
    out_dir: str | Path,
    model_type: str,
    *,
    quantized: bool = True,
    num_layers: int = 4,
    num_experts: int = 8,
    top_k: int = 2,
    hidden: int = 64,
    moe_intermediate: int = 32,
    vocab: int = 128,
    seed: int = 0,
    mlp_only_layers: tuple[int, ...] = (),
    tie_word_embeddings: bool = False,
    stray_lm_head: bool = False,
    expert_bias: bool = False,
    unstacked_experts: bool = False,
) -> Path:
    """Write a random float32 mlx-lm MoE model directory.

    Weights are normal with a fixed `seed` (norm weights ~1, routers and
    embeddings std 0.1, other weights 0.05, biases 0.02), so logits and routing
    are not degenerate. Quantized models use 4 bits, group size 32 (`hidden`
    and `moe_intermediate` must be multiples of 32; qwen3_moe's 8-bit router
    needs `hidden` a multiple of 64).

    Args:
        out_dir: directory to create (parents too).
        stray_lm_head: add an unused `lm_head.*` (quantized like the rest) to
            a tied model, as some broken checkpoints have. Strict
            `load_model` rejects such a directory; `convert` must drop it.
        unstacked_experts: save experts per expert
            (`...experts.<e>.<proj>.weight`) as Hugging Face checkpoints do,
            for `sanitize` to stack (unquantized, no expert bias).

    Returns:
        `out_dir` as a `Path`.

    Raises:
        ValueError: impossible option combinations (see `make_config`).
    """
    out_dir = Path(out_dir)
    config = make_config(
        model_type,
        num_layers=num_layers,
        num_experts=num_experts,
        top_k=top_k,
        hidden=hidden,
        moe_intermediate=moe_intermediate,
        vocab=vocab,
        mlp_only_layers=mlp_only_layers,
        tie_word_embeddings=tie_word_embeddings,
        expert_bias=expert_bias,
    )
    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    if stray_lm_head and "lm_head" in model:
        raise ValueError(f"stray_lm_head needs a tied {model_type} model")
    if unstacked_experts and (quantized or expert_bias):
        raise ValueError("unstacked_experts needs an unquantized model without bias")

    params = tree_flatten(model.parameters())
    keys = mx.random.split(mx.random.key(seed), len(params) + 1)
    inits = [(n, _init(n, p.shape, k)) for (n, p), k in zip(params, keys[:-1], strict=True)]
    model.update(tree_unflatten(inits))
    mx.eval(model.parameters())

    if quantized:
        with contextlib.redirect_stdout(io.StringIO()):
            model, config = quantize_model(model, config, GROUP_SIZE, BITS)
    save_model(out_dir, model)
    save_config(config, out_dir / "config.json")

    if stray_lm_head or unstacked_experts:
        weights = dict(mx.load(str(out_dir / "model.safetensors")))
        if stray_lm_head:
            w = 0.05 * mx.random.normal((vocab, hidden), key=keys[-1])
            if quantized:
                wq, scales, biases = mx.quantize(w, GROUP_SIZE, BITS)
                weights |= {
                    "lm_head.weight": wq,
                    "lm_head.scales": scales,
                    "lm_head.biases": biases,
                }
            else:
                weights["lm_head.weight"] = w
        if unstacked_experts:
            weights = unstack_experts(weights, model_type)
        _rewrite_weights(out_dir, weights)
    return out_dir


def _init(name: str, shape: tuple[int, ...], key: mx.array) -> mx.array:
    x = mx.random.normal(shape, key=key)
    leaf = name.rsplit(".", 2)
    if leaf[-2].endswith("norm"):
        return 1.0 + 0.05 * x
    if leaf[-1] == "bias":
        return 0.02 * x
    if leaf[-2] in ("gate", "embed_tokens"):
        return 0.1 * x
    return 0.05 * x


def unstack_experts(weights: dict, model_type: str) -> dict:
    """Stacked `...switch_mlp.<proj>.<param>` weights as Hugging Face checkpoints hold
    them: `...experts.<e>.<proj>.<param>` per expert (mixtral: w1/w2/w3)."""
    out = {}
    for key, value in weights.items():
        if ".switch_mlp." not in key:
            out[key] = value
            continue
        block, rest = key.split(".switch_mlp.")
        proj, param = rest.split(".")
        if model_type == "mixtral":
            proj = _MIXTRAL_NAMES[proj]
        for e in range(value.shape[0]):
            out[f"{block}.experts.{e}.{proj}.{param}"] = value[e]
    return out


def _rewrite_weights(out_dir: Path, weights: dict) -> None:
    """Replace `model.safetensors` and its index with `weights`."""
    mx.save_safetensors(str(out_dir / "model.safetensors"), weights, metadata={"format": "mlx"})
    index_path = out_dir / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"] = {k: "model.safetensors" for k in sorted(weights)}
    index_path.write_text(json.dumps(index, indent=4))


def make_mixed_quant_model(out_dir: str | Path) -> Path:
    """A mixtral model quantized per projection, as mlx-lm's mixed recipes do: layer 1's
    `up_proj` at 8 bits / group 64, every other quantizable module at 4 bits / group 32."""
    out_dir = Path(out_dir)
    model, config = load_model(make_random_model(out_dir / "base", "mixtral", quantized=False))

    def predicate(path, module):
        if path.endswith("1.block_sparse_moe.switch_mlp.up_proj"):
            return {"group_size": 64, "bits": 8}
        return True

    model, config = quantize_model(model, config, GROUP_SIZE, BITS, quant_predicate=predicate)
    save_model(out_dir / "mixed", model)
    save_config(config, out_dir / "mixed" / "config.json")
    return out_dir / "mixed"


def make_family_model(
    out_dir: str | Path,
    config: dict,
    *,
    quantization: dict | None = None,
    dtype: mx.Dtype = mx.float32,
    seed: int = 0,
) -> Path:
    """Write a random mlx-lm model directory of any family's `config` (see moe_families).

    Initialised as `make_random_model` does, cast to `dtype`, then quantized (when
    `quantization` holds `quantize_model`'s keyword arguments: group_size, bits, mode,
    global_scale) and saved by mlx-lm's own `quantize_model`, `save_model` and
    `save_config`, so that convert and load go through the real path.
    """
    out_dir = Path(out_dir)
    config = dict(config)
    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    params = tree_flatten(model.parameters())
    keys = mx.random.split(mx.random.key(seed), len(params))
    inits = [
        (n, _init(n, p.shape, k).astype(dtype)) for (n, p), k in zip(params, keys, strict=True)
    ]
    model.update(tree_unflatten(inits))
    mx.eval(model.parameters())
    if quantization is not None:
        with contextlib.redirect_stdout(io.StringIO()):
            model, config = quantize_model(model, config, **quantization)
    save_model(out_dir, model)
    save_config(config, out_dir / "config.json")
    return out_dir
