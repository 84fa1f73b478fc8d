"""A model opened as every front end opens one (the CLI and its server, the app).

`open_model` is the one load recipe: the store resolved (a model directory converted on
first use), the config built (from the store's manifest where a front end's defaults
depend on it), then the load, whose memory plan checks it once
(`engine.memory_plan.plan_memory`): real regions below top-k are refused (the user's
mistake, whichever flag sized them), and, where the user sized no pools, a config whose
plan exceeds the memory available is streamed with expert memory "auto" instead
(`MemoryPlan.fell_back`) rather than refused. Each front end words the switch to "auto"
itself, from the plan.
"""

from collections.abc import Callable
from pathlib import Path

from engine.config import StreamConfig
from engine.memory_plan import MemoryPlan
from engine.model import StreamedModel, load, resolve_store
from engine.store import Manifest


def open_model(
    path: str | Path | None,
    config: StreamConfig | Callable[[Manifest], StreamConfig],
    *,
    auto_when_too_large: bool = False,
    on_auto: Callable[[MemoryPlan], None] | None = None,
    progress=None,
) -> StreamedModel:
    """Opens `path` (an expert store or an mlx-lm MoE model directory; None: the embedded
    model) with `config`, or with the config that `config(manifest)` builds from the
    store's manifest.

    Args:
        auto_when_too_large: the user gave no pool size (neither expert slots nor expert
            memory): a config whose plan exceeds the memory available is then loaded
            with expert memory "auto" instead, and `on_auto(plan)` is called with the
            plan loaded (`MemoryPlan.asked`: the one given up).
        progress: `progress(done_bytes, total_bytes)` during a first-use convert.

    Returns:
        The StreamedModel; its `config` is the one loaded (expert memory "auto" after a
        switch), its `plan` what it holds, and its `store` the resolved store.

    Raises:
        ConfigError: real regions below top-k (`engine.memory_plan.check_real_slots`).
        engine.config.PoolMemoryError: a plan that does not fit the memory available.
        As `engine.model.resolve_store` and `engine.model.load`.
    """
    from engine.resources import default_model_path

    store = resolve_store(default_model_path() if path is None else path, progress)
    if callable(config):
        config = config(store.manifest)
    sm = load(store.path, config, fit_default=auto_when_too_large, strict=True)
    if sm.plan.fell_back and on_auto is not None:
        on_auto(sm.plan)
    return sm
