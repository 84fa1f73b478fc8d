"""Pipeline stages over `mlx.distributed`: one contiguous run of decoder layers per rank.

Started by `mlx.launch` (any backend MLX ships; the ring backend on loopback in the
tests), each process holds one stage: its decoder layers' dense weights and a cache over
only its own MoE layers. The split is mlx-lm's: rank 0 holds the last layers (and
samples), rank size-1 the first. Hidden states travel as mlx-lm's pipelined models send
them: each stage receives from rank+1, sends to rank-1, and every rank all-gathers the
last stage's output so that all ranks compute the same logits and feed the same token.

Models whose mlx-lm class has `pipeline(group)` (qwen3_moe, qwen3_next, qwen3_5,
deepseek_v2/v3/v32/v41, glm4_moe, glm4_moe_lite, mistral4, ...) use it unchanged. For the
families of `GENERIC` (mixtral, olmoe, qwen2_moe and eight more) the inner model's layer
list is cut to the stage and its first and last layers do what mlx-lm's pipelined
`__call__` does at those two points (`connect`); mlx-lm's code is not patched. Other
families are refused.
"""

import contextlib
import dataclasses
import json
import os
import re
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.pipeline import PipelineMixin

from engine.cache import RATES, REPORTED_STATS, rates
from engine.experts import ExpertModule, NotMoEError, find_experts, instantiate
from engine.store import layer_range

# Seconds that `init_group` waits for every rank to connect before it gives up.
CONNECT_TIMEOUT_S = 120.0
# Largest JSON `gather_json` takes from one rank, bytes: a longer size is a broken ring's.
MAX_JSON_BYTES = 64 << 20

_group = None  # the group this process joined (init_group)
_LAYER_PATH = re.compile(r"^model\.layers\.(\d+)\.")
# Families without mlx-lm pipelining whose split from outside (`split`, `connect`) is
# proven equal to the single process (tests/test_pipeline.py): their inner model calls
# `layer(h, mask, cache)` for each layer of `layers`, the mask made from cache[0].
GENERIC = (
    "Klear",
    "bailing_moe",
    "deepseek",
    "dots1",
    "ernie4_5_moe",
    "granitemoe",
    "minimax",
    "mixtral",
    "olmoe",
    "phimoe",
    "qwen2_moe",
)


class PipelineError(RuntimeError):
    """A pipeline run cannot go on: a rank failed (its message is in this one), the
    connection to another rank was lost, or the ranks did not connect in time."""


@dataclass(frozen=True)
class Stage:
    """The decoder layers one rank runs.

    Attributes:
        rank: this process's rank in the group (0 samples and prints).
        size: ranks in the group.
        start, end: decoder layers [start, end) of this stage (global indices).
    """

    rank: int
    size: int
    start: int
    end: int

    def __str__(self) -> str:
        return f"rank {self.rank}/{self.size} ({layer_range(self.layers)})"

    @property
    def layers(self) -> range:
        """The stage's decoder layers."""
        return range(self.start, self.end)

    def holds(self, layer: int) -> bool:
        """True when decoder layer `layer` belongs to this stage."""
        return self.start <= layer < self.end


class _Group:
    """A stand-in for `mx.distributed.Group` with a fixed rank and size (for computing a
    stage's layers without connecting)."""

    def __init__(self, rank: int, size: int):
        self._rank, self._size = rank, size

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size


def parse_stage(text: str) -> tuple[int, int]:
    """`"I/N"` -> (rank I, size N), with 0 <= I < N.

    Raises:
        ValueError: naming the text when it is not two integers "I/N" in range.
    """
    try:
        i, n = (int(p) for p in text.split("/"))
    except ValueError:
        raise ValueError(f"--stage {text!r}: expected RANK/RANKS, e.g. 0/2") from None
    if not (n >= 1 and 0 <= i < n):
        raise ValueError(f"--stage {text!r}: need 0 <= RANK < RANKS")
    return i, n


def split(model: nn.Module, rank: int, size: int, group=None) -> Stage:
    """Cuts `model` (an mlx-lm `Model`, parameters not yet loaded) to the stage of `rank`.

    With mlx-lm's own `model.model.pipeline`, the model keeps its pipelined forward and
    its global layer numbering (the layers before the stage become None). For the
    families of `GENERIC`, the inner model's `layers` becomes the stage's layers
    (numbered from 0): load weights through `stage_weights`, then call `connect` once
    they are loaded.

    Args:
        group: the `mx.distributed.Group`; None computes the stage only (the model is
            then fit for `stage_weights` and inspection, not for a forward).

    Raises:
        ValueError: the family has no pipeline split, or more ranks than decoder layers.
    """
    inner = getattr(model, "model", None)
    model_type = getattr(model, "model_type", None) or type(model).__module__.split(".")[-1]
    if not isinstance(getattr(inner, "layers", None), list):
        raise ValueError(f"model_type {model_type!r}: no model.model.layers to split into stages")
    n_layers = len(inner.layers)
    if size > n_layers:
        raise ValueError(
            f"{size} pipeline ranks for {n_layers} decoder layers: at most one rank per layer"
        )
    g = group if group is not None else _Group(rank, size)
    if hasattr(inner, "pipeline"):
        inner.pipeline(g)
        return Stage(rank, size, inner.start_idx, inner.end_idx)
    if model_type not in GENERIC:
        raise ValueError(
            f"model_type {model_type!r} cannot run as pipeline stages: mlx-lm gives it no "
            f"pipeline(group), and the split from outside is proven for {', '.join(GENERIC)}"
        )
    bounds = SimpleNamespace(layers=list(range(n_layers)))
    PipelineMixin.pipeline(bounds, g)  # mlx-lm's own split, on a list of numbers
    inner.layers = inner.layers[bounds.start_idx : bounds.end_idx]
    return Stage(rank, size, bounds.start_idx, bounds.end_idx)


def renumbers(model: nn.Module) -> bool:
    """True when `split` numbered the stage's layers from 0 (the split from outside)."""
    return not hasattr(model.model, "pipeline")


def stage_experts(model: nn.Module, where) -> list[ExpertModule]:
    """The expert modules of a split model (engine.experts.find_experts; none for a stage
    of dense layers only), with the model's own paths (numbered from 0 after the split
    from outside: see `as_stored`)."""
    try:
        return find_experts(model, where)
    except NotMoEError:
        return []


def as_stored(model: nn.Module, experts: list[ExpertModule], stage: Stage | None) -> list:
    """`experts` of `model` under the decoder indices and paths of the whole model, as
    the store names them (the split from outside numbers a stage's layers from 0)."""
    if stage is None or not renumbers(model):
        return experts
    return [
        dataclasses.replace(
            e,
            layer=e.layer + stage.start,
            path=_LAYER_PATH.sub(lambda m: f"model.layers.{int(m[1]) + stage.start}.", e.path),
        )
        for e in experts
    ]


def stage_weights(weights: dict, stage: Stage, renumber: bool) -> dict:
    """The entries of `weights` (checkpoint key -> array) that `stage` loads: every
    weight outside `model.layers.N.`, and those of the stage's layers, renamed to
    `model.layers.(N - start).` when `renumber`."""
    out = {}
    for key, value in weights.items():
        m = _LAYER_PATH.match(key)
        if m is None:
            out[key] = value
            continue
        layer = int(m.group(1))
        if stage.holds(layer):
            if renumber:
                key = f"model.layers.{layer - stage.start}.{key[m.end() :]}"
            out[key] = value
    return out


def _edge_class(base: type, stage: Stage, group, first: bool, last: bool) -> type:
    """A subclass of the decoder layer class `base` whose call does what mlx-lm's
    pipelined models do at a stage's edges: the stage's first layer (unless the pipeline's
    first) takes its input from rank+1; its last layer sends its output to rank-1 (unless
    rank 0) and all-gathers rank 0's output. A subclass, not a wrapper: the layer's module
    paths (which the router lookups use) stay what they are."""
    rank, size = stage.rank, stage.size
    recv = first and rank < size - 1

    def __call__(self, x, mask=None, cache=None):
        if recv:
            x = mx.distributed.recv_like(x, rank + 1, group=group)
        h = base.__call__(self, x, mask, cache)
        if not last:
            return h
        if rank != 0:
            h = mx.distributed.send(h, rank - 1, group=group)
            if cache is not None:  # the send must run when only the KV cache is evaluated
                cache.keys = mx.depends(cache.keys, h)
        if size > 1:
            h = mx.distributed.all_gather(h, group=group)[: h.shape[0]]
        return h

    return type(f"Stage{base.__name__}", (base,), {"__call__": __call__})


def connect(model: nn.Module, stage: Stage, group) -> None:
    """Turns the first and last layers of a model split from outside into stage edges
    (`_edge_class`); nothing for models with mlx-lm's own pipelining."""
    if not renumbers(model):
        return
    layers = model.model.layers
    last = len(layers) - 1
    for i in {0, last}:
        layers[i].__class__ = _edge_class(type(layers[i]), stage, group, i == 0, i == last)


def gather_json(obj, group) -> list:
    """Every rank's `obj` (JSON-serialisable), in rank order, on every rank (a collective:
    each rank must call it).

    Raises:
        PipelineError: the connection to another rank was lost (MLX's error, or what a
            broken ring delivers instead of a rank's JSON).
    """
    data = np.frombuffer(json.dumps(obj).encode(), np.uint8)
    try:
        sizes = mx.distributed.all_gather(
            mx.array([data.size], mx.int32), group=group, stream=mx.cpu
        )
        sizes = np.array(sizes)
        if not 0 < sizes.min() <= sizes.max() <= MAX_JSON_BYTES:
            raise ValueError(f"sizes {sizes.tolist()} of the ranks' JSON")
        buf = np.zeros((1, int(sizes.max())), np.uint8)
        buf[0, : data.size] = data
        rows = np.array(mx.distributed.all_gather(mx.array(buf), group=group, stream=mx.cpu))
        return [json.loads(bytes(row[:n])) for row, n in zip(rows, sizes, strict=True)]
    except (RuntimeError, ValueError) as e:  # ValueError: garbage instead of JSON
        raise lost(group.rank(), e) from None


def lost(rank: int, error: BaseException) -> PipelineError:
    """The error of rank `rank` when a collective failed with `error`."""
    return PipelineError(
        f"rank {rank}: the pipeline stopped ({type(error).__name__}: {error}): another rank "
        "failed or was killed"
    )


def exit_now(message: str) -> None:
    """Prints `expertstream: error: {message}` and ends the process at once with exit
    code 2: no MLX teardown, which can wait forever on a collective a lost rank left."""
    print(f"expertstream: error: {message}", file=sys.stderr, flush=True)
    os._exit(2)


class _Deadline:
    """The one deadline of the thread that runs the collectives, watched by a daemon
    thread that ends the process (`exit_now`) once it has passed."""

    def __init__(self):
        self._at: float | None = None
        self._failure, self._timeout_s = "", 0.0
        self._watcher: threading.Thread | None = None

    def arm(self, timeout_s: float, failure: str) -> None:
        """From now on, the process ends unless this is re-armed or `disarm`ed within
        `timeout_s` seconds; `failure` says what was awaited."""
        if self._watcher is None:
            self._watcher = threading.Thread(target=self._watch, name="expertstream-deadline")
            self._watcher.daemon = True
            self._watcher.start()
        self._failure, self._timeout_s = failure, timeout_s
        self._at = time.monotonic() + timeout_s

    def disarm(self) -> None:
        self._at = None

    def _watch(self) -> None:
        while True:
            time.sleep(0.2)
            at = self._at
            if at is not None and time.monotonic() > at:
                rank = os.environ.get("MLX_RANK", "?")
                exit_now(f"rank {rank}: {self._failure} within {self._timeout_s:.0f} s")


_deadline = _Deadline()


@contextlib.contextmanager
def bounded(timeout_s: float, failure: str):
    """Ends the process (exit code 2, printing `failure` and the bound) when the block
    runs longer than `timeout_s` seconds; yields `renew(timeout_s, failure)`, which
    restarts the bound (a wait made of steps: each gets its own). MLX's ring backend may
    wait without a bound on a rank that went away, where no exception can reach the
    waiting thread. One bounded block at a time, on the thread that runs the collectives.
    """
    _deadline.arm(timeout_s, failure)
    try:
        yield _deadline.arm
    finally:
        _deadline.disarm()


def agree(error: str | None, group) -> None:
    """Every rank says whether it may go on; raises on every rank when any may not.

    Args:
        error: this rank's reason for stopping, or None.

    Raises:
        PipelineError: naming each failed rank and its reason.
    """
    errors = gather_json(error, group)
    failed = [f"rank {r}: {e}" for r, e in enumerate(errors) if e is not None]
    if failed:
        raise PipelineError("; ".join(failed))


def init_group(timeout_s: float = CONNECT_TIMEOUT_S):
    """Joins the distributed group that `mlx.launch` set up (MLX's own choice of
    backend), giving up after `timeout_s` seconds of waiting for the other ranks.

    Returns:
        The `mx.distributed.Group`.

    A process not started by `mlx.launch` gets a group of one rank (the whole model).
    A process joins once; later calls return the same group.

    Raises:
        PipelineError: the backend failed to connect.
    """

    global _group
    if _group is not None:
        return _group
    hostfile = os.environ.get("MLX_HOSTFILE")
    if hostfile and os.path.isfile(hostfile) and not Path(hostfile).read_text().strip():
        # mlx.launch -n 1 writes an empty host file, which MLX's ring cannot parse.
        del os.environ["MLX_HOSTFILE"]
    try:  # MLX's connect waits without a bound on some ranks
        with bounded(timeout_s, "the other ranks did not connect"):
            group = mx.distributed.init()
            mx.eval(mx.distributed.all_sum(mx.array(1), group=group, stream=mx.cpu))
    except RuntimeError as e:
        raise PipelineError(
            f"cannot join the pipeline ({e}); start every rank with mlx.launch, e.g. "
            "`mlx.launch --backend ring -n 2 -- expertstream generate --pipeline ...`"
        ) from None
    _group = group
    return group


# Counters of `GenerationResult.stats()` that add up over the stages' disjoint layers.
_SUMMED = tuple(k for k in REPORTED_STATS if k not in RATES)


def rank_stats(sm) -> dict:
    """This rank's cache counters over its lifetime (`CacheSnapshot.totals()` keys that
    `combine_stats` adds up, and `hit_rate`, `prefetch_accuracy`: None where undefined),
    its stage's decoder layers as `layers` [start, end), and `peak_memory_bytes` since the
    last reply began."""
    t = sm.snapshot().totals()
    return {
        "layers": [sm.stage.start, sm.stage.end],
        **{k: t[k] for k in _SUMMED},
        **rates(t),
        "peak_memory_bytes": int(mx.get_peak_memory()),
    }


def combine_stats(ranks: list[dict]) -> dict:
    """The stats JSON of a pipelined reply from every rank's `GenerationResult.stats()`
    (rank order): cache counters summed over ranks (their layers are disjoint), hit rate
    and prefetch accuracy recomputed, tokens and tokens/s of rank 0 (the sampler),
    `peak_memory_bytes` of the largest rank, and `ranks`: each rank's own figures."""
    out = dict(ranks[0])
    out.pop("layers", None)
    for key in _SUMMED:
        out[key] = sum(r[key] for r in ranks)
    out |= rates(out)
    out["peak_memory_bytes"] = max(r["peak_memory_bytes"] for r in ranks)
    out["ranks"] = ranks
    return out


def stage_of(config: dict, rank: int, size: int, where) -> Stage:
    """The stage of `rank` among `size` for the model of `config` (a parsed config.json
    at `where`), computed as `split` does on an unloaded model.

    Raises:
        ValueError: as `split`; engine.experts' errors for a config it cannot build.
    """
    return split(instantiate(config, where), rank, size)
