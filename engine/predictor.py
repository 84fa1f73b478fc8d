"""Ahead scheduling and prediction for the side region (the seed's VirtualPool).

While MoE layer L runs, the router of target layer T = target_for(L) is applied to L's
hidden state and its top experts are handed to the cache's prefetch primitive, so their
records are read in the background while layers L..T-1 compute. Layer indices here are
MoE indices (position among MoE layers), never decoder indices.
"""

from collections.abc import Callable

import mlx.core as mx
import numpy as np

from engine.config import StreamConfig


class GenerationStopped(Exception):
    """Raised inside a forward pass when the caller's stop request is seen; the forward's
    KV cache is left partial, so the reply ends there (engine.generate.generate)."""


class Predictor:
    """Decides which layer each MoE layer prefetches for, and submits the prediction.

    Args:
        cache: the store's `engine._ext.ExpertCache`.
        routers: per MoE layer, in MoE order, a function (n, hidden) -> (n, num_experts)
            router logits (`engine.experts.router_logits`), or None where the layer's
            router is not found: that layer is never a prefetch target.
        config: prefetch settings (prefetch, side_slots, ahead_lo, ahead_hi, cutoff).
    """

    def __init__(self, cache, routers: list[Callable | None], config: StreamConfig):
        self.cache = cache
        self.routers = routers
        self.num_layers = len(routers)
        self.enabled = config.prefetch and config.side_slots > 0
        self.budget = min(config.side_slots, cache.num_experts)
        self.ahead_lo = config.ahead_lo
        self.ahead_hi = config.ahead_hi
        self.cutoff = self.num_layers // 2 if config.cutoff is None else config.cutoff
        # The cache's primitives (acquire, prefetch) have no GPU kernel: on a GPU device
        # they are created on the CPU stream, which MLX orders with the GPU work.
        self.cpu_stream = mx.default_device() != mx.cpu
        self._last_layer = -1
        # Polled at every MoE layer call, so a stop lands mid-prefill too (set by generate).
        self.should_stop: Callable[[], bool] | None = None
        # Sees (MoE layer, int32 ids) of every MoE layer call; while set, every call takes
        # the synchronous path, which has the ids on the host (bench.device measures it).
        self.on_acquire: Callable[[int, np.ndarray], None] | None = None
        # An engine.trace.TraceRecorder: takes each call's lazy ids, on whichever path.
        self.recorder = None
        self._targets: set[int] = set()  # submitted in the current forward

    def target_for(self, layer: int) -> int | None:
        """MoE layer whose experts `layer` prefetches: layer + ahead_lo before `cutoff`,
        layer + ahead_hi from it; None past the last layer (never clamped, so each target
        gets at most one submission per forward)."""
        target = layer + (self.ahead_lo if layer < self.cutoff else self.ahead_hi)
        return target if target < self.num_layers else None

    def check_stop(self, layer: int) -> None:
        """Raises GenerationStopped when the caller asked to stop."""
        if self.should_stop is not None and self.should_stop():
            raise GenerationStopped(f"stopped at MoE layer {layer}")

    def predict(self, target: int, x: mx.array) -> mx.array:
        """Top-`budget` experts of `target`'s router for the last token of `x`.

        Args:
            x: (..., hidden) hidden state entering the current MoE layer.

        Returns:
            (budget,) uint32 expert ids, in no particular order (argpartition). A strided
            view: the cache's primitives read ids where they lie. Built from as few ops as
            it takes (one reshape, the router, argpartition, a slice), since it runs per MoE
            layer per decode token.
        """
        hidden = x.shape[-1]
        last = x.reshape(1, hidden) if x.size == hidden else x.reshape(-1, hidden)[-1:]
        logits = self.routers[target](last)
        n, k = logits.shape[-1], self.budget
        return mx.argpartition(logits, kth=n - k, axis=-1)[0, n - k :]

    def prefetch_token(self, layer: int, x: mx.array) -> mx.array | None:
        """A lazy uint8 scalar that, when evaluated, reserves and starts the fills
        predicted from `x` at MoE layer `layer`; None when nothing is prefetched
        (disabled, prefill of more than one token, no target layer, the target layer is
        complete so nothing of it can miss, or the target was already submitted in this
        forward: ahead_lo > ahead_hi can map two layers to one)."""
        if layer <= self._last_layer:
            self._targets.clear()  # the layer index wrapped: a new forward
        self._last_layer = layer
        if not self.enabled or x.size // x.shape[-1] != 1:
            return None
        target = self.target_for(layer)
        if (
            target is None
            or target in self._targets
            or self.routers[target] is None
            or self.cache.is_complete(target)
        ):
            return None
        self._targets.add(target)
        return self.cache.prefetch_op(target, self.predict(target, x), self.cpu_stream)
