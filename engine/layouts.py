"""Where the sparse MoE block lives in each supported mlx-lm architecture.

One small `Layout` per `model_type`, found with `layout_for(config)`. A layout
knows the attribute of a decoder layer that holds the MoE block, the config key
of the expert count, and how to list the decoder layers that really are MoE
layers (some models mix in dense layers: `mlp_only_layers`,
`decoder_sparse_step`).
"""

from dataclasses import dataclass

import mlx.nn as nn


class UnsupportedModelError(ValueError):
    """The config's `model_type` has no layout."""


class NotMoEError(ValueError):
    """The config describes a model without routed experts."""


@dataclass(frozen=True)
class Layout:
    """How one mlx-lm MoE architecture names its expert weights.

    Attributes:
        model_type: the config's `model_type`, e.g. "qwen3_moe".
        moe_attr: attribute of a decoder layer holding the sparse MoE block
            ("mlp" or "block_sparse_moe"); the stacked experts are its
            `switch_mlp` (a `SwitchGLU`).
        experts_key: config key of the number of routed experts.
        top_k_key: config key of the number of experts chosen per token.
    """

    model_type: str
    moe_attr: str
    experts_key: str = "num_experts"
    top_k_key: str = "num_experts_per_tok"

    def num_experts(self, config: dict) -> int:
        """Number of routed experts per MoE layer.

        Raises:
            NotMoEError: the key is missing, not an integer, or not positive.
        """
        n = config.get(self.experts_key)
        if isinstance(n, bool) or not isinstance(n, int) or n <= 0:
            raise NotMoEError(
                f"model_type {self.model_type!r} is not a mixture-of-experts "
                f"config: {self.experts_key!r} is {n!r} (expected a positive int)"
            )
        return n

    def top_k(self, config: dict) -> int:
        """Number of experts each token is routed to.

        Raises:
            NotMoEError: the key is missing, or not in `[1, num_experts]`.
        """
        k = config.get(self.top_k_key)
        n = self.num_experts(config)
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= n:
            raise NotMoEError(
                f"model_type {self.model_type!r}: {self.top_k_key!r} is {k!r} "
                f"(expected an int in [1, {n}])"
            )
        return k

    def module_path(self, layer: int) -> str:
        """Weight-key prefix of the stacked experts of decoder layer `layer`,
        e.g. "model.layers.3.mlp.switch_mlp"."""
        return f"model.layers.{layer}.{self.moe_attr}.switch_mlp"

    def moe_blocks(self, model: nn.Module) -> list[tuple[int, nn.Module]]:
        """The MoE blocks of an instantiated mlx-lm `Model`.

        Returns:
            `(decoder_index, block)` for each decoder layer of `model.layers`
            whose `moe_attr` block has a `switch_mlp`, in layer order. Dense
            layers are skipped, so list positions are MoE indices.
        """
        blocks = []
        for i, layer in enumerate(model.layers):
            block = getattr(layer, self.moe_attr, None)
            if block is not None and "switch_mlp" in block:
                blocks.append((i, block))
        return blocks


LAYOUTS = {
    layout.model_type: layout
    for layout in (
        Layout("qwen3_moe", "mlp"),
        Layout("qwen2_moe", "mlp"),
        Layout("mixtral", "block_sparse_moe", experts_key="num_local_experts"),
        Layout("olmoe", "mlp"),
    )
}


def layout_for(config: dict) -> Layout:
    """The layout of a model config (the parsed `config.json`).

    Raises:
        UnsupportedModelError: `model_type` is missing or has no layout; the
            message lists the supported types.
        NotMoEError: the config has no routed experts (missing expert-count
            key, or zero experts).
    """
    model_type = config.get("model_type")
    layout = LAYOUTS.get(model_type) if isinstance(model_type, str) else None
    if layout is None:
        raise UnsupportedModelError(
            f"model_type {model_type!r} is not supported; supported: {', '.join(sorted(LAYOUTS))}"
        )
    layout.num_experts(config)
    return layout
