"""Ahead scheduling and prediction for the side region.

While MoE layer L runs, the router of each target layer T in targets_for(L) is applied to
L's hidden state and its top experts are handed to the cache's prefetch primitive, so their
records are read in the background while layers L..T-1 compute. Layer indices here are
MoE indices (position among MoE layers), never decoder indices.

The distance is `ahead_lo` before `cutoff` and `ahead_hi` from it. One target L + distance
per layer would skip layers where the distance grows (with the defaults (1, 2, half the
layers), the layer after the cutoff would never be predicted, and it would miss far more
than any other); so every layer from 1 on is some layer's target, the nearer one first,
and none is predicted twice in a forward.

The primitive applies the router itself, from a dense copy (`engine._ext.Router`) made on
the first prediction for each target: one op per MoE layer per token instead of five
(reshape, router, argpartition, slice, prefetch). On a CPU of few cores those five cost
about as much as the reads they hide.
"""

from collections.abc import Callable, Sequence

import mlx.core as mx
import numpy as np

from engine._ext import Router
from engine.config import StreamConfig
from engine.device_acquire import DeviceAcquire
from engine.memory_plan import mailbox_fill_slots, mailbox_ids

# Ids per expert from which an over-capacity call on the layer scratch takes every expert
# of its layer as routed (`Predictor.takes_whole`): a call of n ids leaves a given expert
# out with odds of about exp(-n / num_experts) under balanced routing, under 2% from 4 on,
# so reading the whole layer costs little beyond the routed experts, and spares the host
# wait that reading the ids would cost.
WHOLE_LAYER_IDS = 4


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
        tier_slots: host-tier slots per MoE layer of the mailbox, where the device
            acquire makes one (`engine.memory_plan.MemoryPlan.tier_slots`; 0: none).
    """

    def __init__(
        self, cache, routers: list[Callable | None], config: StreamConfig, tier_slots: int = 0
    ):
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
        # On MLX CUDA a decode step's acquire is a kernel on the GPU's stream instead
        # (engine.device_acquire), made with the first call that can take it: whether
        # this model's calls may (`device_acquire` makes the kernels).
        cuda = getattr(mx, "cuda", None)
        self.device_path = (
            config.device_acquire
            and self.cpu_stream
            and cuda is not None
            and cuda.is_available()
            and cache.pool_writes == "cuda"
        )
        self._device: DeviceAcquire | None = None
        # Where the pools are CUDA memory, an over-capacity call puts its experts in the
        # layer scratch (`ExpertCache.load_layer`) at its one host wait, the device idle,
        # and reads the next layer's predicted misses while the device computes
        # (`ahead_ids`); a long prompt's call its whole layer, reading no ids
        # (`takes_whole`). The scratch stream's rows would be written by a cache thread
        # while a graph runs, a CUDA runtime call that can wait behind a spinning kernel
        # (MLX's wait for a CPU-stream op, or an acquire kernel), and chunk by chunk.
        self.layer_scratch = cache.pool_writes == "cuda"
        # Host-tier slots per MoE layer (0: none, off MLX CUDA or with host memory off),
        # as the load's memory plan sized them.
        self.tier_slots = tier_slots if self.device_path else 0
        self.fill_stream = config.fill_stream
        # The rows of a batch's decode step (one token per reply): each row's hidden state
        # is a prediction of its own (`prefetch_op` rows, `AcquireMailbox` x_rows).
        self.batch_rows = config.max_batch
        self._targets = _schedule(self.num_layers, self.ahead_lo, self.ahead_hi, self.cutoff)
        # Polled at every MoE layer call, so a stop lands mid-prefill too (set by generate).
        self.should_stop: Callable[[], bool] | None = None
        # Sees (MoE layer, int32 ids) of every MoE layer call; while set, every call takes
        # the synchronous path, which has the ids on the host (bench.device measures it).
        self.on_acquire: Callable[[int, np.ndarray], None] | None = None
        # An engine.trace.TraceRecorder: takes each call's lazy ids, on whichever path.
        self.recorder = None
        self._dense: dict[int, Router] = {}  # target -> its router's copy, made on first use
        # The last whole-layer call of this forward (`whole_bank`): its MoE layer, input
        # and bank; and the last call's MoE layer (`begin_call`).
        self._whole: tuple[int, mx.array, int] | None = None
        self._last_layer = -1

    def targets_for(self, layer: int) -> range:
        """MoE layers that `layer` prefetches, nearest first: up to layer + ahead_lo
        before `cutoff` (layer + ahead_hi from it), from the first layer no earlier layer
        covers; empty past the last layer (see the module's docstring)."""
        return self._targets[layer]

    def begin_call(self, layer: int) -> None:
        """A call of MoE layer `layer` begins (every path): one at or below the last
        call's layer starts a forward, in which no whole-layer call was made yet
        (`whole_bank`), whether the forward before ended or stopped midway.

        Raises:
            GenerationStopped: the caller asked to stop.
        """
        if layer <= self._last_layer:
            self._whole = None
        self._last_layer = layer
        if self.should_stop is not None and self.should_stop():
            raise GenerationStopped(f"stopped at MoE layer {layer}")

    def router(self, target: int, hidden: int) -> Router:
        """The dense copy of `target`'s router (`dense_router`), made on first use: after
        loading, which may replace router modules, and only for layers that are targets."""
        router = self._dense.get(target)
        if router is None:
            router = self._dense[target] = dense_router(self.routers[target], hidden)
        return router

    def predicted(self, layer: int, x: mx.array) -> list[int]:
        """The targets of `layer` to predict from `x` ((..., hidden)): none when prefetch
        is off or x is more than `batch_rows` tokens (a prompt's prefill; a decode step has
        one per reply), else those with a router that are not complete (a complete layer
        cannot miss)."""
        if not self.enabled or x.size // x.shape[-1] > self.batch_rows:
            return []
        return [
            t
            for t in self._targets[layer]
            if self.routers[t] is not None and not self.cache.is_complete(t)
        ]

    def ahead_ids(self, layer: int, x: mx.array, k: int) -> mx.array | None:
        """Lazy (n, k) int32 ids that the next MoE layer's router picks for `x` (n tokens
        of `layer`'s input, (..., hidden)): its predicted experts, read ahead into the
        layer scratch while `layer` computes (`ExpertCache.read_ahead`); None without
        the layer scratch, after the last layer, or where the next router is not found.
        The ids are evaluated with `layer`'s own, at its one host wait."""
        nxt = layer + 1
        if not self.layer_scratch or nxt >= self.num_layers or self.routers[nxt] is None:
            return None
        logits = self.routers[nxt](x.reshape(-1, x.shape[-1]))
        return mx.argpartition(-logits, kth=k - 1, axis=-1)[:, :k].astype(mx.int32)

    def takes_whole(self, n: int) -> bool:
        """Whether an over-capacity call of `n` ids takes its whole layer into the layer
        scratch without reading its ids (`ExpertCache.load_whole`): with the layer
        scratch, from `WHOLE_LAYER_IDS` ids per expert on."""
        return self.layer_scratch and n >= WHOLE_LAYER_IDS * self.cache.num_experts

    def whole_bank(self, layer: int, x: mx.array) -> int:
        """The layer-scratch bank (0 or 1) for a whole-layer call of MoE layer `layer`
        whose input is `x`, once every computation that read it before has run. The two
        banks alternate: the call before this one, in the same forward, used the other,
        and the one before that used this one and fed that call's input, so the host
        submits `x` and waits for that input while the device computes the call before.
        The first such call of a forward (`begin_call`) waits for `x` itself, its layer
        read into bank 0's staging meanwhile (`ExpertCache.read_layer`)."""
        if self._whole is not None:
            mx.async_eval(x)
            mx.eval(self._whole[1])
            bank = 1 - self._whole[2]
        else:
            bank = 0
            self.cache.read_layer(layer, bank)
            mx.eval(x)
        self._whole = (layer, x, bank)
        return bank

    def prefetch_token(self, layer: int, x: mx.array) -> mx.array | None:
        """A lazy uint8 scalar that, when evaluated, reserves and starts the fills
        predicted from `x` (every reply's row of a decode step, up to `batch_rows`) at MoE
        layer `layer` for each of its targets (one prefetch op each, chained through
        `after`); None when nothing is predicted (`predicted`)."""
        token = None
        for target in self.predicted(layer, x):
            router = self.router(target, x.shape[-1])
            token = self.cache.prefetch_op(
                target, x, router, self.budget, self.cpu_stream, token, self.batch_rows
            )
        return token

    def device_acquire(self, x: mx.array, n: int) -> DeviceAcquire | None:
        """The kernels that acquire `n` ids of a layer whose input is `x` on the GPU's
        stream, or None where that call takes another path (another backend,
        `StreamConfig.device_acquire` off, or more ids than a request holds).

        The first call sizes the mailbox: requests of up to twice its ids (at least 16),
        and staging slots for twice the prefetch budget of fills (at least 16)."""
        if not self.device_path:
            return None
        if self._device is None:
            self._make_device(x.shape[-1], n)
        device = self._device
        return device if n <= device.max_ids and x.shape[-1] == device.hidden else None

    @property
    def mailbox(self):
        """The acquire kernels' `AcquireMailbox` (its counters), or None before the
        first device acquire or where there is none."""
        return None if self._device is None else self._device.mailbox

    def set_fill_stream(self, on: bool) -> None:
        """Prefetch fills copied by the fill stream beside the compute, or with the next
        answer's copies (`StreamConfig.fill_stream`)."""
        self.fill_stream = on
        if self._device is not None:
            self._device.fill_stream = on

    def start_device(self, hidden: int | None, n: int) -> None:
        """What a model load calls, so that allocating and page-locking is part of the
        load, not of the first reply: the layer scratch's banks where it is used
        (`layer_scratch`), and the acquire kernels for MoE inputs of `hidden` features
        and requests of `n` ids where they are (`device_path`, as `device_acquire` would
        make them), with the host tier; with `hidden` None (not in the model's config),
        the kernels are made by the first call that takes them.

        Raises:
            MemoryError: the layer scratch cannot be allocated.
            RuntimeError: the CUDA runtime refused to map the mailbox's memory.
        """
        if self.layer_scratch:
            for layer in range(self.cache.num_layers):
                for bank in (0, 1):
                    self.cache.layer_scratch(layer, bank)
        if self.device_path and self._device is None and hidden is not None:
            self._make_device(hidden, n)

    def _make_device(self, hidden: int, n: int) -> None:
        # Sized as the load's memory plan counted its staging.
        self._device = DeviceAcquire(
            self.cache,
            hidden,
            mailbox_ids(n),
            mailbox_fill_slots(self.budget),
            self.tier_slots,
            self.fill_stream,
            self.batch_rows,
        )

    @property
    def staging(self) -> bool:
        """Whether pool writes are staged for the acquire kernels now: a call that takes
        no kernel must then take the synchronous path, which writes them first."""
        return self._device is not None and self.cache.staging_on

    def device_prefetch(self, device: DeviceAcquire, layer: int, x: mx.array, targets: list[int]):
        """Hands `layer`'s prediction of `targets` (`predicted`) to the mailbox's thread
        (`DeviceAcquire.set_prefetch`), for the request that carries x's last tokens."""
        routers = [self.router(t, x.shape[-1]) for t in targets]
        device.set_prefetch(layer, targets, routers, self.budget)


def prefetch_targets(routed: Sequence[bool]) -> list[bool]:
    """Whether each MoE layer is a prefetch target, given whether its router was found
    (`routed[i]`): every layer after the first (`_schedule` covers each one, under any
    distances and cutoff) that has a router. The cache gives the others' side rows to
    their real regions (`engine.memory_plan.held_rows`)."""
    return [li > 0 and bool(r) for li, r in enumerate(routed)]


def _schedule(num_layers: int, ahead_lo: int, ahead_hi: int, cutoff: int) -> list[range]:
    """Per MoE layer, the targets it prefetches (`Predictor.targets_for`): every layer from
    1 to num_layers - 1 in exactly one range, each source reaching layer + its distance."""
    out, covered = [], 0  # layers 1..covered are some earlier layer's targets
    for layer in range(num_layers):
        reach = min(layer + (ahead_lo if layer < cutoff else ahead_hi), num_layers - 1)
        out.append(range(max(covered, layer) + 1, reach + 1))
        covered = max(covered, reach)
    return out


def dense_router(logits: Callable[[mx.array], mx.array], hidden: int) -> Router:
    """A dense copy of a linear router (`engine.experts.router_logits`: Linear,
    QuantizedLinear or a gate matrix, any bias, extra logits cut off): bias = logits(0) and
    weight = the vector-Jacobian product of logits with the (num_experts, num_experts)
    identity, in float32. Both are exact: a Linear's bfloat16 weight, a QuantizedLinear's
    dequantized one.

    The product costs num_experts^2 x hidden multiply-adds, where putting the (hidden,
    hidden) identity through the router costs hidden^2 x num_experts: at hidden 7168 and
    256 experts, about 28 times less work, paid by the first decode token for every
    target layer.

    Returns:
        `engine._ext.Router` of weight (num_experts, hidden) and bias (num_experts,).
    """
    bias = logits(mx.zeros((1, hidden), mx.float32)).astype(mx.float32)
    n = bias.shape[-1]
    _, (weight,) = mx.vjp(
        lambda x: logits(x).astype(mx.float32),
        [mx.zeros((n, hidden), mx.float32)],
        [mx.eye(n, dtype=mx.float32)],
    )
    return Router(np.ascontiguousarray(np.asarray(weight)), np.asarray(bias)[0])
