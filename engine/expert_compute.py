"""The expert math of mlx-lm's `SwitchGLU` and `SwitchMLP`, on pool rows, in two forms.

`expert_outputs` mirrors `mlx_lm.models.switch_layers` call for call: the same
`gather_qmm` / `gather_mm` (with the expert's bias, quantization mode and nvfp4 global
scale), the same activation, the same `_gather_sort` when `rows.size >= 64`, only with pool
rows as `rhs_indices` instead of expert ids. So every (token, expert) product is the one
the resident model computes, bit for bit.

`expert_major_outputs` is the same math laid out by expert for calls of many tokens (a
prompt's chunk): mlx-lm's form multiplies each (token, expert) pair as a matrix of one
row, so a kernel that tiles rows (MLX CUDA's tiles hold 16 to 64) computes a full tile
per pair and reads the expert's weights once per pair. Here the pairs are sorted by pool
row into tiles of `tile` rows of one expert each, and each projection is one `gather_qmm`
over the tiles: the same primitive on the same inputs, only with more rows per matrix.
Whether an output row is then the same bits as mlx-lm's depends on the backend's kernels
(a kernel whose reduction order changes with the rows of a matrix would differ), which is
why `ExpertMajor` compares the two forms on a call's own data before it uses the second.
"""

import logging
from typing import TYPE_CHECKING

import mlx.core as mx
from mlx_lm.models.switch_layers import _gather_sort, _scatter_unsort

from engine.validate import DEFAULT_QUANT_MODE

if TYPE_CHECKING:
    from engine.experts import ExpertMath

log = logging.getLogger(__name__)

# Where "auto" computes a call expert-major (docs/benchmarks.md#long-prompts-expert-major):
# on MLX CUDA, for the quantization modes whose kernels it makes faster there, from this
# many (token, expert) pairs per expert of the layer (a prompt's chunk; decode steps and
# short calls keep mlx-lm's form, faster for them), in tiles of 16 rows up to 32 pairs per
# expert and of 32 rows from there.
EXPERT_MAJOR_MODES = (DEFAULT_QUANT_MODE,)
MIN_PAIRS_PER_EXPERT = 4
TILE_ROWS = ((32, 32), (0, 16))


def project(
    name: str,
    x: mx.array,
    pool: dict[str, mx.array],
    rows: mx.array,
    quantization: dict,
    sorted_rows: bool,
) -> mx.array:
    """`SwitchLinear` / `QuantizedSwitchLinear.__call__` of projection `name` on pool rows.

    Args:
        x: (..., 1, in) inputs; rows: int32 pool rows broadcastable with x's batch shape.
        pool: segment key ("<name>.weight", ".scales", ".biases", ".global_scale",
            ".bias") -> pool array `(pool rows, *segment shape)`.
        quantization: projection -> {"group_size", "bits", "mode"} or None.

    Returns:
        (..., 1, out) in x's dtype (or the scales' dtype when quantized).
    """
    q = quantization.get(name)
    if q is not None:
        y = mx.gather_qmm(
            x,
            pool[f"{name}.weight"],
            pool[f"{name}.scales"],
            pool.get(f"{name}.biases"),
            rhs_indices=rows,
            transpose=True,
            group_size=q["group_size"],
            bits=q["bits"],
            mode=q.get("mode", DEFAULT_QUANT_MODE),
            global_scale=pool.get(f"{name}.global_scale"),
            sorted_indices=sorted_rows,
        )
    else:
        y = mx.gather_mm(
            x, pool[f"{name}.weight"].swapaxes(-1, -2), rhs_indices=rows, sorted_indices=sorted_rows
        )
    if f"{name}.bias" in pool:
        y = y + mx.expand_dims(pool[f"{name}.bias"][rows], -2)
    return y


def module_math(
    x: mx.array,
    pool: dict[str, mx.array],
    rows: mx.array,
    quantization: dict,
    math: "ExpertMath",
    sorted_rows: bool,
) -> mx.array:
    """The streamed module's projections and activation, as its `__call__` applies them:
    SwitchGLU's `down(activation(up(x), gate(x)))`, SwitchMLP's `fc2(activation(fc1(x)))`,
    each projection a `project` of x's rows against `rows`.

    Args:
        x: (..., M, in) inputs; rows: pool rows broadcastable with x's batch shape.

    Returns:
        (..., M, out) outputs.
    """
    if math.kind == "SwitchGLU":
        x_up = project("up_proj", x, pool, rows, quantization, sorted_rows)
        x_gate = project("gate_proj", x, pool, rows, quantization, sorted_rows)
        return project(
            "down_proj", math.activation(x_up, x_gate), pool, rows, quantization, sorted_rows
        )
    y = math.activation(project("fc1", x, pool, rows, quantization, sorted_rows))
    return project("fc2", y, pool, rows, quantization, sorted_rows)


def expert_outputs(
    x: mx.array,
    pool: dict[str, mx.array],
    rows: mx.array,
    quantization: dict,
    math: "ExpertMath",
) -> mx.array:
    """The streamed module's own `__call__` (SwitchGLU or SwitchMLP) with pool rows for
    expert ids.

    Args:
        x: (..., D) hidden states.
        pool: see `project`.
        rows: (..., k) int32 pool rows holding the experts routed to each token.
        quantization: projection -> {"group_size", "bits", "mode"} or None.
        math: the streamed module's kind and activation.

    Returns:
        (..., k, D) expert outputs, as the module returns them.
    """
    x = mx.expand_dims(x, (-2, -3))
    do_sort = rows.size >= 64
    idx, inv_order = rows, None
    if do_sort:
        x, idx, inv_order = _gather_sort(x, rows)
    x = module_math(x, pool, idx, quantization, math, do_sort)
    if do_sort:
        x = _scatter_unsort(x, inv_order, rows.shape)
    return x.squeeze(-2)


def tile_layout(rows: mx.array, pool_rows: int, tile: int) -> tuple[mx.array, mx.array, mx.array]:
    """Where each (token, expert) pair goes when the pairs are laid out by pool row in
    tiles of `tile` rows, every tile holding pairs of one pool row only. Computed on the
    device from `rows` alone (no host wait), for a fixed number of tiles: at most
    `ceil(pairs / tile)` full tiles plus one partial tile per pool row used, so
    `tiles = ceil(pairs / tile) + min(pool_rows, pairs)`; unused tiles, at the end, take the
    last pool row (so the tiles' rows stay sorted) and pair 0, and are computed and dropped.

    Args:
        rows: (pairs,) int32 pool rows, each in [0, pool_rows).
        pool_rows: rows of the pool (the length of the per-row counts).
        tile: rows per tile (>= 1).

    Returns:
        (source, tile_rows, place): (tiles * tile,) int32 the pair whose input fills each
        tile row (pair 0 for padding); (tiles,) uint32 the pool row of each tile, sorted;
        (pairs,) int32 the tile row each pair's output is in.
    """
    pairs = rows.shape[0]
    tiles = -(-pairs // tile) + min(pool_rows, pairs)
    order = mx.argsort(rows)
    by_row = rows[order]
    counts = mx.zeros((pool_rows,), mx.int32).at[rows].add(1)
    per_row = (counts + tile - 1) // tile
    first_pair = mx.cumsum(counts) - counts
    first_tile = mx.cumsum(per_row) - per_row
    rank = mx.arange(pairs, dtype=mx.int32) - first_pair[by_row]
    dest = (first_tile[by_row] + rank // tile) * tile + rank % tile
    source = mx.zeros((tiles * tile,), mx.int32).at[dest].add(order.astype(mx.int32))
    tile_rows = mx.full((tiles,), pool_rows - 1, mx.uint32)
    tile_rows[dest // tile] = by_row.astype(mx.uint32)
    place = mx.zeros((pairs,), mx.int32).at[order].add(dest)
    return source, tile_rows, place


def expert_major_outputs(
    x: mx.array,
    pool: dict[str, mx.array],
    rows: mx.array,
    quantization: dict,
    math: "ExpertMath",
    tile: int,
) -> mx.array:
    """`expert_outputs` computed expert by expert: the (token, expert) pairs in tiles of
    `tile` rows of one pool row each (`tile_layout`), each projection one `gather_qmm` /
    `gather_mm` of the tiles against their pool rows, the activation on the tiles, the
    outputs taken back in the pairs' order.

    Args:
        x: (..., D) hidden states.
        pool: segment key -> pool array `(pool rows, *segment shape)` (see `project`).
        rows: (..., k) int32 pool rows of the experts routed to each token.
        quantization, math: as for `expert_outputs`.
        tile: rows per tile (the rows of each matrix the kernels see).

    Returns:
        (..., k, D) expert outputs, as `expert_outputs` returns them.
    """
    k = rows.shape[-1]
    flat = rows.reshape(-1).astype(mx.int32)
    pool_rows = next(iter(pool.values())).shape[0]
    source, tile_rows, place = tile_layout(flat, pool_rows, tile)
    tokens = x.reshape(-1, x.shape[-1])
    xt = tokens[source // k].reshape(-1, tile, x.shape[-1])
    y = module_math(xt, pool, tile_rows, quantization, math, True)
    y = y.reshape(-1, y.shape[-1])[place]
    return y.reshape(*rows.shape, y.shape[-1])


class ExpertMajor:
    """Which form computes a call's experts: mlx-lm's (`expert_outputs`) or expert-major
    (`expert_major_outputs`), and the check that keeps the engine's promise of mlx-lm's
    bits. A call is taken expert-major where the mode allows it and it has at least
    `MIN_PAIRS_PER_EXPERT` pairs per expert of the layer; the first such call of each
    kind (pool segments' shapes and dtypes, quantization, module kind, input dtype, tile height)
    computes both forms and compares every bit (one host wait, once per kind); a kind
    whose forms differ keeps mlx-lm's form from then on, said once in the log.

    Args:
        mode: "on" (every call of at least `MIN_PAIRS_PER_EXPERT` pairs per expert,
            any backend and quantization), "off", or "auto": on MLX CUDA only, for
            `EXPERT_MAJOR_MODES`, where the form is faster and its kernels reduce each
            row alike at any rows per matrix; MLX's CPU computes mlx-lm's form faster,
            and Metal's kernels are not measured.
        cuda: whether the pools are CUDA memory (`engine.memory_plan.cuda_pools`).
        num_experts: experts per MoE layer of the model.
    """

    def __init__(self, mode: str, cuda: bool, num_experts: int):
        self.mode = mode if mode != "auto" else ("modes" if cuda else "off")
        self.num_experts = num_experts
        self.same_bits: dict[tuple, bool] = {}

    def tile(self, pairs: int, quantization: dict) -> int | None:
        """The tile height for a call of `pairs` (token, expert) pairs whose projections
        are quantized as `quantization` (projection -> {"mode", ...} or None), or None
        for mlx-lm's form."""
        if self.mode == "off" or pairs < MIN_PAIRS_PER_EXPERT * self.num_experts:
            return None
        if self.mode == "modes" and not all(
            q is not None and q.get("mode", DEFAULT_QUANT_MODE) in EXPERT_MAJOR_MODES
            for q in quantization.values()
        ):
            return None
        return next(tile for least, tile in TILE_ROWS if pairs >= least * self.num_experts)

    def outputs(
        self,
        x: mx.array,
        pool: dict[str, mx.array],
        rows: mx.array,
        quantization: dict,
        math: "ExpertMath",
    ) -> mx.array:
        """The call's expert outputs, (..., k, D), as `expert_outputs` gives them, in the
        form this call is taken in (see the class)."""
        tile = self.tile(rows.size, quantization)
        if tile is None:
            return expert_outputs(x, pool, rows, quantization, math)
        kind = (
            tuple((key, a.shape[1:], a.dtype) for key, a in pool.items()),
            tuple(
                sorted(
                    (p, None if q is None else tuple(sorted(q.items())))
                    for p, q in quantization.items()
                )
            ),
            math.kind,
            x.dtype,
            tile,
        )
        same = self.same_bits.get(kind)
        if same is None:
            y = expert_outputs(x, pool, rows, quantization, math)
            major = expert_major_outputs(x, pool, rows, quantization, math, tile)
            same = self.same_bits[kind] = bool(mx.array_equal(y, major).item())
            if not same:
                log.info(
                    "expert-major compute differs from mlx-lm's on this backend for %s: "
                    "mlx-lm's form is kept for these calls",
                    kind,
                )
            return y
        if not same:
            return expert_outputs(x, pool, rows, quantization, math)
        return expert_major_outputs(x, pool, rows, quantization, math, tile)
