"""The expert math of mlx-lm's `SwitchGLU` and `SwitchMLP`, on pool rows.

Free functions that mirror `mlx_lm.models.switch_layers` call for call: the same
`gather_qmm` / `gather_mm` (with the expert's bias, quantization mode and nvfp4 global
scale), the same activation, the same `_gather_sort` when `rows.size >= 64`, only with pool
rows as `rhs_indices` instead of expert ids. So every (token, expert) product is the one
the resident model computes, bit for bit.
"""

import mlx.core as mx
from mlx_lm.models.switch_layers import _gather_sort, _scatter_unsort

from engine.experts import ExpertMath


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
            mode=q.get("mode", "affine"),
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


def expert_outputs(
    x: mx.array,
    pool: dict[str, mx.array],
    rows: mx.array,
    quantization: dict,
    math: ExpertMath,
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
    if math.kind == "SwitchGLU":
        x_up = project("up_proj", x, pool, idx, quantization, do_sort)
        x_gate = project("gate_proj", x, pool, idx, quantization, do_sort)
        x = project("down_proj", math.activation(x_up, x_gate), pool, idx, quantization, do_sort)
    else:
        x = math.activation(project("fc1", x, pool, idx, quantization, do_sort))
        x = project("fc2", x, pool, idx, quantization, do_sort)
    if do_sort:
        x = _scatter_unsort(x, inv_order, rows.shape)
    return x.squeeze(-2)
