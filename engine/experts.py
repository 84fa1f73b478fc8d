"""Where the routed experts of an mlx-lm model are: every `SwitchGLU` / `SwitchMLP` it holds.

Instead of a table of layouts, `find_experts` walks the instantiated mlx-lm model and returns
each stacked-experts module wherever it sits (`switch_mlp`, `experts`, `switch_glu`, ...,
under `model.layers.N` or `language_model.model.layers.N`); its module path is the weight-key
prefix of its experts. Everything else (routers, shared experts, dense layers, attention,
SSM and linear-attention layers and their caches) stays mlx-lm's own code, resident.
"""

import weakref
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.switch_layers import SwitchGLU, SwitchMLP
from mlx_lm.utils import _get_classes

from engine.safe_io import ModelFileError
from engine.store import DTYPES, KINDS
from engine.validate import SUB_CONFIGS

# ModelArgs fields (and config keys) of the experts each token is routed to, as mlx-lm's
# families name them.
TOP_K_KEYS = (
    "num_experts_per_tok",
    "num_experts_per_token",
    "moe_topk",
    "moe_top_k",
    "moe_k",
    "top_k_experts",
)
# mlx-lm MoE families whose routed experts are not a stacked SwitchGLU / SwitchMLP, with why.
UNSUPPORTED = {
    "dbrx": "its experts are a list of per-expert MLP modules (no stacked SwitchGLU) "
    "that mlx-lm runs one expert at a time",
}


class UnsupportedModelError(ValueError):
    """mlx-lm has no model of the config's `model_type`, or its experts cannot be streamed."""


class NotMoEError(ValueError):
    """The config describes a model without routed experts."""


@dataclass(eq=False)
class ExpertModule:
    """One stacked-experts module of an instantiated mlx-lm model.

    Attributes:
        path: its module path, which is also the weight-key prefix of its experts,
            e.g. "model.layers.3.mlp.switch_mlp" or "model.layers.1.mlp.experts".
        layer: decoder layer index: the path's last number (`model.layers.<n>`,
            `transformer.h.<n>`, `backbone.layers.<n>`).
        module: the mlx-lm `SwitchGLU` or `SwitchMLP` (its parameters are never evaluated).
    """

    path: str
    layer: int
    module: nn.Module

    @property
    def kind(self) -> str:
        """ "SwitchGLU" or "SwitchMLP"."""
        return type(self.module).__name__

    @property
    def projections(self) -> tuple[str, ...]:
        """("gate_proj", "up_proj", "down_proj") or ("fc1", "fc2")."""
        return KINDS[self.kind]

    @property
    def activation(self) -> Callable:
        """The module's own activation (SwiGLU, SwigluOAI, GeGLU, ReLU2, GELU, ...)."""
        return self.module.activation

    @property
    def math(self) -> "ExpertMath":
        """What computing its experts needs (no reference back into the model)."""
        return ExpertMath(self.kind, self.activation)

    @property
    def num_experts(self) -> int:
        return self.module[self.projections[0]].weight.shape[0]

    @property
    def hidden(self) -> int:
        """Model dimension: the input width of the first projection."""
        return self.module[self.projections[0]].weight.shape[-1]


@dataclass(frozen=True)
class ExpertMath:
    """The computation of one stacked-experts module: `kind` ("SwitchGLU" or "SwitchMLP")
    and its own `activation`; see `engine.expert_compute.expert_outputs`."""

    kind: str
    activation: Callable


def model_classes(config: dict, where: str | Path) -> tuple[type, type]:
    """mlx-lm's `(Model, ModelArgs)` of a config, as `mlx_lm.utils.load_model` picks them.

    Args:
        where: the config file, named in errors.

    Raises:
        UnsupportedModelError: `model_type` missing, unknown to mlx-lm, or a family in
            `UNSUPPORTED` (the message says why).
    """
    model_type = config.get("model_type")
    if not isinstance(model_type, str):
        raise UnsupportedModelError(f"{where}: model_type is {model_type!r}, expected a string")
    if model_type in UNSUPPORTED:
        raise UnsupportedModelError(
            f"{where}: model_type {model_type!r} is not supported: {UNSUPPORTED[model_type]}"
        )
    try:
        return _get_classes(config)
    except ValueError:
        raise UnsupportedModelError(
            f"{where}: model_type {model_type!r} is not a model mlx-lm implements"
        ) from None


def instantiate(config: dict, where: str | Path) -> nn.Module:
    """mlx-lm's `Model` of `config`; its own random parameters stay lazy (never evaluated).

    Raises:
        UnsupportedModelError: see `model_classes`.
        engine.safe_io.ModelFileError: the config does not build the model (a missing or
            invalid field; a ValueError).
    """
    model_class, args_class = model_classes(config, where)
    try:
        return model_class(args_class.from_dict(config))
    except (
        TypeError,
        ValueError,
        KeyError,
        AttributeError,
        AssertionError,
        ZeroDivisionError,
        OverflowError,
        IndexError,
    ) as e:
        raise ModelFileError(f"{where}: not a valid {config['model_type']} config ({e!r})") from e


def find_experts(model: nn.Module, where: str | Path = "the model") -> list[ExpertModule]:
    """Every SwitchGLU / SwitchMLP of an instantiated mlx-lm model, in decoder order.

    Raises:
        NotMoEError: the model holds none (a dense config, or every layer made dense by
            `mlp_only_layers`, `first_k_dense_replace`, ...).
        UnsupportedModelError: one is a subclass with its own computation, is not under a
            `layers.<n>` list, shares its decoder layer with another, or the modules
            disagree on the expert count.
    """
    found = []
    for path, module in model.named_modules():
        if not isinstance(module, (SwitchGLU, SwitchMLP)):
            continue
        if type(module) not in (SwitchGLU, SwitchMLP):
            raise UnsupportedModelError(
                f"{where}: {path} is a {type(module).__name__}, a subclass of "
                f"{type(module).__mro__[1].__name__} with its own computation"
            )
        parts = path.split(".")
        numbered = [int(p) for p in parts[:-1] if p.isdigit()]
        if not numbered:
            raise UnsupportedModelError(f"{where}: experts {path} are not in a decoder layer")
        found.append(ExpertModule(path, numbered[-1], module))
    if not found:
        raise NotMoEError(
            f"{where}: no layer of this {getattr(model, 'model_type', '')} model has routed "
            "experts (no SwitchGLU / SwitchMLP: a dense config, or every layer made dense)"
        )
    found.sort(key=lambda e: e.layer)
    for a, b in zip(found, found[1:], strict=False):
        if a.layer == b.layer:
            raise UnsupportedModelError(
                f"{where}: decoder layer {a.layer} holds two expert modules ({a.path}, {b.path})"
            )
    counts = {e.num_experts for e in found}
    if len(counts) > 1:
        raise UnsupportedModelError(
            f"{where}: MoE layers with different expert counts {sorted(counts)}"
        )
    return found


def top_k(config: dict, num_experts: int, where: str | Path) -> int:
    """Experts per token, as mlx-lm's model takes it: the first of `TOP_K_KEYS` on the
    family's `ModelArgs` built from `config` (so a field the config leaves out has
    ModelArgs' default), else on its text sub-config (`engine.validate.SUB_CONFIGS`: mlx-lm's args
    object, or the config's dict where mlx-lm keeps a dict). A value of None or 0 there
    (ModelArgs' "not set") counts as absent.

    Raises:
        UnsupportedModelError: see `model_classes`.
        NotMoEError: no such value, or it is not an int in [1, num_experts].
    """
    _, args_class = model_classes(config, where)
    args = args_class.from_dict(config)
    subs = (getattr(args, k, None) or config.get(k) for k in SUB_CONFIGS)
    for source in (args, *subs):
        if source is None:
            continue
        for key in TOP_K_KEYS:
            k = source.get(key) if isinstance(source, dict) else getattr(source, key, None)
            if k is None or k == 0:
                continue
            if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= num_experts:
                raise NotMoEError(
                    f"{where}: {key!r} is {k!r} (expected an int in [1, {num_experts}])"
                )
            return k
    raise NotMoEError(f"{where}: no experts-per-token entry (looked for {', '.join(TOP_K_KEYS)})")


def quantization(config: dict, where: str | Path) -> dict | None:
    """The config's MLX `quantization` section, as `mlx_lm.utils.load_model` reads it: the
    `quantization` entry, else the one a Hugging Face `quantization_config` (also inside
    `text_config`) stands for: mxfp4 (gpt-oss), mxfp8, or fp8 with ue8m0 scales over 32x32
    blocks (which is mxfp8). None for an unquantized checkpoint.

    Raises:
        ValueError: a `quantization_config` of another method (mlx-lm dequantizes those in
            its sanitize or needs other code; convert the model with mlx_lm.convert first).
    """
    if "quantization" in config:
        return config["quantization"]
    qc = config.get("quantization_config")
    if qc is None and isinstance(config.get("text_config"), dict):
        qc = config["text_config"].get("quantization_config")
    if qc is None:
        return None
    method = qc.get("quant_method") if isinstance(qc, dict) else None
    ue8m0 = qc.get("scale_fmt") == "ue8m0" and list(qc.get("weight_block_size", ())) == [32, 32]
    if method in ("mxfp4", "mxfp8") or (method == "fp8" and ue8m0):
        bits = 4 if method == "mxfp4" else 8
        return {"group_size": 32, "bits": bits, "mode": "mxfp4" if bits == 4 else "mxfp8"}
    raise ValueError(
        f"{where}: quantization_config with quant_method {method!r} is not supported; "
        "convert the checkpoint with mlx_lm.convert first"
    )


def num_hidden_layers(config: dict, model: nn.Module, where: str | Path) -> int:
    """Decoder layers of the model (MoE or not): the config's `num_hidden_layers`, else the
    length of the model's `layers`.

    Raises:
        ValueError: the value is not a positive int.
    """
    n = config.get("num_hidden_layers", len(model.layers))
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"{where}: num_hidden_layers is {n!r}, expected a positive int")
    return n


def router_logits(model: nn.Module, expert: ExpertModule) -> Callable[[mx.array], mx.array] | None:
    """A function `(n, hidden) -> (n, num_experts)` of router logits of this MoE layer, for
    the prefetch predictor only (the model's own routing is never replaced).

    The router is a Linear / QuantizedLinear, or a gate module's `weight` matrix
    (DeepSeek-style `MoEGate`), from `hidden` to at least `num_experts` outputs, found next
    to the experts (or one level down, e.g. `router.proj`), else next to their ancestors
    up to the decoder layer (Gemma 4 routes in the layer, not in its `experts`). Among
    candidates: exactly `num_experts` outputs first, then names with "router" or "gate".
    Extra logits (LongCat's zero-computation experts) are cut off. None when not found.
    The module is looked up again at every call (loading quantizes routers into new
    modules), through a weak reference to `model`: the predictor that holds the function
    is itself held by the model's streamed layers, and a strong one would make a cycle
    that keeps a dropped model's pools alive until the garbage collector runs.
    """
    n, hidden = expert.num_experts, expert.hidden
    parts = expert.path.split(".")
    layer_at = max(i for i, p in enumerate(parts) if p.isdigit())
    for depth in range(len(parts) - 1, layer_at, -1):
        found = []
        for names, child in _near(model, parts[:depth], parts[depth]):
            w = child.get("weight") if isinstance(child, nn.Module) else None
            if isinstance(w, mx.array) and w.ndim == 2 and w.shape[0] >= n and w.shape[1] == hidden:
                rel = ".".join(names[depth:])
                named = "router" in rel or rel == "gate" or rel.startswith("gate.")
                found.append(((w.shape[0] != n, not named), names, isinstance(child, nn.Linear)))
        if found:
            _, names, linear = min(found, key=lambda f: f[0])
            return _logits(model, names, n, linear)
    return None


def _near(model: nn.Module, prefix: list[str], skip: str):
    """(path, module) of the children of the module at `prefix` other than `skip`, and of
    their children."""
    module = _resolve(model, prefix)
    for name, child in module.children().items():
        if name == skip or not isinstance(child, nn.Module):
            continue
        yield (*prefix, name), child
        for sub, grandchild in child.children().items():
            if isinstance(grandchild, nn.Module):
                yield (*prefix, name, sub), grandchild


def _resolve(model: nn.Module, names) -> nn.Module:
    module = model
    for name in names:
        module = module[int(name)] if isinstance(module, list) else module[name]
    return module


def _logits(model: nn.Module, names, n: int, linear: bool) -> Callable[[mx.array], mx.array]:
    ref = weakref.ref(model)

    def logits(x: mx.array) -> mx.array:
        router = _resolve(ref(), names)
        y = router(x) if linear else x @ router["weight"].T
        return y if y.shape[-1] == n else y[..., :n]  # a slice only where there are extras

    return logits


def replace(model: nn.Module, path: str, new: nn.Module) -> None:
    """Put `new` at module path `path` of `model` (where an expert module was)."""
    *parents, name = path.split(".")
    setattr(_resolve(model, parents), name, new)


def expected_segments(expert: ExpertModule, quantization: dict, keys: set[str]) -> dict:
    """{segment key: (dtype name or None for any float, per-expert shape)} that the
    model's own (unevaluated) expert module needs, quantized as `quantization` says
    (projection -> {"group_size", "bits", "mode"} or None; an nvfp4 projection may hold
    one float32 tensor scale per expert, as the segment `keys` show). Shapes come from
    lazy arrays: nothing is computed.

    Raises:
        ValueError: MLX's quantizer refuses the projection's shape (e.g. a group size
            that does not divide it).
    """
    want = {}
    for proj in expert.projections:
        linear = expert.module[proj]
        _, rows, cols = linear.weight.shape
        q = quantization.get(proj)
        if q is None:
            want[f"{proj}.weight"] = (None, (rows, cols))
        else:
            parts = mx.quantize(
                mx.zeros((rows, cols)), group_size=q["group_size"], bits=q["bits"], mode=q["mode"]
            )
            for name, a in zip(("weight", "scales", "biases"), parts, strict=False):
                dtype = "uint32" if name == "weight" else None
                if a.dtype == mx.uint8:  # mxfp4, mxfp8, nvfp4 scales
                    dtype = "uint8"
                want[f"{proj}.{name}"] = (dtype, tuple(a.shape))
            if q["mode"] == "nvfp4" and f"{proj}.global_scale" in keys:
                want[f"{proj}.global_scale"] = ("float32", ())
        if "bias" in linear:
            want[f"{proj}.bias"] = (None, (rows,))
    return want


def segment_mismatch(expert: ExpertModule, segments, quantization: dict) -> str | None:
    """What keeps one layer's expert records (`segments`: `engine.store.Segment`s, keys
    `<proj>.<param>`, per-expert shapes) quantized as `quantization` says from being the
    parameters of `expert` (`expected_segments`), in a phrase naming the segment; None
    when they are."""
    try:
        want = expected_segments(expert, quantization, {s.key for s in segments})
    except ValueError as e:
        return f"quantization {quantization} does not fit the model ({' '.join(str(e).split())})"
    got = {s.key: s for s in segments}
    for key in [*got, *(k for k in want if k not in got)]:
        if key not in want:
            return f"segment {key} is not a parameter of the model"
        if key not in got:
            return f"segment {key} of the model is missing"
        dtype, shape = want[key]
        seg = got[key]
        ok_dtype = seg.dtype == dtype if dtype else mx.issubdtype(DTYPES[seg.dtype], mx.floating)
        if tuple(seg.shape) != shape or not ok_dtype:
            need = f"{dtype or 'a float'} {list(shape)}"
            return (
                f"segment {key} is {seg.dtype} {list(seg.shape)} but the model of "
                f"config.json needs {need}"
            )
    return None
