"""Loading an mlx-lm MoE model with its experts streamed from an expert store.

`load(path, config)` accepts an expert store or an mlx-lm model directory (converted into
a store under the user cache directory on first use), builds mlx-lm's own model class,
patches every MoE block's `switch_mlp` with a `StreamedSwitchGLU`, and loads only the
dense weights. The result generates through mlx-lm's own `stream_generate`.
"""

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.tokenizer_utils import TokenizerWrapper
from mlx_lm.utils import _get_classes, infer_quant_config, load_tokenizer

from engine import cache as cache_mod
from engine.config import StreamConfig
from engine.convert import convert
from engine.coordinator import Coordinator
from engine.layouts import layout_for
from engine.store import ExpertStore, StoreError, is_store
from engine.streamed_layer import StreamedSwitchGLU


def store_cache_dir() -> Path:
    """Where converted stores of model directories live:
    `$EXPERTSTREAM_CACHE`, else `$XDG_CACHE_HOME/expertstream`, else `~/.cache/expertstream`."""
    if root := os.environ.get("EXPERTSTREAM_CACHE"):
        return Path(root)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "expertstream"


def _fingerprint(model_dir: Path) -> str:
    """Hash of config.json and the weight files' names, sizes and mtimes: a changed
    checkpoint gets a new store, an unchanged one is converted once."""
    h = hashlib.sha256((model_dir / "config.json").read_bytes())
    for f in sorted(model_dir.glob("*.safetensors")):
        st = f.stat()
        h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()[:16]


def resolve_store(path: str | Path, progress=None) -> ExpertStore:
    """The expert store for `path`: `path` itself if it is a store, else the store of
    the mlx-lm model directory `path`, converted on first use.

    Raises:
        FileNotFoundError: `path` does not exist or has no config.json.
        StoreError, UnsupportedModelError, NotMoEError: from validation and convert.
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"model path {path} does not exist")
    if is_store(path):
        return ExpertStore(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"{path} is neither an expert store (manifest.json) nor an mlx-lm model "
            "directory (config.json)"
        )
    layout_for(json.loads((path / "config.json").read_text()))  # fail fast, before hashing
    dest = store_cache_dir() / f"{path.resolve().name}-{_fingerprint(path)}"
    if not is_store(dest):
        dest.parent.mkdir(parents=True, exist_ok=True)
        convert(path, dest, force=dest.exists(), progress=progress)
    return ExpertStore(dest)


@dataclass
class StreamedModel:
    """A loaded model whose experts stream from `store` through `cache`.

    Attributes:
        model: the mlx-lm `Model` with StreamedSwitchGLU blocks; call it like mlx-lm's.
        tokenizer: mlx-lm's TokenizerWrapper (None for stores without tokenizer files).
        store: the ExpertStore.
        config: the StreamConfig it was built with.
        cache: the native `ExpertCache`.
        coordinator: the prefetch `Coordinator`.
    """

    model: nn.Module
    tokenizer: TokenizerWrapper | None
    store: ExpertStore
    config: StreamConfig
    cache: object
    coordinator: Coordinator

    def snapshot(self) -> cache_mod.CacheSnapshot:
        """The cache's current state (thread-safe)."""
        return cache_mod.snapshot(self.cache)

    def set_prefetch(self, on: bool) -> None:
        """Turns prediction on or off from the next MoE layer call (needs spec_slots > 0)."""
        self.coordinator.enabled = bool(on) and self.cache.spec > 0

    def set_side_lfu(self, on: bool) -> None:
        """Persistent LFU (True) or legacy double-buffer side region, from the next
        forward boundary (after a drain)."""
        self.cache.side_lfu = bool(on)

    def set_sync(self, on: bool) -> None:
        """SYNC mode: fills run inline where submitted, from the next submission."""
        self.cache.sync = bool(on)


def _quantize_dense(model: nn.Module, config: dict, weights: dict) -> None:
    """Quantizes the dense modules exactly as mlx-lm's load_model does for a checkpoint
    with a `quantization` entry: per-module overrides first, else inferred from the saved
    scales; modules without saved scales stay unquantized."""
    quantization = config.get("quantization")
    if quantization is None:
        if "quantization_config" in config:
            raise ValueError(
                "config.json has a 'quantization_config' but no 'quantization': only "
                "MLX-format quantized checkpoints (mlx_lm.convert -q) are supported"
            )
        return

    def predicate(path, module):
        if path in quantization:
            return quantization[path]
        if not hasattr(module, "to_quantized") or f"{path}.scales" not in weights:
            return False
        return infer_quant_config(path, module, weights)

    nn.quantize(
        model,
        group_size=quantization["group_size"],
        bits=quantization["bits"],
        mode=quantization.get("mode", "affine"),
        class_predicate=predicate,
    )


def load(
    path: str | Path | None = None, config: StreamConfig | None = None, progress=None
) -> StreamedModel:
    """Loads a streamed model.

    Args:
        path: an expert store or an mlx-lm MoE model directory; default: the embedded
            default model.
        config: cache settings (default `StreamConfig()`: every expert cacheable).
        progress: `progress(done_bytes, total_bytes)` during a first-use convert.

    Raises:
        FileNotFoundError, StoreError, UnsupportedModelError, NotMoEError: bad path or
            store; StoreError when the store's MoE layers do not match the model's.
        engine.cache.ExpertReadError: a blob file cannot be opened.
    """
    from engine.resources import default_model_path

    config = config or StreamConfig()
    store = resolve_store(default_model_path() if path is None else path, progress)
    cfg = store.config
    layout = layout_for(cfg)
    model_class, args_class = _get_classes(cfg)
    model = model_class(args_class.from_dict(cfg))
    blocks = layout.moe_blocks(model)
    specs = store.manifest.layers
    if [i for i, _ in blocks] != [s.layer for s in specs]:
        raise StoreError(
            f"{store.path}: the store's MoE layers {[s.layer for s in specs]} do not match "
            f"the model's {[i for i, _ in blocks]} (a store of a different model?)"
        )
    cache = cache_mod.open_cache(store, config)
    coordinator = Coordinator(cache, [b.gate for _, b in blocks], config)
    for moe_index, ((_, block), spec) in enumerate(zip(blocks, specs, strict=True)):
        block.switch_mlp = StreamedSwitchGLU(
            coordinator, moe_index, spec, block.switch_mlp.activation
        )

    weights = store.dense_weights()
    if hasattr(model, "sanitize"):
        weights = model.sanitize(weights)
    _quantize_dense(model, cfg, weights)
    model.eval()
    try:
        model.load_weights(list(weights.items()), strict=True)
    except ValueError as e:
        raise StoreError(f"{store.path / 'dense.safetensors'}: {e}") from None
    mx.eval(model.parameters())

    tokenizer = None
    if (store.path / "tokenizer_config.json").exists() or (store.path / "tokenizer.json").exists():
        tokenizer = load_tokenizer(store.path, eos_token_ids=cfg.get("eos_token_id"))
    model_obj = StreamedModel(model, tokenizer, store, config, cache, coordinator)
    if config.autopin_frac > 0:
        from engine.autopin import restore_pins

        restore_pins(model_obj)
    return model_obj
