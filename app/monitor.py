"""What the cache inspector draws, computed from engine snapshots as plain numpy (no Qt).

`occupancy` maps a `CacheSnapshot` to one display state per pool row, `frequency` gives
the LFU heat map and the resident marks, and `LiveSeries` turns successive snapshots into
the rolling time series of the inspector.
"""

import os
import resource
from collections import deque
from dataclasses import dataclass

import numpy as np

from engine.cache import (
    NO_ROW,
    ROW_FREE,
    ROW_IN_FLIGHT,
    ROW_PUBLISHED,
    SLOT_EMPTY,
    SLOT_JUST_LOADED,
    SLOT_LOADING,
    SLOT_PINNED,
    SLOT_RESIDENT,
    CacheSnapshot,
)

# Display states of the occupancy heat map, in colour-key order. ABSENT: no pool row
# there (a layer with fewer slots or side rows than the widest), in a colour of its own,
# unlike the background and every row's state, so that it is not read as a black band
# of rows.
EMPTY, RESIDENT, PINNED, SIDE_READY, IN_FLIGHT, JUST_LOADED, ABSENT = range(7)
STATE_NAMES = (
    "empty",
    "resident",
    "pinned",
    "side-ready",
    "in-flight fill",
    "just loaded",
    "no row",
)
STATE_COLORS = ("#2a2d34", "#3f7fd9", "#b05ce0", "#3fbf7f", "#f0a030", "#f4f1a0", "#5a4b3c")

_SLOT_DISPLAY = np.full(NO_ROW + 1, ABSENT, np.uint8)
_SLOT_DISPLAY[[SLOT_EMPTY, SLOT_RESIDENT, SLOT_PINNED, SLOT_LOADING, SLOT_JUST_LOADED]] = (
    EMPTY,
    RESIDENT,
    PINNED,
    IN_FLIGHT,
    JUST_LOADED,
)
_ROW_DISPLAY = np.full(NO_ROW + 1, ABSENT, np.uint8)
_ROW_DISPLAY[[ROW_FREE, ROW_IN_FLIGHT, ROW_PUBLISHED]] = (EMPTY, IN_FLIGHT, SIDE_READY)


def occupancy(snap: CacheSnapshot) -> tuple[np.ndarray, np.ndarray]:
    """The occupancy heat map of `snap`.

    Returns:
        (states, experts), both (MoE layers, expert_slots + 2 * side_slots): the display
        state (EMPTY ... ABSENT) and the expert id (-1: none) of every pool row, real
        slots first, then the side rows of bank 0 and of bank 1.
    """
    states = np.concatenate([_SLOT_DISPLAY[snap.slot_state], _ROW_DISPLAY[snap.side_state]], axis=1)
    experts = np.concatenate([snap.slot_expert, snap.side_expert], axis=1).astype(np.int32)
    return states, experts


def frequency(snap: CacheSnapshot) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The LFU heat map of `snap`.

    Returns:
        (heat, in_real, in_side): heat = log10(1 + freq), (MoE layers, experts) float32;
        in_real / in_side: bool masks of the experts held in a real slot (resident,
        pinned or just loaded) / published in a side row.
    """
    n, num_experts = snap.freq.shape
    heat = np.log10(1.0 + np.maximum(snap.freq, 0.0)).astype(np.float32)
    in_real = np.zeros((n, num_experts), bool)
    held = (snap.slot_expert >= 0) & np.isin(
        snap.slot_state, (SLOT_RESIDENT, SLOT_PINNED, SLOT_JUST_LOADED)
    )
    rows, cols = np.nonzero(held)
    in_real[rows, snap.slot_expert[rows, cols]] = True
    in_side = np.zeros((n, num_experts), bool)
    pub = (snap.side_expert >= 0) & (snap.side_state == ROW_PUBLISHED)
    rows, cols = np.nonzero(pub)
    in_side[rows, snap.side_expert[rows, cols]] = True
    return heat, in_real, in_side


@dataclass(frozen=True)
class RowInfo:
    """What the tooltip of one occupancy cell says."""

    layer: int
    row: int
    region: str
    expert: int
    state: str
    freq: float | None

    def text(self) -> str:
        expert = "none" if self.expert < 0 else str(self.expert)
        freq = "" if self.freq is None else f"  ·  frequency {self.freq:.2f}"
        return (
            f"MoE layer {self.layer}  ·  row {self.row} ({self.region})  ·  "
            f"expert {expert}  ·  {self.state}{freq}"
        )


def row_info(snap: CacheSnapshot, layer: int, row: int) -> RowInfo:
    """The tooltip facts of pool row `row` of MoE layer `layer` in `snap`."""
    states, experts = occupancy(snap)
    slots = snap.slot_expert.shape[1]
    side = snap.side_expert.shape[1] // 2
    if states[layer, row] == ABSENT:
        region = "this layer has no such row"
    elif row < slots:
        region = f"real slot {row}"
    else:
        bank, idx = divmod(row - slots, side)
        region = f"side row {row - slots} (bank {bank}, row {idx})"
    expert = int(experts[layer, row])
    freq = float(snap.freq[layer, expert]) if expert >= 0 else None
    return RowInfo(layer, row, region, expert, STATE_NAMES[states[layer, row]], freq)


class LiveSeries:
    """Rolling time series of the inspector, one sample per poll.

    Each `sample(t, totals, tokens)` takes the time (s), `CacheSnapshot.totals()` and
    the count of reply tokens received so far, and appends, over the last `rate_window`
    seconds: decode tokens/s, hit rate (NaN without lookups), side hits per second and
    bytes read per second; and the fills in flight at `t`.
    """

    KEYS = ("decode_tps", "hit_rate", "side_hits_ps", "inflight", "read_Bps")
    _COUNTERS = ("hits", "misses", "side_hits", "bytes_read")

    def __init__(self, maxlen: int = 600, rate_window: float = 1.0):
        self.maxlen = maxlen
        self.rate_window = rate_window
        self.clear()

    def clear(self) -> None:
        """Forgets every sample (a new model starts its counters at zero)."""
        self.t = deque(maxlen=self.maxlen)
        self.values = {k: deque(maxlen=self.maxlen) for k in self.KEYS}
        self._recent = deque()  # (t, tokens, counters) within the rate window

    def sample(self, t: float, totals: dict, tokens: int) -> None:
        """Appends the sample at time `t` (seconds, monotonic)."""
        now = (t, tokens, {k: totals[k] for k in self._COUNTERS})
        self._recent.append(now)
        while len(self._recent) > 2 and self._recent[1][0] <= t - self.rate_window:
            self._recent.popleft()
        t0, n0, c0 = self._recent[0]
        if t <= t0:
            return
        dt = t - t0
        d = {k: totals[k] - c0[k] for k in self._COUNTERS}
        lookups = d["hits"] + d["misses"]
        self.t.append(t)
        for key, value in (
            ("decode_tps", (tokens - n0) / dt),
            ("hit_rate", d["hits"] / lookups if lookups > 0 else np.nan),
            ("side_hits_ps", d["side_hits"] / dt),
            ("inflight", float(totals["inflight"])),
            ("read_Bps", d["bytes_read"] / dt),
        ):
            self.values[key].append(value)

    def arrays(self, now: float) -> tuple[np.ndarray, dict]:
        """(x, {key: y}): x is seconds relative to `now` (negative: the past)."""
        x = np.fromiter(self.t, float, len(self.t)) - now
        return x, {k: np.fromiter(v, float, len(v)) for k, v in self.values.items()}


def process_rss_bytes() -> int:
    """Resident memory of this process in bytes: current on Linux (/proc), peak
    elsewhere (getrusage, bytes on macOS)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
