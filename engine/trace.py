"""Routing traces: which experts each token was routed to, per MoE layer.

A `Trace` holds expert ids shaped `(tokens, moe_layers, top_k)` and the start token of
each generate call (`segments`). Traces come from three places:

- recorded from the engine: `record(sm)` hands every MoE layer call's lazy ids array, and
  the lazy top of its router's probabilities, to a `TraceRecorder`
  (`Predictor.recorder`), copied to numpy once evaluated
  (`expertstream generate --record-trace FILE.npz`, the app, `expertstream serve
  --record-trace N`); the calls take the path they would take unrecorded;
- published traces: the HD-MoE Mixtral JSON files (`{"0": [[a, b], ...], ...}`, one key per
  MoE layer), read by `load_trace`;
- generated: `random_trace` (uniform routing) and `local_trace` (temporal locality and
  skewed popularity, e.g. at the reuse rate measured on a real trace).

The `.npz` format: `ids` int16 (T, L, k), `segments` int64 (starts of generate calls),
`prefill` uint8 (T,) (1 for tokens of a forward of several tokens of one sequence: the
prompt, except its last token, which mlx-lm feeds alone; not a decode step of a batch,
whose rows are one token of each of its sequences), `num_experts` int; optionally the router's top-m
per (token, layer): `router_ids` int16 (T, L, m) and `router_probs` float32 (T, L, m)
(softmax over all experts, best first; m = `ROUTER_TOP`, at most the expert count); and
`real_slots` int64 (L,), the real slots per MoE layer of the cache that recorded it (the
budget it was recorded at; absent from traces written before it and from generated
ones). A recorded trace also holds the one forward mlx-lm runs ahead of the last token it
returns.
"""

import json
import threading
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx
import numpy as np

from engine.safe_io import atomic_write

ROUTER_TOP = 8  # router probabilities a recorded trace keeps per (token, layer)


@dataclass
class Trace:
    """Expert ids of a run.

    Attributes:
        name: a short label (file stem or generator name).
        ids: (tokens, moe_layers, top_k) int expert ids, distinct within a token and layer.
        num_experts: experts per MoE layer.
        segments: start token of each generate call, sorted, first 0.
        prefill: (tokens,) uint8, 1 where the token was part of a forward of several
            tokens.
        router_ids, router_probs: (tokens, moe_layers, m) int32 expert ids and float32
            router probabilities (softmax over all experts) of the router's top m, best
            first; None when the trace has no router scores.
        real_slots: (moe_layers,) int64 real slots per MoE layer of the cache it was
            recorded with (`MemoryPlan.real_slots` of `StreamedModel.plan`, the last one
            where a rebuild changed them); None where unknown (generated, or an older file).
    """

    name: str
    ids: np.ndarray
    num_experts: int
    segments: np.ndarray = field(default_factory=lambda: np.zeros(1, np.int64))
    prefill: np.ndarray | None = None
    router_ids: np.ndarray | None = None
    router_probs: np.ndarray | None = None
    real_slots: np.ndarray | None = None

    def __post_init__(self):
        if self.ids.ndim != 3:
            raise ValueError(
                f"trace {self.name}: ids must be (tokens, layers, k), got shape {self.ids.shape}"
            )
        if self.ids.size and (self.ids.min() < 0 or self.ids.max() >= self.num_experts):
            raise ValueError(f"trace {self.name}: expert ids outside [0, {self.num_experts})")
        if self.prefill is None:
            self.prefill = np.zeros(len(self.ids), np.uint8)
        if (self.router_ids is None) != (self.router_probs is None):
            raise ValueError(f"trace {self.name}: router_ids and router_probs come together")
        if self.router_ids is not None:
            shape = self.router_ids.shape
            if (
                self.router_probs.shape != shape
                or shape[:2] != self.ids.shape[:2]
                or not 1 <= shape[2] <= self.num_experts
            ):
                raise ValueError(
                    f"trace {self.name}: router scores of shape {shape} / "
                    f"{self.router_probs.shape} do not fit ids of shape {self.ids.shape}"
                )
            r = self.router_ids
            if r.size and (r.min() < 0 or r.max() >= self.num_experts):
                raise ValueError(f"trace {self.name}: router ids outside [0, {self.num_experts})")
        if self.real_slots is not None:
            r = self.real_slots
            if r.shape != (self.num_layers,) or r.min() < 1 or r.max() > self.num_experts:
                raise ValueError(
                    f"trace {self.name}: real_slots {r.tolist()} are not one count in "
                    f"[1, {self.num_experts}] per MoE layer ({self.num_layers})"
                )

    @property
    def num_tokens(self) -> int:
        return int(self.ids.shape[0])

    @property
    def num_layers(self) -> int:
        return int(self.ids.shape[1])

    @property
    def top_k(self) -> int:
        return int(self.ids.shape[2])

    @property
    def shape(self) -> tuple[int, int, int]:
        """(MoE layers, experts per layer, top-k)."""
        return (self.num_layers, self.num_experts, self.top_k)

    def head(self, tokens: int) -> "Trace":
        """The first `tokens` tokens (all if fewer)."""
        n = min(tokens, self.num_tokens)
        has_router = self.router_ids is not None
        return Trace(
            self.name,
            self.ids[:n],
            self.num_experts,
            self.segments[self.segments < n],
            self.prefill[:n],
            self.router_ids[:n] if has_router else None,
            self.router_probs[:n] if has_router else None,
            self.real_slots,
        )

    def router_dense(self, token: int) -> np.ndarray:
        """(moe_layers, num_experts) float32 router probabilities of `token`: the
        recorded top m, and the rest of the mass spread evenly over the other experts.

        Raises:
            ValueError: the trace has no router scores.
        """
        if self.router_ids is None:
            raise ValueError(f"trace {self.name} has no router scores")
        ids, probs = self.router_ids[token], self.router_probs[token]
        m = ids.shape[-1]
        rest = np.clip(1.0 - probs.sum(-1, keepdims=True), 0.0, 1.0)
        dense = np.repeat(rest / max(1, self.num_experts - m), self.num_experts, axis=-1)
        np.put_along_axis(dense, ids.astype(np.intp), probs, axis=-1)
        return dense.astype(np.float32)

    def save(self, path):
        """Writes the `.npz` form (see the module docstring) to `path` (a file name, given
        `.npz` when it has another suffix, as numpy does; or a binary file object) and
        returns it. A file name is written atomically (`engine.safe_io.atomic_write`): a
        run killed at any instant leaves the old file or the new one.

        Raises:
            OSError: the file cannot be written (an older file there is kept).
        """
        optional = {}
        if self.router_ids is not None:
            optional = {
                "router_ids": self.router_ids.astype(np.int16),
                "router_probs": self.router_probs.astype(np.float32),
            }
        if self.real_slots is not None:
            optional["real_slots"] = self.real_slots.astype(np.int64)
        arrays = {
            "ids": self.ids.astype(np.int16),
            "segments": self.segments,
            "prefill": self.prefill,
            "num_experts": np.int64(self.num_experts),
            **optional,
        }
        if hasattr(path, "write"):
            np.savez_compressed(path, **arrays)
            return path
        path = Path(path)
        if path.suffix != ".npz":
            path = path.with_name(path.name + ".npz")
        with atomic_write(path) as f:
            np.savez_compressed(f, **arrays)
        return path


def reuse_rate(trace: Trace) -> float:
    """Fraction of a token's experts that the previous token also used at the same layer
    (over consecutive tokens; uniform random routing gives about top_k / num_experts)."""
    ids = trace.ids
    if len(ids) < 2:
        return 0.0
    prev, cur = ids[:-1], ids[1:]
    hits = (cur[..., :, None] == prev[..., None, :]).any(-1)
    return float(hits.mean())


# What a trace file of each suffix must be, as an error message says it.
_TRACE_FORMATS = {
    ".npz": "a routing trace (.npz written by --record-trace or Trace.save)",
    ".json": "an HD-MoE trace (JSON: keys '0'..'L-1', lists of expert-id pairs)",
}


def load_trace(path: str | Path) -> Trace:
    """Reads a `.npz` trace written by `Trace.save`, or an HD-MoE JSON trace (segments
    found at the repeated routing of the first token, the BOS).

    Raises:
        ValueError: unknown suffix, a file that cannot be read, or content that is not
            such a trace (a cut or foreign .npz, invalid JSON); the message names the file.
    """
    path = Path(path)
    if path.suffix not in _TRACE_FORMATS:
        raise ValueError(f"{path}: unknown trace format (expected .npz or .json)")
    try:
        return _read_npz(path) if path.suffix == ".npz" else _read_hd_moe(path)
    except OSError as e:
        raise ValueError(f"{path}: cannot read it ({e.strerror or e})") from None
    except (zipfile.BadZipFile, EOFError, KeyError, ValueError, TypeError) as e:
        detail = e.args[0] if isinstance(e, KeyError) and e.args else e  # without quotes
        raise ValueError(f"{path}: not {_TRACE_FORMATS[path.suffix]}: {detail}") from None


def _read_npz(path: Path) -> Trace:
    with open(path, "rb") as f:
        if not zipfile.is_zipfile(f):  # np.load would try it as a pickle
            raise ValueError("not a complete .npz (zip) archive: cut short, or another file")
    with np.load(path) as z:
        has_router = "router_ids" in z
        return Trace(
            path.stem,
            z["ids"].astype(np.int32),
            int(z["num_experts"]),
            z["segments"].astype(np.int64),
            z["prefill"].astype(np.uint8),
            z["router_ids"].astype(np.int32) if has_router else None,
            z["router_probs"].astype(np.float32) if has_router else None,
            z["real_slots"].astype(np.int64) if "real_slots" in z else None,
        )


def _read_hd_moe(path: Path) -> Trace:
    data = json.loads(path.read_text())
    ids = np.stack([np.asarray(data[str(i)], dtype=np.int32) for i in range(len(data))], axis=1)
    s = np.sort(ids, -1)
    starts = np.flatnonzero((s == s[0]).all((1, 2)))
    return Trace(path.stem, ids, int(ids.max()) + 1, starts.astype(np.int64))


def random_trace(tokens: int, layers: int, num_experts: int, top_k: int, seed: int = 0) -> Trace:
    """Uniformly random routing: each token picks top_k distinct experts per layer."""
    rng = np.random.default_rng(seed)
    keys = rng.random((tokens, layers, num_experts))
    ids = np.argpartition(keys, top_k - 1, axis=-1)[..., :top_k].astype(np.int32)
    return Trace(f"random-{num_experts}x{top_k}", ids, num_experts)


def local_trace(
    tokens: int,
    layers: int,
    num_experts: int,
    top_k: int,
    reuse: float,
    skew: float = 1.0,
    seed: int = 0,
    name: str | None = None,
) -> Trace:
    """Routing with temporal locality and skewed popularity.

    Each of the previous token's experts (same layer) is kept with the probability that
    makes the expected reuse rate `reuse` (see `reuse_rate`); the other picks are drawn
    without replacement from a per-layer popularity distribution, Dirichlet(1/skew)
    (larger `skew`: more skewed; 0 gives uniform).
    """
    rng = np.random.default_rng(seed)
    base = top_k / num_experts
    keep = min(1.0, max(0.0, (reuse - base) / (1.0 - base)))
    if skew > 0:
        pop = rng.dirichlet(np.full(num_experts, 1.0 / skew), size=layers)
    else:
        pop = np.full((layers, num_experts), 1.0 / num_experts)
    ids = np.empty((tokens, layers, top_k), np.int32)
    for li in range(layers):
        prev = rng.choice(num_experts, top_k, replace=False, p=pop[li])
        for t in range(tokens):
            kept = prev[rng.random(top_k) < keep] if t else prev[:0]
            p = pop[li].copy()
            p[kept] = 0.0
            fill = rng.choice(num_experts, top_k - len(kept), replace=False, p=p / p.sum())
            prev = np.concatenate([kept, fill])
            ids[t, li] = prev
    label = name or f"local-{num_experts}x{top_k}-reuse{reuse:.2f}"
    return Trace(label, ids, num_experts)


class TraceRecorder:
    """Records the routed expert ids of every MoE layer call of a `StreamedModel`, and,
    when `router`, the top `ROUTER_TOP` of its router's probabilities, keeping the last
    `max_tokens` tokens (all when None).

    It costs the decode little: each layer call hands over its lazy ids array and hidden
    state (`Predictor.recorder`), whatever path the call takes (nothing is forced onto
    the synchronous path); the router's top probabilities are a small lazy computation on
    that hidden state (the router applied once more); a forward's arrays are copied to
    numpy once a later forward has begun two forwards on, when mlx-lm's pipelined loop
    has evaluated its ids, and the rest by `settle()`. A forward cut short (a stop
    mid-forward) is dropped.

    Threads: `route` and `settle` run on the model's thread (MLX arrays stay there);
    `trace` may be called from any thread and then returns the settled forwards; on the
    thread that created the recorder it settles first. Use as a context manager (or
    call `close`): on exit the recorder settles and unhooks. `begin_segment()` marks the
    start of a generate call.

    Raises:
        ValueError: max_tokens < 1.
    """

    def __init__(self, sm, max_tokens: int | None = None, router: bool = True):
        self._router = router
        if max_tokens is not None and max_tokens < 1:
            raise ValueError(f"trace tokens {max_tokens}: must be >= 1")
        self.max_tokens = max_tokens
        self._lock = threading.Lock()
        # (ids (n, L, k) int16, router ids (n, L, m) int16 and router probs (n, L, m) float32
        # or None (no router found), starts a segment, is a prefill)
        self._blocks: list[tuple[np.ndarray, np.ndarray, np.ndarray, bool, bool]] = []
        self._tokens = 0  # rows in _blocks
        # forwards not yet copied: [(layer, ids, router ids, router probs arrays), ...]
        self._pending: list[list] = []
        self._segment_next = False
        self._sm = None
        self.attach(sm)

    def attach(self, sm) -> None:
        """Records `sm` from now on (a rebuilt model of the same store keeps the trace so
        far: routing does not depend on the cache). Call it on `sm`'s thread.

        Raises:
            ValueError: `sm` has another layer count, expert count or top-k.
        """
        m = sm.store.manifest
        shape = (sm.cache.num_layers, m.num_experts, m.top_k)
        if self._sm is not None:
            if shape != self.shape:
                raise ValueError(f"cannot continue a {self.shape} trace on a {shape} model")
            self.close()
        self.shape = shape
        self._real_slots = np.asarray(sm.plan.real_slots, np.int64)
        self._router_top = min(ROUTER_TOP, m.num_experts)
        self._thread = threading.get_ident()
        self._sm = sm
        sm.predictor.recorder = self

    def route(self, layer: int, ids, x) -> None:
        """Takes one MoE layer call's ids (an MLX array, lazy or not, (..., k)) and the
        hidden states entering the layer (..., hidden), for its router's probabilities."""
        if not self._pending or layer <= self._pending[-1][-1][0]:
            if self._pending:
                # The forward just built is queued for evaluation by now; its router
                # figures are not part of its output, so queue them behind it: copied
                # with a blocking eval later, they would wait for the forward in flight
                # and undo mlx-lm's overlap of building one token with computing another.
                mx.async_eval([a for c in self._pending[-1] if c[2] is not None for a in c[2:]])
            if len(self._pending) >= 2:  # evaluated by now in mlx-lm's pipelined loop
                self._take(self._pending[:-1])
                del self._pending[:-1]
            self._pending.append([])
        router = self._sm.predictor.routers[layer] if self._router else None
        if router is None:  # not asked for, or a family whose router is not found: ids only
            self._pending[-1].append((layer, ids, None, None))
            return
        probs = mx.softmax(router(x.reshape(-1, x.shape[-1])).astype(mx.float32), axis=-1)
        top = mx.argsort(-probs, axis=-1)[..., : self._router_top]
        self._pending[-1].append((layer, ids, top, mx.take_along_axis(probs, top, axis=-1)))

    def begin_segment(self) -> None:
        """Marks the next forward as the start of a generate call."""
        self.settle()
        self._segment_next = True

    def settle(self) -> None:
        """Copies every pending forward to numpy (waits for any still computing)."""
        self._take(self._pending)
        self._pending = []

    def _take(self, forwards: list[list]) -> None:
        n_layers, _, k = self.shape
        m = self._router_top
        for calls in forwards:
            if len(calls) != n_layers:
                continue  # cut short by a stop: its arrays may never be evaluated
            first = calls[0][1]
            rows = first.size // k
            # (sequences, tokens, k) ids: several tokens of a sequence make a prefill; a
            # batch's decode step is one token of each (ids without that axis: rows > 1).
            prefill = (first.shape[-2] if first.ndim >= 3 else rows) > 1
            block = np.empty((rows, n_layers, k), np.int16)
            for li, (_, ids, _, _) in enumerate(calls):
                block[:, li] = np.asarray(ids).reshape(rows, k)
            top = probs = None
            if all(t is not None for _, _, t, _ in calls):
                top = np.empty((rows, n_layers, m), np.int16)
                probs = np.empty((rows, n_layers, m), np.float32)
                mx.eval([a for _, _, t, p in calls for a in (t, p)])
                for li, (_, _, t, p) in enumerate(calls):
                    top[:, li] = np.asarray(t).reshape(rows, m)
                    probs[:, li] = np.asarray(p).reshape(rows, m)
            with self._lock:
                self._blocks.append((block, top, probs, self._segment_next, prefill))
                self._tokens += len(block)
                self._segment_next = False
                self._trim()

    def _trim(self) -> None:
        limit = self.max_tokens
        while limit is not None and self._tokens > limit:
            block, top, probs, starts, prefill = self._blocks[0]
            over = self._tokens - limit
            if over >= len(block):
                self._blocks.pop(0)
                self._tokens -= len(block)
            else:  # keep the tail of a long prefill
                cut = (None, None) if top is None else (top[over:], probs[over:])
                self._blocks[0] = (block[over:], *cut, starts, prefill)
                self._tokens -= over

    def set_max_tokens(self, max_tokens: int | None) -> None:
        """Changes the bound (drops the oldest tokens beyond it); any thread.

        Raises:
            ValueError: max_tokens < 1.
        """
        if max_tokens is not None and max_tokens < 1:
            raise ValueError(f"trace tokens {max_tokens}: must be >= 1")
        with self._lock:
            self.max_tokens = max_tokens
            self._trim()

    @property
    def num_tokens(self) -> int:
        """Tokens of the settled forwards."""
        return self._tokens

    def close(self) -> None:
        """Settles and stops recording (the trace so far stays readable)."""
        if self._sm is None:
            return
        self.settle()
        if self._sm.predictor.recorder is self:
            self._sm.predictor.recorder = None
        self._sm = None

    def __enter__(self) -> "TraceRecorder":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def trace(self, name: str = "recorded") -> Trace:
        """The recorded tokens as a Trace: a forward of n tokens gives n rows (`prefill`
        1 where they are several tokens of one sequence), each generate call (or burst of
        a server's batch) starts a segment."""
        if self._sm is not None and threading.get_ident() == self._thread:
            self.settle()
        n_layers, num_experts, k = self.shape
        with self._lock:
            blocks = list(self._blocks)
        if not blocks:
            ids = np.zeros((0, n_layers, k), np.int32)
            return Trace(name, ids, num_experts, real_slots=self._real_slots)
        sizes = [len(b[0]) for b in blocks]
        starts = np.cumsum([0, *sizes[:-1]])
        segments = {0} | {int(s) for s, b in zip(starts, blocks, strict=True) if b[3]}
        scored = all(b[1] is not None for b in blocks)  # router scores for every token
        return Trace(
            name,
            np.concatenate([b[0] for b in blocks]).astype(np.int32),
            num_experts,
            np.asarray(sorted(segments), np.int64),
            np.concatenate([np.full(len(b[0]), b[4], np.uint8) for b in blocks]),
            np.concatenate([b[1] for b in blocks]).astype(np.int32) if scored else None,
            np.concatenate([b[2] for b in blocks]) if scored else None,
            self._real_slots,
        )


def record(sm, max_tokens: int | None = None, router: bool = True) -> TraceRecorder:
    """Starts recording the routing of `sm` (a `StreamedModel`), keeping the last
    `max_tokens` tokens (all when None), with the router's top probabilities when
    `router`; see `TraceRecorder`."""
    return TraceRecorder(sm, max_tokens, router)
