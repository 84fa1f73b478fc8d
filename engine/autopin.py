"""Autopin: keep each layer's most frequently used experts pinned in the real region.

Within a budget of floor(autopin_frac * cap) experts per layer (never more than
cap - top_k, so one token's experts always fit without going over capacity), the experts
with the highest LFU frequency are pinned. The pin set is saved as `autopin.json` inside
the store, and pinned (pre-loaded) again when the store is next loaded with autopin on.
"""

import json
import math
import os

from engine.cache import SLOT_PINNED
from engine.model import StreamedModel

PIN_FILE = "autopin.json"


def budget(sm: StreamedModel) -> int:
    """Experts autopin may pin per layer: floor(autopin_frac x cap), at most cap - top_k."""
    cap = sm.cache.expert_slots
    return max(0, min(cap - sm.store.manifest.top_k, math.floor(sm.config.autopin_frac * cap)))


def choose(freq, k: int) -> list[int]:
    """The k most frequent experts with non-zero frequency, ties to the smaller id.
    freq: (num_experts,) float32 LFU frequencies of one layer."""
    order = sorted(range(len(freq)), key=lambda e: (-float(freq[e]), e))
    return sorted(e for e in order[:k] if freq[e] > 0)


def _apply(sm: StreamedModel, pins: list[list[int]]) -> None:
    snap = sm.snapshot()
    for li, want in enumerate(pins):
        pinned = set(snap.slot_expert[li][snap.slot_state[li] == SLOT_PINNED].tolist())
        for e in pinned - set(want):
            sm.cache.unpin(li, e)
        for e in want:
            if e not in pinned:
                sm.cache.pin(li, e)


def update(sm: StreamedModel) -> list[list[int]]:
    """Re-pins every layer's top experts by frequency and saves the pin set; call it
    between replies. Returns the pin set, one sorted list per MoE layer."""
    k = budget(sm)
    freq = sm.snapshot().freq
    pins = [choose(freq[li], k) if k > 0 else [] for li in range(len(freq))]
    _apply(sm, pins)
    path = sm.store.path / PIN_FILE
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"num_experts": sm.store.manifest.num_experts, "pins": pins}))
    os.replace(tmp, path)
    return pins


def restore_pins(sm: StreamedModel) -> list[list[int]]:
    """Pins (and so pre-loads) the saved pin set, cut to the current budget; a missing or
    unreadable file pins nothing. Returns the pin set applied."""
    path = sm.store.path / PIN_FILE
    try:
        saved = json.loads(path.read_text())
        pins = saved["pins"]
        ok = (
            saved["num_experts"] == sm.store.manifest.num_experts
            and len(pins) == sm.cache.num_layers
            and all(0 <= e < saved["num_experts"] for layer in pins for e in layer)
        )
    except (OSError, ValueError, KeyError, TypeError):
        return []
    if not ok:
        return []
    k = budget(sm)
    pins = [sorted(layer)[:k] for layer in pins]
    _apply(sm, pins)
    return pins
