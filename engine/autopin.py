"""Autopin: a cache policy that keeps each layer's most frequently used experts pinned.

It works on the native cache alone (no model object): `repin(cache, k)` pins the `k`
experts of highest LFU frequency in every layer and unpins the rest; `budget` is the `k`
the engine and the policy benchmark both use, floor(frac x expert_slots) and never more
than expert_slots - top_k, so one token's experts always fit without going over capacity.
A pin set can be saved (`save`) and read back (`load`) to pre-load it at the next start.

Autopin never costs hits for long: while a layer has pins, the native cache runs a
shadow of its real region without them on the same calls, and drops the least used pin
whenever the shadow has had more hits (ext/real_region.h). Each dropped pin is taken off
that layer's budget for good (`repin`), so the budget shrinks until pinning is at least
as good as the eviction policy alone.
The caller decides when: `engine.model.load` restores, `engine.generate.generate`
updates between replies.
"""

import json
import math
from pathlib import Path

from engine.cache import SLOT_PINNED, snapshot
from engine.safe_io import atomic_write, read_json_object

PIN_FILE = "autopin.json"
MAX_PIN_BYTES = 16 << 20  # a pin set of 4096 layers x 256 experts is ~5 MB


def budget(expert_slots: int, top_k: int, frac: float) -> int:
    """Experts autopin may pin per layer: floor(frac x expert_slots), at most
    expert_slots - top_k, never below 0."""
    return max(0, min(expert_slots - top_k, math.floor(frac * expert_slots)))


def choose(freq, k: int) -> list[int]:
    """The k most frequent experts with non-zero frequency, ties to the smaller id.
    freq: (num_experts,) float32 LFU frequencies of one layer."""
    order = sorted(range(len(freq)), key=lambda e: (-float(freq[e]), e))
    return sorted(e for e in order[:k] if freq[e] > 0)


def apply(cache, pins: list[list[int]]) -> None:
    """Makes the pinned experts of each layer of `cache` exactly `pins[layer]` (pinning
    loads an expert that is not resident).

    Raises:
        engine.cache.ExpertReadError: a pinned expert could not be read.
    """
    snap = snapshot(cache)
    for li, want in enumerate(pins):
        pinned = set(snap.slot_expert[li][snap.slot_state[li] == SLOT_PINNED].tolist())
        for e in pinned - set(want):
            cache.unpin(li, e)
        for e in want:
            if e not in pinned:
                cache.pin(li, e)


def repin(cache, k: int) -> list[list[int]]:
    """Pins every layer's most frequent experts (`choose`), unpinning the others: `k` of
    them less the pins the cache dropped in that layer because they cost hits. Returns
    the pin set, one sorted list per MoE layer."""
    snap = snapshot(cache)
    dropped = snap.stats["pins_dropped"]
    pins = [choose(snap.freq[li], max(0, k - int(dropped[li]))) for li in range(len(snap.freq))]
    apply(cache, pins)
    return pins


def save(path: str | Path, pins: list[list[int]], num_experts: int) -> None:
    """Writes the pin set to `path` (JSON) atomically (`engine.safe_io.atomic_write`), so
    a reader (or a run killed at any instant) finds the old file or the new one, never a
    part of one.

    Raises:
        OSError: the file cannot be written (the old one is kept).
    """
    with atomic_write(path) as f:
        f.write(json.dumps({"num_experts": num_experts, "pins": pins}).encode())


def load(path: str | Path, num_experts: int, num_layers: int, k: int) -> list[list[int]]:
    """The pin set saved at `path`, each layer's cut to `k` experts; [] when the file is
    missing, unreadable, not a regular file, larger than `MAX_PIN_BYTES`, or of another
    model (expert or layer count, expert ids out of range)."""
    try:
        saved = read_json_object(path, MAX_PIN_BYTES)
        pins = saved["pins"]
        ok = (
            saved["num_experts"] == num_experts
            and isinstance(pins, list)
            and len(pins) == num_layers
            and all(isinstance(layer, list) for layer in pins)
            and all(type(e) is int and 0 <= e < num_experts for layer in pins for e in layer)
        )
    except (OSError, ValueError, KeyError, TypeError):
        return []
    return [sorted(layer)[:k] for layer in pins] if ok else []
