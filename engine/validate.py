"""Checks of a model's `config.json` before any model is built from it.

mlx-lm's model classes trust their config: a size of the wrong type, zero or absurd ends
in a TypeError, a ZeroDivisionError, an assertion, an allocation of terabytes or a
million layers. `check_config` refuses such values by name (in the config and in the
text sub-config of multimodal wrappers); `check_against_weights` compares the config with
the tensors the safetensors headers say are present (the number of decoder layers, the
vocabulary, the hidden size), so nothing is built for layers or rows that have no
weights. `engine.experts.instantiate` then builds the model, and turns whatever mlx-lm
still raises into an error naming the file.
"""

import json
import math
import re

from engine.safe_io import ModelFileError
from engine.safetensors_header import TensorInfo

# Experts per MoE layer and decoder layers at most, in a config and in a store's manifest.
MAX_EXPERTS = 1 << 16
MAX_LAYERS = 1 << 12
# Quantization bits and group size: (lowest, highest), in a config and in a manifest.
QUANT_BITS = (1, 8)
QUANT_GROUP = (1, 4096)
# MLX's quantization modes (mx.quantize's `mode`); a config or manifest that names none
# means the first, mlx-lm's default.
QUANT_MODES = ("affine", "mxfp4", "mxfp8", "nvfp4")
DEFAULT_QUANT_MODE = QUANT_MODES[0]
# Integer fields of the supported families: (lowest, highest) allowed value. The highest
# are far above any published model (the largest vocabularies have ~260k entries).
INT_FIELDS = {
    "hidden_size": (1, 1 << 16),
    "num_hidden_layers": (1, MAX_LAYERS),
    "num_attention_heads": (1, 1 << 12),
    "num_key_value_heads": (1, 1 << 12),
    "head_dim": (1, 1 << 14),
    "intermediate_size": (1, 1 << 20),
    "moe_intermediate_size": (1, 1 << 20),
    "shared_expert_intermediate_size": (1, 1 << 20),
    "vocab_size": (1, 1 << 24),
    "num_experts": (0, MAX_EXPERTS),
    "num_local_experts": (0, MAX_EXPERTS),
    "num_experts_per_tok": (1, MAX_EXPERTS),
    "max_position_embeddings": (1, 1 << 31),
    "decoder_sparse_step": (1, 1 << 12),
}
# Fields that may also be null (mlx-lm then derives them).
NULLABLE = {"head_dim", "num_key_value_heads", "max_position_embeddings"}
# Float fields: (name, strictly positive?).
FLOAT_FIELDS = (("rope_theta", True), ("rms_norm_eps", False))
BOOL_FIELDS = ("tie_word_embeddings", "norm_topk_prob", "mlp_bias", "attention_bias")

# Sub-configs of multimodal wrappers that hold the language model's config.
SUB_CONFIGS = ("text_config", "language_config", "llm_config")
# A decoder layer's weights: "<prefix>layers.<n>." or "<prefix>h.<n>." (GPT-2 style).
_LAYER_KEY = re.compile(r"(?P<prefix>(?:.*\.)?)(?:layers|h)\.(?P<n>\d+)\.")


def show(value, limit: int = 60) -> str:
    """`value` as JSON, cut to `limit` characters (for messages about a file's field)."""
    try:
        text = json.dumps(value)
    except (TypeError, ValueError, RecursionError):
        text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def brief(error: BaseException | str, limit: int = 300) -> str:
    """An error (as "Type: message") or a text as one line of at most `limit` characters,
    for messages that quote another library's error (which may hold a whole file's
    content, or several lines)."""
    text = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def check_config(config, where: str, error: type[Exception] = ModelFileError) -> dict:
    """Refuses a config.json whose fields would crash or mislead mlx-lm's model classes.

    Args:
        config: the decoded JSON.
        where: the file, for messages.

    Returns:
        `config`, whose text sub-config (`SUB_CONFIGS`), if any, passed the same checks.

    Raises:
        error: naming `where` and the field: the top level is not an object; an
            `INT_FIELDS` value is not an integer in its range; a `FLOAT_FIELDS` value
            is not a finite number (`rope_theta` > 0, `rms_norm_eps` >= 0); a
            `BOOL_FIELDS` value is not a boolean (a float field may be a list, one per
            layer); `num_attention_heads` is not a
            multiple of `num_key_value_heads`; `mlp_only_layers` is not a list of layer
            indices; `quantization` lacks `group_size`/`bits` or has them out of range;
            `architectures` is not a list of strings, `rope_scaling` not an object or
            `eos_token_id` not a token id or a list of them.
    """
    if not isinstance(config, dict):
        raise error(f"{where}: top level is {type(config).__name__}, not a JSON object")
    _check_fields(config, where, "", error)
    for sub in SUB_CONFIGS:
        if isinstance(config.get(sub), dict):
            _check_fields(config[sub], where, f"{sub}.", error)
    return config


def _check_fields(config: dict, where: str, ctx: str, error: type[Exception]) -> None:
    def need(ok: bool, field: str, what: str) -> None:
        if not ok:
            raise error(f"{where}: {ctx}{field} is {show(config.get(field))}, expected {what}")

    for field, (lo, hi) in INT_FIELDS.items():
        if field not in config or (config[field] is None and field in NULLABLE):
            continue
        v = config[field]
        need(type(v) is int and lo <= v <= hi, field, f"an integer in [{lo}, {hi}]")
    for field, positive in FLOAT_FIELDS:
        if field in config:
            v = config[field]
            values = v if isinstance(v, list) and v else [v]  # or one per layer (Step 3.5)
            ok = all(
                type(x) in (int, float) and math.isfinite(x) and (x > 0 if positive else x >= 0)
                for x in values
            )
            need(ok, field, "a finite number " + ("> 0" if positive else ">= 0") + " (or a list)")
    for field in BOOL_FIELDS:
        if field in config:
            need(type(config[field]) is bool, field, "true or false")
    heads, kv = config.get("num_attention_heads"), config.get("num_key_value_heads")
    if isinstance(heads, int) and isinstance(kv, int):
        need(heads % kv == 0, "num_key_value_heads", f"a divisor of num_attention_heads {heads}")
    if "mlp_only_layers" in config:
        layers = config["mlp_only_layers"]
        n = config.get("num_hidden_layers", 0)
        ok = isinstance(layers, list) and all(type(i) is int and 0 <= i < n for i in layers)
        need(ok, "mlp_only_layers", f"a list of layer indices in [0, {n})")
    _check_quantization(config.get("quantization"), where, error)
    if "architectures" in config:
        v = config["architectures"]
        ok = isinstance(v, str) or (isinstance(v, list) and all(isinstance(a, str) for a in v))
        need(ok or v is None, "architectures", "a list of class names (strings)")
    if "rope_scaling" in config:
        need(
            config["rope_scaling"] is None or isinstance(config["rope_scaling"], dict),
            "rope_scaling",
            "an object or null",
        )
    if "eos_token_id" in config:
        need(
            is_token_ids(config["eos_token_id"]),
            "eos_token_id",
            "a token id, a list of token ids, or null",
        )


def is_token_ids(value) -> bool:
    """True for what mlx-lm and transformers take as `eos_token_id`: null, a non-negative
    integer or a list of them."""
    values = value if isinstance(value, list) else [value]
    return value is None or all(type(v) is int and v >= 0 for v in values)


def _check_quantization(q, where: str, error: type[Exception]) -> None:
    if q is None:
        return
    if not isinstance(q, dict):
        raise error(f"{where}: quantization is {show(q)}, expected an object")
    _check_quant_params(q, "quantization", where, error)
    for key, value in q.items():
        if key in ("group_size", "bits", "mode"):
            continue
        if isinstance(value, dict):
            _check_quant_params(value, f"quantization[{key!r}]", where, error)
        elif not isinstance(value, bool):
            raise error(
                f"{where}: quantization[{key!r}] is {show(value)}, expected an object or a bool"
            )


def _check_quant_params(q: dict, ctx: str, where: str, error: type[Exception]) -> None:
    for field, (lo, hi) in (("group_size", QUANT_GROUP), ("bits", QUANT_BITS)):
        v = q.get(field)
        if type(v) is not int or not lo <= v <= hi:
            got = show(v) if field in q else "missing"
            raise error(f"{where}: {ctx}.{field} is {got}, expected an integer in [{lo}, {hi}]")
    if "mode" in q and not isinstance(q["mode"], str):
        raise error(f"{where}: {ctx}.mode is {show(q['mode'])}, expected a string")


def _ranges(ns: list[int]) -> str:
    """[0, 1, 2, 5] -> "0-2, 5"."""
    out, start = [], None
    for i, v in enumerate(ns):
        start = v if start is None else start
        if i + 1 == len(ns) or ns[i + 1] != v + 1:
            out.append(f"{start}-{v}" if v != start else str(v))
            start = None
    return ", ".join(out)


def check_against_weights(
    config: dict,
    tensors: dict[str, TensorInfo],
    where: str,
    weights_where: str,
    error: type[Exception] = ModelFileError,
) -> None:
    """Refuses a (checked) config that describes other layers or sizes than the weights.

    Args:
        config: a config that passed `check_config`.
        tensors: every dense tensor present (safetensors headers), by weight name.
        where: the config file, for messages.
        weights_where: the weight file(s), for messages.

    Raises:
        error: `num_hidden_layers` (of the config or its text sub-config) is not an
            integer, or is not the number of decoder layers with weights (under no
            prefix, e.g. `model.`, are `layers.<i>` exactly those below it, plus
            `num_nextn_predict_layers` prediction layers), or `vocab_size` /
            `hidden_size` disagree with `model.embed_tokens.weight` / `model.norm.weight`.
    """
    by_prefix: dict[str, set[int]] = {}
    for key in tensors:
        if m := _LAYER_KEY.match(key):
            by_prefix.setdefault(m["prefix"], set()).add(int(m["n"]))
    text = next((config[k] for k in SUB_CONFIGS if isinstance(config.get(k), dict)), {})
    n = config.get("num_hidden_layers", text.get("num_hidden_layers"))
    if n is not None and type(n) is not int:
        raise error(f"{where}: num_hidden_layers is {show(n)}, expected the number of layers")
    # Multi-token-prediction layers (DeepSeek, GLM) have weights past num_hidden_layers.
    mtp = config.get("num_nextn_predict_layers", text.get("num_nextn_predict_layers", 0))
    mtp = mtp if type(mtp) is int and mtp >= 0 else 0
    fits = (set(range(n)) <= present <= set(range(n + mtp)) for present in by_prefix.values())
    if n is not None and not any(fits):  # n None: mlx-lm derives it from the model
        most = max(by_prefix.values(), key=len, default=set())
        found = f"layers {_ranges(sorted(most))}" if most else "no decoder layer"
        raise error(
            f"{where}: num_hidden_layers is {n} but {weights_where} holds {found} "
            "(a config.json of a different model?)"
        )
    embed = tensors.get("model.embed_tokens.weight")
    vocab = config.get("vocab_size")
    if embed is not None and vocab is not None and embed.shape[:1] != (vocab,):
        raise error(
            f"{where}: vocab_size is {vocab} but model.embed_tokens.weight in "
            f"{weights_where} has {embed.shape[0] if embed.shape else 0} rows "
            "(a config.json of a different model?)"
        )
    norm = tensors.get("model.norm.weight")
    hidden = config.get("hidden_size")
    if norm is not None and hidden is not None and norm.shape != (hidden,):
        raise error(
            f"{where}: hidden_size is {hidden} but model.norm.weight in {weights_where} "
            f"has shape {list(norm.shape)} (a config.json of a different model?)"
        )
