"""Routing traces: which experts each token was routed to, per MoE layer.

A `Trace` holds expert ids shaped `(tokens, moe_layers, top_k)` and the start token of
each generate call (`segments`). Traces come from three places:

- recorded from the engine: `record(sm)` sets the model's acquire hook
  (`Predictor.on_acquire`) so that every MoE layer call also stores its ids
  (`expertstream generate --record-trace FILE.npz`); while recording, every call takes
  the synchronous path, which has the ids on the host; otherwise nothing changes;
- published traces: the HD-MoE Mixtral JSON files (`{"0": [[a, b], ...], ...}`, one key per
  MoE layer), read by `load_trace`;
- generated: `random_trace` (uniform routing) and `local_trace` (temporal locality and
  skewed popularity, e.g. at the reuse rate measured on a real trace).

The `.npz` format: `ids` int16 (T, L, k), `segments` int64 (starts of generate calls),
`prefill` uint8 (T,) (1 for tokens of a forward of several tokens: the prompt, except its
last token, which mlx-lm feeds alone), `num_experts` int. A recorded trace also holds the
one forward mlx-lm runs ahead of the last token it returns.
"""

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np


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
    """

    name: str
    ids: np.ndarray
    num_experts: int
    segments: np.ndarray = field(default_factory=lambda: np.zeros(1, np.int64))
    prefill: np.ndarray | None = None

    def __post_init__(self):
        if self.ids.ndim != 3:
            raise ValueError(
                f"trace {self.name}: ids must be (tokens, layers, k), got shape {self.ids.shape}"
            )
        if self.ids.size and (self.ids.min() < 0 or self.ids.max() >= self.num_experts):
            raise ValueError(f"trace {self.name}: expert ids outside [0, {self.num_experts})")
        if self.prefill is None:
            self.prefill = np.zeros(len(self.ids), np.uint8)

    @property
    def num_tokens(self) -> int:
        return int(self.ids.shape[0])

    @property
    def num_layers(self) -> int:
        return int(self.ids.shape[1])

    @property
    def top_k(self) -> int:
        return int(self.ids.shape[2])

    def head(self, tokens: int) -> "Trace":
        """The first `tokens` tokens (all if fewer)."""
        n = min(tokens, self.num_tokens)
        return Trace(
            self.name,
            self.ids[:n],
            self.num_experts,
            self.segments[self.segments < n],
            self.prefill[:n],
        )

    def save(self, path: str | Path) -> Path:
        """Writes the `.npz` form (see the module docstring)."""
        path = Path(path)
        np.savez_compressed(
            path,
            ids=self.ids.astype(np.int16),
            segments=self.segments,
            prefill=self.prefill,
            num_experts=np.int64(self.num_experts),
        )
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


def load_trace(path: str | Path) -> Trace:
    """Reads a `.npz` trace written by `Trace.save`, or an HD-MoE JSON trace (segments
    found at the repeated routing of the first token, the BOS).

    Raises:
        ValueError: unknown suffix or malformed content (the message names the file).
    """
    path = Path(path)
    if path.suffix == ".npz":
        with np.load(path) as z:
            return Trace(
                path.stem,
                z["ids"].astype(np.int32),
                int(z["num_experts"]),
                z["segments"].astype(np.int64),
                z["prefill"].astype(np.uint8),
            )
    if path.suffix == ".json":
        data = json.loads(path.read_text())
        try:
            layers = [np.asarray(data[str(i)], dtype=np.int32) for i in range(len(data))]
            ids = np.stack(layers, axis=1)
        except (KeyError, ValueError) as e:
            raise ValueError(
                f"{path}: not an HD-MoE trace (keys '0'..'L-1', lists of expert-id pairs): {e}"
            ) from None
        s = np.sort(ids, -1)
        starts = np.flatnonzero((s == s[0]).all((1, 2)))
        return Trace(path.stem, ids, int(ids.max()) + 1, starts.astype(np.int64))
    raise ValueError(f"{path}: unknown trace format (expected .npz or .json)")


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
    """Records the routed expert ids of every MoE layer call of a `StreamedModel`.

    Use as a context manager (or call `close`): on exit the acquire hook is removed.
    `begin_segment()` marks the start of a generate call.
    """

    def __init__(self, sm):
        self._sm = sm
        self._calls: list[tuple[int, np.ndarray]] = []
        self._segment_calls: list[int] = []
        sm.predictor.on_acquire = lambda layer, ids: self._calls.append((layer, ids))

    def begin_segment(self) -> None:
        self._segment_calls.append(len(self._calls))

    def close(self) -> None:
        self._sm.predictor.on_acquire = None

    def __enter__(self) -> "TraceRecorder":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def trace(self, name: str = "recorded") -> Trace:
        """The calls so far as a Trace: consecutive calls form one forward (a new one
        starts when the layer index does not increase); a forward of n tokens gives n
        trace rows.

        Raises:
            ValueError: a forward did not visit every MoE layer once (e.g. recording
                started in the middle of a forward).
        """
        n_layers = self._sm.cache.num_layers
        k = self._sm.store.manifest.top_k
        rows, prefill, segments = [], [], []
        seg_marks = set(self._segment_calls)
        forward: list[np.ndarray] = []
        token = 0

        def flush():
            nonlocal token
            if not forward:
                return
            if len(forward) != n_layers:
                raise ValueError(
                    f"a recorded forward visited {len(forward)} of {n_layers} MoE layers"
                )
            block = np.stack(forward, axis=1)  # (n, L, k)
            rows.append(block)
            prefill.append(np.full(len(block), len(block) > 1, np.uint8))
            token += len(block)
            forward.clear()

        last = n_layers
        for i, (layer, ids) in enumerate(self._calls):
            if layer <= last:
                flush()
            if i in seg_marks:
                segments.append(token)
            forward.append(ids.reshape(-1, k).astype(np.int32))
            last = layer
        flush()
        if not rows:
            ids = np.zeros((0, n_layers, k), np.int32)
            return Trace(name, ids, self._sm.store.manifest.num_experts)
        return Trace(
            name,
            np.concatenate(rows),
            self._sm.store.manifest.num_experts,
            np.asarray(sorted(set(segments) | {0}), np.int64),
            np.concatenate(prefill),
        )


def record(sm) -> TraceRecorder:
    """Starts recording the routing of `sm` (a `StreamedModel`); see `TraceRecorder`."""
    return TraceRecorder(sm)
