"""Convert an mlx-lm MoE model directory into an expert store.

The store format is specified in `docs/store-format.md`. Conversion reads the
checkpoint lazily and writes one MoE layer at a time, so memory stays bounded by
the dense weights plus one layer's experts. It is atomic: `StoreWriter` writes into a
temporary sibling directory that is renamed into place only when complete.
"""

import errno
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm.utils import _takes_global_scale, infer_quant_config

from .experts import (
    ExpertModule,
    find_experts,
    instantiate,
    model_classes,
    num_hidden_layers,
    segment_mismatch,
    top_k,
)
from .experts import quantization as quantization_of
from .safe_io import (
    ModelFileError,
    check_regular,
    contained,
    fsync_path,
    read_json_object,
    regular_files,
)
from .safetensors_header import read_header
from .store import (
    CONFIG_FILE,
    MANIFEST_FILE,
    PARAMS,
    Segment,
    dtype_name,
    is_store,
    layout_segments,
)
from .store_writer import StoreWriter
from .tokenizer import load_dir_tokenizer
from .validate import brief, check_against_weights, check_config

# Other weight formats (pickle-based and others): never opened nor copied into a store;
# named in the error when a model directory has no safetensors.
_UNREAD_WEIGHT_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".ckpt", ".npz", ".npy", ".gguf")


@dataclass
class _LayerPlan:
    """What will be written for one MoE layer (arrays still lazy)."""

    layer: int
    moe_index: int
    module: str
    arrays: dict[str, mx.array]
    segments: tuple[Segment, ...]
    record_bytes: int
    quantization: dict


def convert(
    model_dir: str | Path,
    store_dir: str | Path,
    *,
    force: bool = False,
    progress: Callable[[int, int], None] | None = None,
) -> Path:
    """Write the expert store of an mlx-lm MoE model directory.

    The weights of each `SwitchGLU` / `SwitchMLP` the model holds (`<its module
    path>.*`, e.g. `model.layers.N.mlp.switch_mlp.*` or `model.layers.N.mlp.experts.*`)
    go to one `layerNN.blob` per MoE layer, every other weight to `dense.safetensors`;
    checkpoints are first sanitized by the model family's own `sanitize` (per-expert
    tensors stacked, fused gate/up split), lazily, so memory stays bounded by the dense
    weights plus one layer's experts;
    `config.json` and the tokenizer/auxiliary files are copied (no `*.py`, no
    pickle or other weight files).

    Args:
        model_dir: an mlx-lm model directory (`config.json`,
            `model*.safetensors`), quantized or not.
        store_dir: the store to create.
        force: replace an existing store at `store_dir` (only once the new one
            is complete). A directory that is neither an expert store nor empty
            is never replaced.
        progress: called as `progress(done_bytes, total_bytes)` over expert
            bytes: once with `done_bytes == 0`, then after each layer.

    Returns:
        `store_dir` as a `Path`.

    Raises:
        FileNotFoundError: `model_dir`, its `config.json` or its weights are
            missing.
        ValueError: `model_dir` is an expert store already, `store_dir` exists and is
            neither a store nor empty (with `force` or not), invalid `config.json`, a
            config with `model_file` (custom model code is never run), or weights that
            do not match the model.
        UnsupportedModelError: mlx-lm has no such model, or its experts are not a
            stacked SwitchGLU / SwitchMLP (`engine.experts`).
        NotMoEError: no layer of the model has routed experts, or the config has no
            experts-per-token entry.
        FileExistsError: `store_dir` is a store (or empty) and `force` is False.
        OSError: writing failed (e.g. ENOSPC); the message names `store_dir`.
            Nothing is left behind: neither `store_dir` nor the temporary
            directory.
    """
    model_dir = Path(model_dir)
    store_dir = Path(store_dir)
    config = _read_config(model_dir)
    where = model_dir / CONFIG_FILE
    model_classes(config, where)
    _check_destination(model_dir, store_dir, force)
    files = _weight_files(model_dir)
    headers = {f: read_header(f) for f in files}
    origin = {k: f for f, tensors in headers.items() for k in tensors}  # for messages
    if files:  # without weights, the model's own errors come first, then the missing files
        tensors = {k: t for tensors in headers.values() for k, t in tensors.items()}
        check_against_weights(config, tensors, str(where), ", ".join(f.name for f in files))

    model = instantiate(config, where)
    experts = find_experts(model, where)
    num_experts = experts[0].num_experts
    k = top_k(config, num_experts, where)
    layers = num_hidden_layers(config, model, where)
    weights = _load_weights(files, model, model_dir)
    plans = _plan_layers(config, experts, weights)
    if "lm_head" not in model:
        for key in [k for k in weights if k.startswith("lm_head.")]:
            del weights[key]
    for plan, expert in zip(plans, experts, strict=True):
        _check_experts(plan, expert, origin, model_dir)
    quantize_dense(model, config, weights, where)
    _check_dense(model, weights, [e.path for e in experts], origin, model_dir)

    try:
        with StoreWriter(store_dir, num_experts) as writer:
            _copy_aux_files(model_dir, writer.path)
            load_dir_tokenizer(writer.path, where=model_dir)
            _write_store(writer, plans, weights, origin, progress)
            writer.finish(config["model_type"], k, layers, force)
    except BaseException as e:
        renamed = _naming_store(e, model_dir, store_dir)
        if renamed is e:
            raise
        raise renamed from e
    return store_dir


def _read_config(model_dir: Path) -> dict:
    path = model_dir / CONFIG_FILE
    if model_dir.exists() and not model_dir.is_dir():
        raise NotADirectoryError(
            errno.ENOTDIR, "is a file, not an mlx-lm model directory", str(model_dir)
        )
    if not model_dir.is_dir():
        raise FileNotFoundError(errno.ENOENT, "model directory does not exist", str(model_dir))
    if is_store(model_dir):
        raise ValueError(f"{model_dir} is already an expert store; use it directly with --model")
    try:
        config = read_json_object(contained(model_dir, CONFIG_FILE))
    except FileNotFoundError:
        raise FileNotFoundError(
            errno.ENOENT, "missing; not an mlx-lm model directory", str(path)
        ) from None
    if "model_file" in config:
        raise ValueError(
            f"{path}: 'model_file' ({config['model_file']!r}) asks to run custom "
            "model code; converting such models is not supported"
        )
    return check_config(config, str(path))


def _check_destination(model_dir: Path, store_dir: Path, force: bool) -> None:
    if store_dir.resolve() == model_dir.resolve():
        raise ValueError(f"the store {store_dir} cannot be the model directory")
    if not (store_dir.exists() or store_dir.is_symlink()):
        return
    # What --force cannot replace is said first: offering --force for it only leads to
    # a second refusal.
    replaceable = store_dir.is_dir() and not store_dir.is_symlink()
    if not (replaceable and (is_store(store_dir) or not any(store_dir.iterdir()))):
        raise ValueError(
            f"{store_dir} exists and is not an expert store: convert never replaces it, "
            "--force or not; give a new directory"
        )
    if not force:
        raise FileExistsError(
            errno.EEXIST, "already exists (--force, or force=True, replaces it)", str(store_dir)
        )


def _weight_files(model_dir: Path) -> list[Path]:
    """The `model*.safetensors` files, each checked to be a regular file inside the
    model directory (links out of it are refused)."""
    files = [contained(model_dir, f.name) for f in sorted(model_dir.glob("model*.safetensors"))]
    for f in files:
        check_regular(f)
    return files


def _load_weights(files: list[Path], model: nn.Module, model_dir: Path) -> dict[str, mx.array]:
    """Lazily loaded, sanitized weights (per-expert checkpoints are stacked).

    Raises:
        FileNotFoundError: no weight files (naming other formats found, never read).
    """
    if not files:
        others = sorted(p.name for p in model_dir.iterdir() if p.suffix in _UNREAD_WEIGHT_SUFFIXES)
        detail = "no model*.safetensors weights"
        if others:
            detail += (
                f" (found {', '.join(others)}: only safetensors are read, pickle-based "
                "and other formats never are)"
            )
        raise FileNotFoundError(errno.ENOENT, detail, str(model_dir))
    weights = {}
    for f in files:
        try:
            weights.update(mx.load(str(f), format="safetensors"))
        except (RuntimeError, ValueError) as e:
            raise ValueError(f"{f}: not a readable safetensors file ({e})") from None
    if hasattr(model, "sanitize"):
        weights = model.sanitize(weights)
    return weights


def quantize_dense(
    model: nn.Module,
    config: dict,
    weights: dict[str, mx.array],
    where: Path,
    error: type[Exception] = ModelFileError,
) -> None:
    """Quantizes the modules of `model` exactly as mlx-lm's load_model does for a
    checkpoint with a `quantization` entry (or a `quantization_config` that stands for
    one) and the weights `weights`: per-module overrides first, else inferred from the
    saved scales; modules without saved scales stay unquantized. Lazy: nothing is
    computed.

    Raises:
        error: naming `where` (the config), the module and MLX's reason when its quantizer
            refuses a module's shape (e.g. a group size that does not divide it).
    """
    quantization = quantization_of(config, where)
    if quantization is None:
        return
    current = []  # the module being quantized: MLX's error does not name it

    def predicate(path, module):
        current[:] = [path]
        if path in quantization:
            return quantization[path]
        if not hasattr(module, "to_quantized") or f"{path}.scales" not in weights:
            return False
        params = infer_quant_config(path, module, weights)
        if f"{path}.global_scale" in weights and _takes_global_scale(module):
            params["global_scale"] = True
        return params

    try:
        nn.quantize(
            model,
            group_size=quantization["group_size"],
            bits=quantization["bits"],
            mode=quantization.get("mode", "affine"),
            class_predicate=predicate,
        )
    except ValueError as e:
        module = current[0] if current else "a module"
        raise error(
            f"{where}: the quantization of {module} does not fit its shape ({brief(e)})"
        ) from None


def _check_dense(
    model: nn.Module,
    dense: dict[str, mx.array],
    expert_paths: list[str],
    origin: dict[str, Path],
    model_dir: Path,
) -> None:
    """The weights left after the experts were taken out are exactly the parameters of the
    (quantized, `quantize_dense`) model outside its expert modules, each of the shape the
    model has and an integer dtype where the model's is (packed quantized weights), as
    mlx-lm's strict loading will require.

    Raises:
        ModelFileError: naming the file and the first weight that is not a parameter (e.g.
            per-expert tensors that the family's `sanitize` did not stack), is missing, or
            has another shape or kind of dtype than the model built from config.json.
    """
    params = {
        k: v
        for k, v in tree_flatten(model.parameters())
        if not any(k.startswith(f"{p}.") for p in expert_paths)
    }
    where = model_dir / CONFIG_FILE
    # in file order, a module's weight before its scales and biases
    for key in sorted(dense, key=lambda k: (str(origin.get(k, "")), not k.endswith(".weight"), k)):
        a = dense[key]
        file = origin.get(key, model_dir)
        if key not in params:
            raise ModelFileError(
                f"{file}: weight {key!r} is not a parameter of this {model.model_type} model "
                "after mlx-lm's sanitize (per-expert weights it does not stack, or a "
                f"config.json of another model: {where})"
            )
        want = params[key]
        integer = not mx.issubdtype(want.dtype, mx.floating)
        if a.shape != want.shape or integer != (not mx.issubdtype(a.dtype, mx.floating)):
            raise ModelFileError(
                f"{file}: {key} is {dtype_name(a.dtype)} {list(a.shape)} but the model of "
                f"{where} needs {dtype_name(want.dtype) if integer else 'a float'} "
                f"{list(want.shape)} (config.json's sizes or quantization do not match "
                "the weights)"
            )
    missing = [k for k in params if k not in dense]
    if missing:
        raise ModelFileError(
            f"{model_dir}: the weights have no {missing[0]}"
            + (f" (nor {len(missing) - 1} other parameters)" if len(missing) > 1 else "")
            + f" that the model of {where} needs"
            + (
                " (tie_word_embeddings is false: the checkpoint's embeddings are tied?)"
                if missing[0].startswith("lm_head.")
                else " (a config.json of another model?)"
            )
        )


def _check_experts(
    plan: _LayerPlan, expert: ExpertModule, origin: dict[str, Path], model_dir: Path
) -> None:
    """The records planned for one layer are the parameters of its expert module, as
    loading will require (`engine.experts.segment_mismatch`).

    Raises:
        ModelFileError: naming the file, the weight and what config.json needs instead.
    """
    problem = segment_mismatch(expert, plan.segments, plan.quantization)
    if problem is not None:
        keys = (f"{plan.module}.{k}" for k in plan.arrays)
        file = next((origin[k] for k in keys if k in origin), model_dir)  # else sanitized
        raise ModelFileError(
            f"{file}: experts of {plan.module}: {problem} per expert (config.json's sizes or "
            "quantization do not match the weights)"
        )


def _plan_layers(
    config: dict, experts: list[ExpertModule], weights: dict[str, mx.array]
) -> list[_LayerPlan]:
    """Take each expert module's arrays out of `weights` and lay out its records; what
    remains in `weights` is dense."""
    num_experts = experts[0].num_experts
    plans = []
    for moe_index, expert in enumerate(experts):
        module = expert.path
        order = [f"{proj}.{param}" for proj in expert.projections for param in PARAMS]
        keys = {}
        for key in [k for k in weights if k.startswith(f"{module}.")]:
            rest = key[len(module) + 1 :]
            if rest not in order:
                raise ValueError(
                    f"expert weight {key!r}: parameter {rest!r} is not one of a "
                    f"{expert.kind}'s (supported: {', '.join(order)})"
                )
            keys[rest] = key
        for proj in expert.projections:
            linear = expert.module[proj]
            if f"{proj}.weight" not in keys:
                raise ValueError(f"missing expert weight {module}.{proj}.weight")
            if ("bias" in linear) != (f"{proj}.bias" in keys):
                raise ValueError(
                    f"{module}.{proj}: the config "
                    f"{'expects' if 'bias' in linear else 'has no'} expert bias "
                    "but the checkpoint does not match"
                )
        arrays = {}
        parts = []
        for seg_key in order:
            if seg_key not in keys:
                continue
            a = weights.pop(keys[seg_key])
            if a.ndim < 1 or a.shape[0] != num_experts:
                raise ValueError(
                    f"{module}.{seg_key} has shape {tuple(a.shape)}, expected "
                    f"{num_experts} experts on axis 0"
                )
            parts.append((seg_key, dtype_name(a.dtype), tuple(a.shape[1:])))
            arrays[seg_key] = a
        segments = layout_segments(parts)
        record_bytes = sum(seg.nbytes for seg in segments)
        quantization = {
            proj: _quantization(config, module, proj, expert.module[proj], keys, arrays)
            for proj in expert.projections
        }
        plans.append(
            _LayerPlan(
                expert.layer, moe_index, module, arrays, segments, record_bytes, quantization
            )
        )
    return plans


def _quantization(
    config: dict,
    module: str,
    proj: str,
    linear: nn.Module,
    keys: dict[str, str],
    arrays: dict[str, mx.array],
) -> dict | None:
    """How projection `proj` is quantized, decided as mlx-lm's loader does:
    the config's per-module override `<module>.<proj>` first, else inferred
    from the packed shapes (`mlx_lm.utils.infer_quant_config`)."""
    if f"{proj}.scales" not in keys:
        return None
    path = f"{module}.{proj}"
    section = quantization_of(config, CONFIG_FILE)
    if not isinstance(section, dict):
        raise ValueError(f"{path} is quantized but config.json has no 'quantization' section")
    params = section.get(path)
    if params is None:
        weights = {
            f"{path}.weight": arrays[f"{proj}.weight"],
            f"{path}.scales": arrays[f"{proj}.scales"],
        }
        params = infer_quant_config(path, linear, weights)
    elif not isinstance(params, dict):
        raise ValueError(f"config quantization[{path!r}] is {params!r} but {path}.scales exists")
    return {
        "group_size": int(params["group_size"]),
        "bits": int(params["bits"]),
        "mode": params.get("mode", "affine"),
    }


def _write_store(
    writer: StoreWriter,
    plans: list[_LayerPlan],
    dense: dict[str, mx.array],
    origin: dict[str, Path],
    progress: Callable[[int, int], None] | None,
) -> None:
    """Writes the dense weights and every planned layer's blob (one layer's experts
    evaluated at a time), each checked to hold finite floats only; `progress(done,
    total)` counts record bytes, once before the first layer and after each.

    Raises:
        ModelFileError: a weight holds NaN or infinity (naming its file).
    """
    num_experts = writer.num_experts
    _check_finite(dense, origin)
    writer.write_dense(dense)
    total = sum(p.record_bytes for p in plans) * num_experts
    done = 0
    if progress is not None:
        progress(done, total)
    for plan in plans:
        _check_finite({f"{plan.module}.{k}": a for k, a in plan.arrays.items()}, origin)
        parts = _record_parts(plan.arrays, num_experts)
        plan.arrays.clear()
        records = ([p[e] for p in parts] for e in range(num_experts))
        writer.write_layer(plan.layer, plan.module, plan.segments, plan.quantization, records)
        del parts, records
        done += plan.record_bytes * num_experts
        if progress is not None:
            progress(done, total)


def _check_finite(weights: dict[str, mx.array], origin: dict[str, Path]) -> None:
    """Refuses float weights (scales and biases included) holding NaN or infinity, which
    generate nothing but empty replies. Evaluates `weights` (they are written next).

    Raises:
        ModelFileError: naming the file and the first such weight.
    """
    floats = {k: a for k, a in weights.items() if mx.issubdtype(a.dtype, mx.floating)}
    finite = {k: mx.isfinite(a).all() for k, a in floats.items()}
    mx.eval(list(finite.values()))
    for key, ok in finite.items():
        if not ok.item():
            raise ModelFileError(
                f"{origin.get(key, 'the weights')}: {key} holds NaN or infinity (a damaged "
                "checkpoint?)"
            )


def _record_parts(arrays: dict[str, mx.array], num_experts: int) -> list[np.ndarray]:
    """Evaluate one layer's stacked expert arrays (in segment order) as bytes.

    Returns:
        One uint8 array per segment, shaped `(num_experts, nbytes)`: row `e` is
        the C-contiguous bytes of `arrays[key][e]` (any dtype, bfloat16
        included, is reinterpreted, never converted).
    """
    views = [mx.contiguous(a).view(mx.uint8).reshape(num_experts, -1) for a in arrays.values()]
    mx.eval(views)
    return [np.asarray(v) for v in views]


def aux_files(model_dir: Path) -> list[Path]:
    """The files of `model_dir` that go into its store as they are: config, generation
    config, tokenizer and other plain files; never weights or code, and only regular
    files inside the model directory (`engine.safe_io.regular_files`: no FIFO, device or
    link leading out of it)."""
    return [
        entry
        for entry in regular_files(model_dir)
        if not entry.name.endswith((".safetensors", ".safetensors.index.json", ".py"))
        and not entry.name.endswith(_UNREAD_WEIGHT_SUFFIXES)
        and entry.name != MANIFEST_FILE
        and re.fullmatch(r"layer\d+\.blob", entry.name) is None
    ]


def _copy_aux_files(model_dir: Path, dest: Path) -> None:
    for entry in aux_files(model_dir):
        shutil.copyfile(entry, dest / entry.name)
        fsync_path(dest / entry.name)


def _naming_store(e: BaseException, model_dir: Path, store_dir: Path) -> BaseException:
    """`e` with a message that names the store; nothing was written."""
    what = f"converting {model_dir} into {store_dir} failed, nothing was written"
    if isinstance(e, OSError):
        if e.errno is None:
            return OSError(f"{what}: {e}")
        detail = e.strerror or str(e)
        if e.filename is not None:
            detail = f"{detail} ({e.filename})"
        return OSError(e.errno, f"{what}: {detail}", str(store_dir))
    if isinstance(e, Exception) and e.args and isinstance(e.args[0], str):
        e.args = (f"{what}: {e.args[0]}", *e.args[1:])
    return e
