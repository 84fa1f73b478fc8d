"""The StreamConfig fields the desktop app fills in when none are given, and how its
--help words them: one table, read by `app.worker` (values) and `app.main` (help). No Qt
here, so that --help and the display checks run without it."""

from collections.abc import Callable

# {field: (what --help says, the value for a model of (num_experts, top_k))}: half the
# experts as real slots (at least top_k), top_k side rows, prefetch on, so that
# streaming is visible.
APP_DEFAULTS: dict[str, tuple[str, Callable[[int, int], object]]] = {
    "expert_slots": ("half the experts, at least top-k", lambda e, k: max(k, e // 2)),
    "side_slots": ("top-k", lambda e, k: k),
    "prefetch": ("on", lambda e, k: True),
}


def app_defaults(num_experts: int, top_k: int) -> dict:
    """The `APP_DEFAULTS` values for a model of `num_experts` experts per MoE layer and
    `top_k` experts per token, as StreamConfig fields."""
    return {field: value(num_experts, top_k) for field, (_, value) in APP_DEFAULTS.items()}


def app_defaults_help() -> dict[str, str]:
    """{field: the default as --help words it} (`engine.flags.add_cache_flags`)."""
    return {field: text for field, (text, _) in APP_DEFAULTS.items()}
