"""A model opened as every front end opens one (the CLI and its server, the app).

`open_model` is the one load recipe: the store resolved (a model directory converted on
first use), the config built (from the store's manifest where a front end's defaults
depend on it), real regions below top-k refused (`check_real_slots`, the one rule
whichever flag sized them), and, where the user sized no pools, a config whose pools and
dense weights exceed the memory available streamed with expert memory "auto" instead
(`engine.model.auto_if_too_large`) rather than refused; then the load. Each front end
words the switch to "auto" itself (`TooLarge`).
"""

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from engine.config import ConfigError, StreamConfig, check_budget
from engine.model import StreamedModel, auto_if_too_large, load, resolve_store
from engine.store import Manifest


@dataclass(frozen=True)
class TooLarge:
    """Why a load streams with expert memory "auto": the pools of `config` (the config
    given up) and the dense weights exceed the memory available.

    Attributes:
        config: the config the user's front end asked for.
        pools: bytes of its expert pools.
        dense: bytes of the dense weights.
        available: bytes of memory available (`engine.memory.available_bytes`).
    """

    config: StreamConfig
    pools: int
    dense: int
    available: int


def check_real_slots(config: StreamConfig, top_k: int, records: Sequence[int]) -> None:
    """Refuses real regions below `top_k` experts per MoE layer, however they are sized:
    a token's `top_k` experts of a layer must fit its real region together, or every
    call reads some of them again. `records`: the record bytes of each MoE layer the
    budget covers. An "auto" budget is checked where it is resolved
    (`engine.cache.real_slots`).

    Raises:
        ConfigError: expert_slots < top_k, or an expert_memory in bytes below `top_k`
            records of every layer (the message gives both sizes).
    """
    if config.expert_slots is not None and config.expert_slots < top_k:
        raise ConfigError(
            "expert_slots",
            config.expert_slots,
            f"must be >= {top_k}, the experts each token is routed to per MoE layer (top-k)",
        )
    if isinstance(config.expert_memory, int):
        try:
            check_budget(config.expert_memory, records, top_k)
        except ValueError as e:
            raise ConfigError("expert_memory", config.expert_memory, str(e)) from None


def open_model(
    path: str | Path | None,
    config: StreamConfig | Callable[[Manifest], StreamConfig],
    *,
    auto_when_too_large: bool = False,
    on_auto: Callable[[TooLarge], None] | None = None,
    progress=None,
) -> StreamedModel:
    """Opens `path` (an expert store or an mlx-lm MoE model directory; None: the embedded
    model) with `config`, or with the config that `config(manifest)` builds from the
    store's manifest.

    Args:
        auto_when_too_large: the user gave no pool size (neither expert slots nor expert
            memory): a config whose pools and the dense weights exceed the memory
            available is then loaded with expert memory "auto" instead, after
            `on_auto(TooLarge)` (called before the load, so that a front end can say so
            first).
        progress: `progress(done_bytes, total_bytes)` during a first-use convert.

    Returns:
        The StreamedModel; its `config` is the one loaded (expert memory "auto" after a
        switch) and its `store` the resolved store.

    Raises:
        ConfigError: real regions below top-k (`check_real_slots`).
        engine.config.PoolMemoryError: pools that do not fit the memory available.
        As `engine.model.resolve_store` and `engine.model.load`.
    """
    from engine.resources import default_model_path

    store = resolve_store(default_model_path() if path is None else path, progress)
    m = store.manifest
    if callable(config):
        config = config(m)
    check_real_slots(config, m.top_k, [spec.record_bytes for spec in m.layers])
    if auto_when_too_large:
        auto, sizes = auto_if_too_large(store, config)
        if sizes is not None:
            if on_auto is not None:
                on_auto(TooLarge(config, *sizes))
            config = auto
    return load(store.path, config)
