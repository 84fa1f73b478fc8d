"""Convert an mlx-lm MoE model directory into an expert store: a blob store (`convert`:
every expert written again, in blob files) or an in-place store (`index_in_place`: an
index of where each expert's segments lie in the checkpoint's own files, with a checksum
per expert).

The store format is specified in `docs/store-format.md`. Both read the checkpoint lazily
and handle one MoE layer at a time, so memory stays bounded by the dense weights plus one
layer's experts (an index, by a chunk of one tensor). Both are atomic: `StoreWriter`
writes into a temporary sibling directory that is renamed into place only when complete.
"""

import errno
import os
import re
import shutil
import zlib
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
    BLOB,
    CONFIG_FILE,
    IN_PLACE,
    MANIFEST_FILE,
    PARAMS,
    LayerSpec,
    Manifest,
    Segment,
    SegmentSource,
    Source,
    SourceFile,
    data_start,
    dtype_name,
    header_digest,
    is_store,
    layout_segments,
    non_finite,
    read_stride,
    stride_for,
)
from .store_writer import StoreWriter, manifest_text
from .tokenizer import load_dir_tokenizer
from .validate import DEFAULT_QUANT_MODE, QUANT_MODES, brief, check_against_weights, check_config

# Other weight formats (pickle-based and others): never opened nor copied into a store;
# named in the error when a model directory has no safetensors.
_UNREAD_WEIGHT_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".ckpt", ".npz", ".npy", ".gguf")

# The dtype of a segment, by its safetensors name (an in-place segment keeps its file's).
_SAFETENSORS_DTYPES = {
    "BOOL": "bool",
    "U8": "uint8",
    "U16": "uint16",
    "U32": "uint32",
    "U64": "uint64",
    "I8": "int8",
    "I16": "int16",
    "I32": "int32",
    "I64": "int64",
    "F16": "float16",
    "BF16": "bfloat16",
    "F32": "float32",
}
# Bytes an index reads at a time for its checksums.
_INDEX_CHUNK = 64 << 20

# announce(kind, bytes written, bytes of experts): said once before a store is written.
Announce = Callable[[str, int, int], None]


class NotInPlaceError(ValueError):
    """A checkpoint whose experts cannot be read where they are (the family's sanitize
    builds its stacked tensors from others): a blob store is written for it instead."""


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
    announce: Announce | None = None,
) -> Path:
    """Write the blob store of an mlx-lm MoE model directory.

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
        announce: `announce(BLOB, blob bytes, expert bytes)`, once before writing.

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
    ckpt = _read_checkpoint(model_dir, store_dir, force)
    ckpt.forget_stored()  # else every array evaluated for its layer would stay in memory
    total = sum(p.record_bytes for p in ckpt.plans) * ckpt.num_experts
    if announce is not None:
        strides = sum(stride_for(p.record_bytes) for p in ckpt.plans) * ckpt.num_experts
        announce(BLOB, strides, total)
    try:
        with StoreWriter(ckpt.store_dir, ckpt.num_experts) as writer:
            _copy_aux_files(ckpt.model_dir, writer.path)
            load_dir_tokenizer(writer.path, where=ckpt.model_dir)
            _write_store(writer, ckpt.plans, ckpt.weights, ckpt.origin, progress)
            writer.finish(ckpt.config["model_type"], ckpt.top_k, ckpt.num_layers, force)
    except BaseException as e:
        renamed = _naming_store(e, ckpt.model_dir, ckpt.store_dir)
        if renamed is e:
            raise
        raise renamed from e
    return ckpt.store_dir


@dataclass
class _Checkpoint:
    """A model directory read and checked for a store (arrays still lazy).

    Attributes:
        weights: the dense weights (the experts taken out into `plans`).
        stored: {id of an array as a safetensors file stores it: (file, tensor name)},
            of the arrays `stored_arrays` keeps alive (ids of freed arrays are reused).
    """

    model_dir: Path
    store_dir: Path
    config: dict
    files: list[Path]
    headers: dict
    origin: dict
    num_experts: int
    top_k: int
    num_layers: int
    weights: dict
    plans: list
    stored: dict
    stored_arrays: list

    def forget_stored(self) -> None:
        """Lets go of the arrays as stored (and with them of `stored`'s ids)."""
        self.stored.clear()
        self.stored_arrays.clear()


def _read_checkpoint(model_dir: str | Path, store_dir: str | Path, force: bool) -> _Checkpoint:
    """Reads and checks the checkpoint of `model_dir` for the store `store_dir`: its
    config, weights (sanitized by the family, lazily), the layout of every MoE layer's
    records and the dense weights left (see `convert` for what is checked)."""
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
    stored = _load_stored(files, model_dir)
    weights = {key: a for key, (_, a) in stored.items()}
    if hasattr(model, "sanitize"):
        weights = model.sanitize(weights)
    plans = _plan_layers(config, experts, weights)
    drop_experts(weights, [], model)
    for plan, expert in zip(plans, experts, strict=True):
        _check_experts(plan, expert, origin, model_dir)
    quantize_dense(model, config, weights, where)
    _check_dense(model, weights, [e.path for e in experts], origin, model_dir)
    return _Checkpoint(
        model_dir=model_dir,
        store_dir=store_dir,
        config=config,
        files=files,
        headers=headers,
        origin=origin,
        num_experts=num_experts,
        top_k=k,
        num_layers=layers,
        weights=weights,
        plans=plans,
        stored={id(a): (f, key) for key, (f, a) in stored.items()},
        stored_arrays=[a for _, a in stored.values()],
    )


def drop_experts(weights: dict[str, mx.array], modules: list[str], model: nn.Module) -> None:
    """Takes out of `weights` (sanitized) every weight of the expert modules `modules`
    and a stray `lm_head.*` of a model without `lm_head` (tied embeddings): what is left
    is the dense weights, as a blob store's `dense.safetensors` holds them."""
    for key in [k for k in weights if any(k.startswith(f"{m}.") for m in modules)]:
        del weights[key]
    if "lm_head" not in model:
        for key in [k for k in weights if k.startswith("lm_head.")]:
            del weights[key]


def index_in_place(
    model_dir: str | Path,
    store_dir: str | Path,
    *,
    force: bool = False,
    progress: Callable[[int, int], None] | None = None,
    announce: Announce | None = None,
) -> Path:
    """Write the in-place store of an mlx-lm MoE model directory: an index of where each
    expert's segments lie in the checkpoint's safetensors files and a crc32 per expert,
    computed by reading every expert's bytes once (and refusing NaN or infinity in
    them); the experts, dense weights, config and tokenizer stay in `model_dir`. The
    checkpoint is checked as `convert` checks it.

    Args:
        model_dir: an mlx-lm model directory whose experts are stacked tensors as stored
            (an mlx-community checkpoint).
        store_dir: the store to create.
        force: replace an existing store at `store_dir`.
        progress: `progress(done_bytes, total_bytes)` over the expert bytes read.
        announce: `announce(IN_PLACE, index bytes at most, expert bytes)`, once before
            the experts are read.

    Returns:
        `store_dir` as a `Path`.

    Raises:
        NotInPlaceError: an expert tensor is not one a file stores as it is (the family's
            sanitize stacks, splits or converts it): nothing was read or written.
        The errors of `convert` otherwise (ModelFileError naming the file and tensor of
        NaN or infinity among the experts).
    """
    ckpt = _read_checkpoint(model_dir, store_dir, force)
    n = ckpt.num_experts
    layouts = [_in_place_layout(ckpt, plan) for plan in ckpt.plans]
    ckpt.forget_stored()
    source = Source(
        str(ckpt.model_dir.resolve()),
        tuple(
            SourceFile(f.name, st.st_size, st.st_mtime_ns, header_digest(f))
            for f in ckpt.files
            for st in [os.stat(f)]
        ),
    )
    total = sum(plan.record_bytes for plan in ckpt.plans) * n
    dense_bytes = sum(a.nbytes for a in ckpt.weights.values())
    try:
        load_dir_tokenizer(ckpt.model_dir, where=ckpt.model_dir)
        _check_finite(ckpt.weights, ckpt.origin)
        ckpt.weights.clear()
        with StoreWriter(ckpt.store_dir, n) as writer:
            if announce is not None:
                announce(IN_PLACE, _index_bytes(ckpt, layouts, source, dense_bytes), total)
            done = 0
            if progress is not None:
                progress(done, total)
            for plan, layout in zip(ckpt.plans, layouts, strict=True):
                checksums = [0] * n
                for seg, (file, offset) in zip(plan.segments, layout, strict=True):
                    for e0, data in _expert_chunks(ckpt.files[file], offset, seg.nbytes, n):
                        _check_in_place_finite(data, seg, plan.module, ckpt.files[file])
                        view = memoryview(data)
                        for i in range(len(data) // seg.nbytes):
                            part = view[i * seg.nbytes : (i + 1) * seg.nbytes]
                            checksums[e0 + i] = zlib.crc32(part, checksums[e0 + i])
                        done += len(data)
                        if progress is not None:
                            progress(done, total)
                sources = tuple(SegmentSource(f, o) for f, o in layout)
                writer.index_layer(
                    plan.layer, plan.module, plan.segments, plan.quantization, sources, checksums
                )
                plan.arrays.clear()
            writer.finish(
                ckpt.config["model_type"],
                ckpt.top_k,
                ckpt.num_layers,
                force,
                source=source,
                dense_bytes=dense_bytes,
            )
    except BaseException as e:
        renamed = _naming_store(e, ckpt.model_dir, ckpt.store_dir)
        if renamed is e:
            raise
        raise renamed from e
    return ckpt.store_dir


def _in_place_layout(ckpt: _Checkpoint, plan: "_LayerPlan") -> list[tuple[int, int]]:
    """(file index, byte offset of expert 0) of each segment of `plan`, where the array of
    the segment is one a file stores as it is: a C-contiguous (num_experts, *shape)
    tensor of the segment's dtype.

    Raises:
        NotInPlaceError: an array is not such a tensor.
    """
    layout = []
    for seg in plan.segments:
        found = ckpt.stored.get(id(plan.arrays[seg.key]))
        if found is None:
            raise NotInPlaceError(
                f"{ckpt.model_dir}: {plan.module}.{seg.key} is not a tensor of the "
                "checkpoint as stored (the family's sanitize makes it)"
            )
        file, name = found
        info = ckpt.headers[file][name]
        want = (ckpt.num_experts, *seg.shape)
        if info.shape != want or _SAFETENSORS_DTYPES.get(info.dtype) != seg.dtype:
            raise NotInPlaceError(
                f"{file}: {name} is {info.dtype} {list(info.shape)}, not the {seg.dtype} "
                f"{list(want)} of {plan.module}.{seg.key}"
            )
        layout.append((ckpt.files.index(file), data_start(file) + info.begin))
    return layout


def _index_bytes(ckpt: _Checkpoint, layouts, source: Source, dense_bytes: int) -> int:
    """The size of the manifest an index writes, at most (every checksum its widest)."""
    layers = tuple(
        LayerSpec(
            layer=plan.layer,
            moe_index=i,
            module=plan.module,
            file=None,
            record_bytes=plan.record_bytes,
            stride=read_stride(plan.segments),
            segments=plan.segments,
            quantization=plan.quantization,
            checksums=(2**32 - 1,) * ckpt.num_experts,
            sources=tuple(SegmentSource(f, o) for f, o in layout),
        )
        for i, (plan, layout) in enumerate(zip(ckpt.plans, layouts, strict=True))
    )
    manifest = Manifest(
        ckpt.config["model_type"],
        ckpt.num_experts,
        ckpt.top_k,
        ckpt.num_layers,
        layers,
        dense_bytes,
        None,
        kind=IN_PLACE,
        source=source,
    )
    return len(manifest_text(manifest.to_json()).encode()) + 1


def _expert_chunks(path: Path, offset: int, nbytes: int, num_experts: int):
    """(first expert, bytes) of the stacked tensor of `num_experts` x `nbytes` bytes at
    `offset` of `path`, read a few experts at a time (about `_INDEX_CHUNK` bytes), each
    chunk dropped from the page cache once read.

    Raises:
        ModelFileError: the file ends before the tensor does.
    """
    per = max(1, _INDEX_CHUNK // nbytes)
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    try:
        for e0 in range(0, num_experts, per):
            want = min(per, num_experts - e0) * nbytes
            at = offset + e0 * nbytes
            data = os.pread(fd, want, at)
            if len(data) != want:
                raise ModelFileError(f"{path}: ends inside the experts' tensor at byte {at}")
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(fd, at, want, os.POSIX_FADV_DONTNEED)
            yield e0, data
    finally:
        os.close(fd)


def _check_in_place_finite(data: bytes, seg: Segment, module: str, path: Path) -> None:
    """Refuses a float segment's bytes holding NaN or infinity (as `_check_finite`).

    Raises:
        ModelFileError: naming the file and the weight.
    """
    if non_finite(seg.dtype, data):
        raise ModelFileError(
            f"{path}: {module}.{seg.key} holds NaN or infinity (a damaged checkpoint?)"
        )


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


def _load_stored(files: list[Path], model_dir: Path) -> dict[str, tuple[Path, mx.array]]:
    """Every tensor of `files`, lazily loaded: {name: (file, array)}.

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
    stored = {}
    for f in files:
        try:
            stored.update((k, (f, a)) for k, a in mx.load(str(f), format="safetensors").items())
        except (RuntimeError, ValueError) as e:
            raise ValueError(f"{f}: not a readable safetensors file ({e})") from None
    return stored


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
            mode=quantization.get("mode", DEFAULT_QUANT_MODE),
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
    mode = params.get("mode", DEFAULT_QUANT_MODE)
    if mode not in QUANT_MODES:
        raise ValueError(
            f"config quantization[{path!r}] mode {mode!r} is not one of {', '.join(QUANT_MODES)}"
        )
    return {"group_size": int(params["group_size"]), "bits": int(params["bits"]), "mode": mode}


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
