"""The two approaches peers use instead of an application cache, on our own store files.

- "pagecache" (flash-moe's "trust the OS"): every MoE call reads each routed expert's
  record with one buffered `pread` from the blob file, every time; the OS page cache is
  the only cache (bounded by the worker's memory cgroup).
- "mmap" (llama.cpp's default): the blob files are memory-mapped and each call gathers
  the routed records out of the mapping (page faults, kernel read-ahead), every time.
  MLX cannot compute on a foreign mapping (`mx.load` reads safetensors into MLX-owned
  buffers, and `mx.array(buffer)` copies), so the gathered records are copied into MLX
  arrays; the copy is a memcpy of the routed records only, the faults are the cost
  being measured.

Both replace each `StreamedExperts` of a model loaded with one real-region slot and run
the same expert computation on the fetched records, so the outputs are the engine's; each
layer is evaluated before the next one fetches (as these peers compute), so the fetched
records of one layer at most are held.
"""

import os

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from engine.config import StreamConfig
from engine.expert_compute import ExpertMajor
from engine.experts import ExpertMath, replace
from engine.model import StreamedModel, load
from engine.store import DTYPES, LayerSpec
from engine.streamed_layer import StreamedExperts

PEER_MODES = ("pagecache", "mmap")


class FetchCounters:
    """Records fetched by the peer layers of one model."""

    def __init__(self):
        self.records = 0
        self.bytes = 0


def _segment_array(records: np.ndarray, seg) -> mx.array:
    part = np.ascontiguousarray(records[:, seg.offset : seg.offset + seg.nbytes])
    return mx.array(part).view(DTYPES[seg.dtype]).reshape(len(records), *seg.shape)


class PeerExperts(StreamedExperts):
    """One MoE layer computed on records fetched per call by `mode` (see PEER_MODES)."""

    def __init__(
        self,
        spec: LayerSpec,
        path: str,
        num_experts: int,
        mode: str,
        math: ExpertMath,
        counters: FetchCounters,
        compute: ExpertMajor,
    ):
        nn.Module.__init__(self)
        if mode not in PEER_MODES:
            raise ValueError(f"peer mode {mode!r} not in {PEER_MODES}")
        self._math = math
        self._compute = compute
        self._quant = spec.quantization
        self._spec = spec
        self._mode = mode
        self._counters = counters
        self._fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        self._map = None
        if mode == "mmap":
            self._map = np.memmap(path, np.uint8, "r", shape=(num_experts, spec.stride))

    def _fetch(self, experts: np.ndarray) -> np.ndarray:
        n, rb = len(experts), self._spec.record_bytes
        self._counters.records += n
        self._counters.bytes += n * rb
        if self._map is not None:
            return self._map[experts, :rb]
        out = np.empty((n, rb), np.uint8)
        for i, e in enumerate(experts):
            got = os.preadv(self._fd, [out[i]], int(e) * self._spec.stride)
            if got != rb:
                raise OSError(f"short read of expert {e}: {got} of {rb} bytes")
        return out

    def __call__(self, x: mx.array, indices: mx.array) -> mx.array:
        ids = np.asarray(indices.astype(mx.int32))
        experts, local = np.unique(ids, return_inverse=True)
        records = self._fetch(experts)
        self._pool = {s.key: _segment_array(records, s) for s in self._spec.segments}
        rows = mx.array(local.reshape(ids.shape).astype(np.int32))
        y = self._experts(x, rows)
        # Computed layer by layer, as these peers do: the fetched records are released
        # here instead of piling up in the lazy graph of the whole forward.
        mx.eval(y)
        self._pool = {}
        return y

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def load_peer(store_path, mode: str) -> tuple[StreamedModel, FetchCounters]:
    """The model of the store at `store_path` with every MoE layer replaced by a
    `PeerExperts` of `mode`. The engine's own cache is opened with one slot and one
    scratch row per layer and never used."""
    sm = load(store_path, StreamConfig(expert_slots=1, scratch_slots=1))
    counters = FetchCounters()
    streamed = sorted(
        (m for m in sm.model.modules() if isinstance(m, StreamedExperts)), key=lambda m: m._index
    )
    for layer, spec in zip(streamed, sm.store.manifest.layers, strict=True):
        peer = PeerExperts(
            spec,
            str(sm.store.blob_path(spec)),
            sm.store.manifest.num_experts,
            mode,
            layer._math,
            counters,
            layer._compute,
        )
        replace(sm.model, spec.module, peer)
    return sm, counters
