"""`StreamedExperts`: mlx-lm's `SwitchGLU` / `SwitchMLP` computed on pool rows.

Patched into each MoE block in place of its stacked-experts module (`switch_mlp`,
`experts`, ...), it keeps mlx-lm's router, top-k and score mixing untouched. The router's
expert ids become pool rows through the cache's `acquire` (real hit, side hit or demand
load), and the layer runs the module's own computation (`engine.expert_compute`) with
those rows as `rhs_indices`, so every (token, expert) product is the one the resident
model computes.

Three paths, chosen per call by the cache's `plan` from shapes and residency alone:
- table (a call of a complete layer: every expert has a real slot, so nothing can miss
  or be evicted): rows = the layer's device-side expert->slot table indexed by the ids;
  no host work at all, on any device.
- stream-ordered (every other decode step, and any call with at most `expert_slots -
  pinned` ids): the rows are a lazy `acquire_op` that the cache evaluates on the CPU
  stream when the ids exist. Nothing waits on the router, so a whole token's graph is
  built and evaluated without a pipeline drain per layer; a miss costs its read, inside
  the stream. On MLX CUDA the same acquire is a kernel on the GPU's own stream that a
  host thread answers through mapped memory (`engine.device_acquire`), so a layer
  whose experts are cached costs no cross-stream hop; pool writes are then staged and
  copied by those kernels, and a complete layer whose targets are predicted sends its
  prediction the same way. Metal and the CPU keep `acquire_op`.
- synchronous (calls that may hold more distinct experts than evictable slots: prefill):
  the ids are read on the host once (the layer's one host wait), and misses beyond the
  slots stream through the scratch rows chunk by chunk, each read once, the next chunk's
  reads in flight while a chunk computes (`_over_capacity`). Where the pools are CUDA
  memory (`Predictor.layer_scratch`) the call's experts all go into the layer scratch
  at that wait instead, the misses in one copy, read ahead while the previous layer
  computed (`ExpertCache.load_layer`, `read_ahead`), and the layer computes on it as on a
  complete layer's table. A call of at least `WHOLE_LAYER_IDS` ids per expert (a long
  prompt) reads no ids at all: its whole layer goes into one of two banks, every expert
  in the row of its id, while the device computes the layer before on the other
  (`_whole_layer`).
"""

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from engine.cache import PLAN_STREAM, PLAN_SYNC, PLAN_TABLE
from engine.expert_compute import ExpertMajor
from engine.experts import ExpertMath
from engine.predictor import Predictor
from engine.store import LayerSpec


class StreamedExperts(nn.Module):
    """One MoE layer's experts, streamed.

    Args:
        predictor: the model's `Predictor` (owns the cache).
        moe_index: this layer's position among MoE layers.
        spec: the store's `LayerSpec` of this layer (segments, quantization).
        math: the replaced module's kind and activation (`ExpertModule.math`).
        compute: the model's choice of form for each call's expert math (mlx-lm's or
            expert-major), shared by its layers.
    """

    def __init__(
        self,
        predictor: Predictor,
        moe_index: int,
        spec: LayerSpec,
        math: ExpertMath,
        compute: ExpertMajor,
    ):
        super().__init__()
        self._math = math
        self._compute = compute
        self._predictor = predictor
        self._cache = predictor.cache
        self._index = moe_index
        self._quant = spec.quantization
        keys = [s.key for s in spec.segments]
        self._pool = dict(zip(keys, self._cache.pool(moe_index), strict=True))
        self._table = self._cache.table(moe_index)

    def _experts(self, x: mx.array, rows: mx.array, pool: dict | None = None) -> mx.array:
        """(..., k, D) expert outputs of x on `rows` of `pool` (this layer's pools when
        None), in the form `ExpertMajor` takes for the call."""
        pool = self._pool if pool is None else pool
        return self._compute.outputs(x, pool, rows, self._quant, self._math)

    def __call__(self, x: mx.array, indices: mx.array) -> mx.array:
        """x: (..., D) hidden states; indices: (..., k) routed expert ids.
        Returns (..., k, D) expert outputs, like the replaced module.

        Raises:
            GenerationStopped: the caller asked to stop (checked before any read).
        """
        self._predictor.begin_call(self._index)
        if self._predictor.recorder is not None:
            self._predictor.recorder.route(self._index, indices, x)
        hook = self._predictor.on_acquire
        plan = PLAN_SYNC if hook else self._cache.plan(self._index, indices.size, indices.shape[-1])
        if self._predictor.device_path and plan != PLAN_SYNC:
            targets = self._predictor.predicted(self._index, x)
            if plan == PLAN_STREAM or targets:
                device = self._predictor.device_acquire(x, indices.size)
                if device is not None:
                    return self._on_device(device, plan, x, indices, targets)
        if plan == PLAN_SYNC and hook is None and self._predictor.takes_whole(indices.size):
            return self._whole_layer(x, indices)
        if plan == PLAN_STREAM and self._predictor.staging:
            plan = PLAN_SYNC  # staged writes reach the pools through the acquire kernels only
        token = self._predictor.prefetch_token(self._index, x)
        if plan == PLAN_TABLE:
            y = self._experts(x, self._table[indices])
        elif plan == PLAN_STREAM:
            cpu_stream = self._predictor.cpu_stream
            after = None
            if token is not None and cpu_stream:
                # On a GPU the prefetch op runs on the CPU stream: it rides ahead of this
                # acquire there, where mx.depends would make the GPU wait for it (and decode
                # slower). On the CPU it stays behind the acquire, so this layer's demand
                # reads go before its fills.
                after, token = token, None
            rows = self._cache.acquire_op(self._index, indices, cpu_stream, after)
            y = self._experts(x, rows)
        else:
            ids = indices.astype(mx.int32)
            ahead = self._predictor.ahead_ids(self._index, x, indices.shape[-1])
            mx.eval(ids, *([] if ahead is None else [ahead]))  # the host sync of this call
            ids = np.asarray(ids)
            # Every kernel before it has run: staged pool writes can be made by the host.
            self._cache.set_staging(False)
            # It evaluated the layers before this one: a read that failed in their
            # over-capacity chunks is raised here, before anything more is read.
            self._cache.raise_stream_error()
            if hook is not None:
                hook(self._index, ids.copy())
            rows, missing = self._cache.acquire(self._index, ids)
            if missing and self._predictor.layer_scratch:
                y = self._on_layer_scratch(x, ids, rows, missing)
                if ahead is not None:  # after load_layer: the staging is free again
                    self._cache.read_ahead(self._index + 1, np.unique(np.asarray(ahead)).tolist())
            elif missing:
                y = self._over_capacity(x, ids, rows, missing)
            else:
                y = self._experts(x, mx.array(rows))
        return y if token is None else mx.depends(y, token)

    def _on_device(self, device, plan, x, indices, targets):
        """The table or stream-ordered path with the acquire and the prefetch as kernels on
        the GPU's stream (`engine.device_acquire`): the prediction of `targets` (the
        predictor's `predicted`) rides on this layer's acquire request, or on a request
        of its own beside the table path."""
        if targets:
            self._predictor.device_prefetch(device, self._index, x, targets)
        if plan == PLAN_TABLE:
            y = self._experts(x, self._table[indices])
            return mx.depends(y, device.prefetch(self._index, x)) if targets else y
        rows = device.rows(self._index, indices, x if targets else None)
        return self._experts(x, rows)

    def _whole_layer(self, x, indices):
        """A long prompt's call on the layer scratch: every expert of the layer in the row
        of its id of a bank (`Predictor.whole_bank`, `ExpertCache.load_whole`), so the
        router's ids are the rows and the host never reads them; the next layer's
        experts are read into the other bank's staging meanwhile (`read_layer`)."""
        bank = self._predictor.whole_bank(self._index, x)
        # The first such call of a forward waited for x: staged pool writes can then be
        # made by the host (the later ones find staging off).
        self._cache.set_staging(False)
        self._cache.raise_stream_error()
        self._cache.load_whole(self._index, bank)
        if self._index + 1 < self._cache.num_layers:
            self._cache.read_layer(self._index + 1, 1 - bank)
        scratch = dict(zip(self._pool, self._cache.layer_scratch(self._index, bank), strict=True))
        return self._experts(x, indices, scratch)

    def _on_layer_scratch(self, x, ids, rows, missing):
        """More distinct misses than evictable slots, where the predictor keeps a layer
        scratch: every expert of the call is put in it (`ExpertCache.load_layer`: the
        misses read once, the hits copied from their rows), and the layer computes on it
        as on a complete layer's table."""
        flat_ids, flat_rows = ids.reshape(-1), rows.reshape(-1)
        hit = flat_rows >= 0
        resident, first = np.unique(flat_ids[hit], return_index=True)
        at = self._cache.load_layer(
            self._index, missing, resident.tolist(), flat_rows[hit][first].tolist()
        )
        table = np.zeros(self._cache.num_experts, np.int32)
        table[missing + resident.tolist()] = at
        scratch = dict(zip(self._pool, self._cache.layer_scratch(self._index), strict=True))
        return self._experts(x, mx.array(table[ids]), scratch)

    def _over_capacity(self, x, ids, rows, missing):
        """More distinct misses than evictable slots: resident pairs run on their rows,
        misses go through the scratch rows chunk by chunk (`_streamed_chunks`), each
        expert read once; the outputs are put back in the (token, k) order of `ids`."""
        k = ids.shape[-1]
        tokens = x.reshape(-1, x.shape[-1])
        flat_ids, flat_rows = ids.reshape(-1), rows.reshape(-1)
        miss = flat_rows < 0
        groups, outputs = [], []
        resident = np.flatnonzero(~miss)
        if resident.size:
            groups.append(resident)
            outputs.append(self._pairs(tokens, resident, mx.array(flat_rows[resident]), k))
        for pairs, y in self._streamed_chunks(tokens, flat_ids, miss, missing, k):
            groups.append(pairs)
            outputs.append(y)
        order = np.concatenate(groups)
        y = mx.concatenate(outputs, axis=0)[mx.array(np.argsort(order))]
        return y.reshape(*ids.shape, y.shape[-1])

    def _streamed_chunks(self, tokens, flat_ids, miss, missing, k):
        """Yields (pairs, outputs) per chunk of `missing` (`engine._ext.ScratchStream`: two
        banks, chunk c + 1 read while chunk c computes). The layer stays one lazy graph:
        each chunk's rows come through a `scratch_step` op ordered after the previous
        chunk's output, so the host never waits on a chunk."""
        stream = self._cache.scratch_stream(self._index, missing)
        chunk_of = np.full(self._cache.num_experts, -1)
        row_of = np.zeros(self._cache.num_experts, np.int32)
        for c, (experts, scratch_rows) in enumerate(stream.chunks):
            chunk_of[experts], row_of[experts] = c, scratch_rows
        pair_chunk = np.where(miss, chunk_of[flat_ids], -1)
        y = None
        for c in range(len(stream.chunks)):
            pairs = np.flatnonzero(pair_chunk == c)
            chunk_rows = mx.array(row_of[flat_ids[pairs]])
            chunk_rows = self._cache.scratch_step(
                stream, c, chunk_rows, self._predictor.cpu_stream, y
            )
            y = self._pairs(tokens, pairs, chunk_rows, k)
            yield pairs, y

    def _pairs(self, tokens, pairs, pair_rows, k):
        """Expert outputs (len(pairs), D) of the flat (token, k) pairs `pairs` (numpy
        indices into the (tokens, k) ids), on `pair_rows` ((len(pairs),) int32 pool rows)."""
        x = tokens[mx.array(pairs // k)]
        return self._experts(x, pair_rows.reshape(-1, 1))[:, 0]
