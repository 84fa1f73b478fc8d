"""Loading an mlx-lm MoE model with its experts streamed from an expert store.

`load(path, config)` accepts an expert store or an mlx-lm model directory (converted into
a store under the user cache directory on first use), builds mlx-lm's own model class,
puts a `StreamedExperts` in place of every `SwitchGLU` / `SwitchMLP` it holds (the store's
manifest names each one's module path), and loads only the dense weights. The result
generates through mlx-lm's own `stream_generate`.
"""

import errno
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.tokenizer_utils import TokenizerWrapper

from engine import autopin, pipeline
from engine import cache as cache_mod
from engine.config import ConfigError, StreamConfig
from engine.convert import convert, quantize_dense
from engine.expert_compute import ExpertMajor
from engine.experts import (
    ExpertModule,
    find_experts,
    instantiate,
    model_classes,
    num_hidden_layers,
    replace,
    router_logits,
    segment_mismatch,
    top_k,
)
from engine.memory_plan import MemoryPlan, cuda_pools, plan_memory
from engine.pipeline import Stage
from engine.predictor import Predictor, prefetch_targets
from engine.safe_io import contained, read_json_object, remove_leftovers
from engine.store import (
    CONFIG_FILE,
    DENSE_FILE,
    MANIFEST_FILE,
    VERSION,
    ExpertStore,
    LayerSpec,
    StoreError,
    store_version,
)

# store_cache_dir stays importable from here (the benchmarks use it).
from engine.store_cache import store_cache_dir, store_for, touch  # noqa: F401
from engine.streamed_layer import StreamedExperts
from engine.tokenizer import load_dir_tokenizer
from engine.validate import check_against_weights, check_config


def resolve_store(path: str | Path, progress=None, blob_layers: range | None = None) -> ExpertStore:
    """The expert store for `path`: `path` itself if it is a store, else the store of
    the mlx-lm model directory `path`, converted on first use. Only the blob files of
    `blob_layers` must be present (all when None; see `ExpertStore`).

    Raises:
        FileNotFoundError: `path` does not exist or has no config.json.
        PermissionError: `path` is a directory this process may not list.
        StoreError, UnsupportedModelError, NotMoEError: from validation and convert.
    """
    path = Path(path)
    remove_leftovers(path.parent, path.name)  # a forced convert into it killed mid-way
    if not path.exists():
        raise FileNotFoundError(f"model path {path} does not exist")
    if path.is_dir() and not os.access(path, os.R_OK | os.X_OK):
        raise PermissionError(
            errno.EACCES, "cannot read the directory (permission denied)", str(path)
        )
    if os.path.lexists(path / MANIFEST_FILE):
        # a bad manifest is reported, not taken for a model dir
        return ExpertStore(path, blob_layers)
    if not os.path.lexists(path / CONFIG_FILE):
        raise FileNotFoundError(
            f"{path} is neither an expert store ({MANIFEST_FILE}) nor an mlx-lm model "
            f"directory ({CONFIG_FILE})"
        )
    where = path / CONFIG_FILE
    model_config = read_json_object(contained(path, CONFIG_FILE))
    model_classes(check_config(model_config, str(where)), where)  # fail fast, before hashing
    remove_leftovers(store_cache_dir())  # conversions killed mid-way
    dest = store_for(path)
    if store_version(dest) != VERSION:  # absent, incomplete, or of an older format
        dest.parent.mkdir(parents=True, exist_ok=True)
        try:
            convert(path, dest, force=dest.exists(), progress=progress)
        except FileExistsError:
            if store_version(dest) != VERSION:  # else another process (a rank) wrote it
                raise
    touch(dest)
    return ExpertStore(dest, blob_layers)


@dataclass
class StreamedModel:
    """A loaded model whose experts stream from `store` through `cache`.

    Attributes:
        model: the mlx-lm `Model`, StreamedExperts in place of its experts; call it like
            mlx-lm's.
        tokenizer: mlx-lm's TokenizerWrapper (None for stores without tokenizer files).
        store: the ExpertStore.
        config: the StreamConfig it was built with.
        cache: the native `engine._ext.ExpertCache` (see `engine.cache`), of the stage's
            MoE layers in a pipeline.
        predictor: the prefetch `Predictor`.
        plan: the memory plan the cache was built from (`engine.memory_plan.MemoryPlan`:
            real slots per MoE layer as `config` gives them, expert_memory "auto" as it
            was at load; side rows, host tier, bytes and the memory available).
        compute: the form each call's expert math takes (mlx-lm's or expert-major), and
            what its checks found (`ExpertMajor.same_bits`).
        stage: this process's pipeline stage (engine.pipeline), or None when it runs
            every layer.
    """

    model: nn.Module
    tokenizer: TokenizerWrapper | None
    store: ExpertStore
    config: StreamConfig
    cache: cache_mod.ExpertCache
    predictor: Predictor
    plan: MemoryPlan
    compute: ExpertMajor
    stage: Stage | None = None

    @property
    def pin_path(self) -> Path:
        """The file autopin keeps its pin set in (one per pipeline stage)."""
        if self.stage is None:
            return self.store.path / autopin.PIN_FILE
        return self.store.path / f"autopin.stage{self.stage.rank}of{self.stage.size}.json"

    def snapshot(self) -> cache_mod.CacheSnapshot:
        """The cache's current state (thread-safe)."""
        return cache_mod.snapshot(self.cache)

    def set_prefetch(self, on: bool) -> None:
        """Turns prediction on or off from the next MoE layer call (needs side_slots > 0)."""
        self.predictor.enabled = bool(on) and self.cache.side_slots > 0

    def autopin_budget(self) -> int:
        """Experts autopin pins per MoE layer under this model's config
        (`engine.autopin.budget` of the smallest layer's slots, top_k and autopin_frac)."""
        return autopin.budget(
            min(self.cache.layer_slots), self.store.manifest.top_k, self.config.autopin_frac
        )

    def set_side_lfu(self, on: bool) -> None:
        """Persistent LFU (True) or legacy double-buffer side region, from the next
        forward boundary (after a drain)."""
        self.cache.side_lfu = bool(on)

    def set_sync(self, on: bool) -> None:
        """SYNC mode: fills run inline where submitted, from the next submission."""
        self.cache.sync = bool(on)


def _check_store_matches_model(
    store: ExpertStore,
    cfg: dict,
    model: nn.Module,
    experts: list[ExpertModule],
    specs: Sequence[LayerSpec],
) -> None:
    """Refuses a store whose experts are not those of the model its config.json builds (a
    store of a different model, or another model's config.json copied in): the expert
    modules, expert count, top-k and every segment's shape must be what that model holds.
    `experts` and `specs` are the layers loaded (a pipeline stage's: maybe none).

    Raises:
        StoreError: naming the manifest, the layer and the field or segment at fault.
    """
    m = store.manifest
    where = store.path / MANIFEST_FILE
    if [s.layer for s in specs] != [e.layer for e in experts]:
        raise StoreError(
            f"{store.path}: the store's MoE layers {[s.layer for s in specs]} do not match "
            f"the model's {[e.layer for e in experts]} (a store of a different model?)"
        )
    for spec, expert in zip(specs, experts, strict=True):
        if spec.module != expert.path:
            raise StoreError(
                f"{where}: layers[{spec.moe_index}].module is {spec.module!r} but the model's "
                f"experts of layer {spec.layer} are {expert.path!r} (a store of a different "
                "model, or written by another version: convert the model again)"
            )
    num_experts = experts[0].num_experts if experts else m.num_experts
    for field, got_value, want_value in (
        ("num_experts", m.num_experts, num_experts),
        ("top_k", m.top_k, top_k(cfg, num_experts, store.path / CONFIG_FILE)),
        ("num_hidden_layers", m.num_hidden_layers, num_hidden_layers(cfg, model, where)),
    ):
        if got_value != want_value:
            raise StoreError(
                f"{where}: {field} is {got_value} but config.json says {want_value} "
                "(a store of a different model?)"
            )
    for expert, spec in zip(experts, specs, strict=True):
        _check_layer_segments(where, spec, expert)


def _check_layer_segments(where: Path, spec: LayerSpec, expert: ExpertModule) -> None:
    problem = segment_mismatch(expert, spec.segments, spec.quantization)
    if problem is not None:
        raise StoreError(
            f"{where}: layers[{spec.moe_index}] ({spec.file}): {problem} (a store of a "
            "different model?)"
        )


def _check_backend(store: ExpertStore) -> None:
    """Refuses, before any work, experts that MLX cannot multiply on the CPU backend (where
    mlx-lm's own model fails too): unquantized float16/bfloat16 (the CPU `gather_mm` is
    float32 only) and nvfp4 with per-expert global scales (GPU only).

    Raises:
        ValueError: naming the segment, its dtype, the backend and what to do instead.
    """
    if mx.default_device() != mx.cpu:
        return
    for spec in store.manifest.layers:
        for seg in spec.segments:
            proj, param = seg.key.split(".")
            where = f"{store.path}: {spec.module}.{seg.key}"
            if param == "weight" and spec.quantization.get(proj) is None and seg.dtype != "float32":
                raise ValueError(
                    f"{where}: the experts are unquantized {seg.dtype}, and MLX's CPU "
                    "backend multiplies unquantized experts (gather_mm) in float32 only; "
                    "run on a GPU, or convert the model to float32 (mlx_lm.convert "
                    "--dtype float32) or quantize it (mlx_lm.convert -q) first"
                )
            if param == "global_scale":
                raise ValueError(
                    f"{where}: the experts are nvfp4 with a global scale per expert, which "
                    "MLX's gather_qmm supports only on the GPU; run on a GPU, or quantize "
                    "without global scales"
                )


def load_store_tokenizer(store: ExpertStore) -> TokenizerWrapper | None:
    """mlx-lm's tokenizer of the store, or None when it has no tokenizer files
    (`engine.tokenizer.load_dir_tokenizer`).

    Raises:
        StoreError: the tokenizer files cannot be loaded, or hold no vocabulary.
    """
    return load_dir_tokenizer(store.path, error=StoreError)


def load(
    path: str | Path | None = None,
    config: StreamConfig | None = None,
    progress=None,
    group=None,
    fit_default: bool = False,
    strict: bool = False,
) -> StreamedModel:
    """Loads a streamed model, its memory planned once (`engine.memory_plan.plan_memory`)
    before anything large is allocated or read.

    Args:
        path: an expert store or an mlx-lm MoE model directory; default: the embedded
            default model.
        config: cache settings (default `StreamConfig()`: every expert cacheable).
        progress: `progress(done_bytes, total_bytes)` during a first-use convert.
        group: an `mx.distributed.Group` to run one pipeline stage of (engine.pipeline):
            only the stage's dense weights are loaded, its cache holds only its MoE
            layers, and only their blob files must be in the store.
        fit_default: `config`'s pool size is a front end's default, not the user's: where
            it does not fit the memory available, expert_memory "auto" is loaded instead
            (`MemoryPlan.fell_back`; the StreamedModel's config says so).
        strict: a front end's load: real regions below top-k are refused
            (`engine.memory_plan.check_real_slots`).

    Raises:
        FileNotFoundError, PermissionError, StoreError, UnsupportedModelError,
            NotMoEError: bad path or store; StoreError when the store's MoE layers, expert
            count, top-k or segment shapes are not those of the model its config.json
            describes, or its tokenizer files cannot be loaded.
        ValueError: experts the CPU backend cannot multiply (unquantized float16 /
            bfloat16, nvfp4 global scales) while it is the default device.
        ConfigError, PoolMemoryError: as `plan_memory`: sizes the store cannot take, or
            a plan beyond the memory available.
        engine.cache.ExpertReadError: a blob file cannot be opened, or a record of a layer
            whose real region holds every expert (read at load) cannot be read.
    """
    from engine.resources import default_model_path

    config = config or StreamConfig()
    path = default_model_path() if path is None else path
    store = resolve_store(path, progress, blob_layers=None if group is None else range(0))
    cfg = store.config
    where = store.path / CONFIG_FILE
    check_config(cfg, str(where), StoreError)
    model_classes(cfg, where)
    dense = str(store.path / DENSE_FILE)
    check_against_weights(cfg, store.dense_header(), str(where), dense, StoreError)
    model = instantiate(cfg, where)
    stage, specs = None, store.manifest.layers
    if group is None:
        experts = find_experts(model, where)
    else:
        stage = pipeline.split(model, group.rank(), group.size(), group)
        store = ExpertStore(store.path, stage.layers)  # only the stage's blobs must be here
        specs = [s for s in specs if stage.holds(s.layer)]
        experts = pipeline.stage_experts(model, where)
    _check_store_matches_model(store, cfg, model, pipeline.as_stored(model, experts, stage), specs)
    _check_backend(store)
    routers = [router_logits(model, e) for e in experts]
    targets = prefetch_targets([r is not None for r in routers])
    plan = plan_memory(store, config, specs, targets, fit_default, strict)
    config = plan.config
    compute = ExpertMajor(config.expert_major, cuda_pools(), store.manifest.num_experts)
    cache = cache_mod.open_planned(store, plan, specs)
    predictor = Predictor(cache, routers, config, plan.tier_slots)
    for moe_index, (expert, spec) in enumerate(zip(experts, specs, strict=True)):
        replace(
            model, expert.path, StreamedExperts(predictor, moe_index, spec, expert.math, compute)
        )

    weights = store.dense_weights()
    if hasattr(model, "sanitize"):
        weights = model.sanitize(weights)
    if stage is not None:
        weights = pipeline.stage_weights(weights, stage, pipeline.renumbers(model))
    quantize_dense(model, cfg, weights, where, StoreError)
    model.eval()
    try:
        model.load_weights(list(weights.items()), strict=True)
    except ValueError as e:
        raise StoreError(f"{store.path / 'dense.safetensors'}: {e}") from None
    mx.eval(model.parameters())
    if stage is not None:
        pipeline.connect(model, stage, group)

    tokenizer = load_store_tokenizer(store)
    cache_mod.fill_whole_layers(cache)  # the last step: every check above is cheaper
    # A decode step's request: top_k ids of each token of the batch.
    predictor.start_device(cfg.get("hidden_size"), store.manifest.top_k * config.max_batch)
    model_obj = StreamedModel(
        model, tokenizer, store, config, cache, predictor, plan, compute, stage
    )
    remove_leftovers(store.path, model_obj.pin_path.name)  # a save killed mid-way
    if config.autopin_frac > 0:  # pre-load the pin set saved by the last run
        n = store.manifest.num_experts
        pins = autopin.load(model_obj.pin_path, n, cache.num_layers, model_obj.autopin_budget())
        autopin.apply(cache, pins)
    return model_obj


def load_stage(
    path: str | Path | None, config: StreamConfig, group, strict: bool = False
) -> StreamedModel:
    """`load`s this rank's stage of the pipeline `group` (engine.pipeline) from `path`
    (`{rank}` in it becomes the rank: a store per rank on one disk; None: the embedded
    default model), `strict` as `load`; every rank learns whether every rank loaded.

    Raises:
        ConfigError: on a rank whose settings its stage refuses (`plan_memory`), once
            every rank knows, for the front end to word it in its names.
        engine.pipeline.PipelineError: on every other rank when a rank could not load,
            naming each such rank and its reason.
    """
    sm, error, refused = None, None, None
    try:
        path = path and str(path).replace("{rank}", str(group.rank()))
        sm = load(path, config, group=group, strict=strict)
    except ConfigError as e:
        error, refused = str(e), e
    except (ValueError, OSError, KeyError) as e:
        error = str(e)
    try:
        pipeline.agree(error, group)  # a failed rank stops every rank, with its reason
    except pipeline.PipelineError:
        if refused is not None:
            raise refused from None
        raise
    return sm
