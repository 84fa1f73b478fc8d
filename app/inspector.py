"""The cache inspector: slot occupancy and LFU heat maps, live time series and totals.

Every plot item is created once; `show_snapshot` updates them with setImage / setData
from the window's polling timer. Nothing here talks to the engine: it is handed
`CacheSnapshot`s (plain numpy data) and renders them.
"""

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import QPointF, Qt
from PySide6.QtGui import QColor
from PySide6.QtWidgets import (
    QGridLayout,
    QHBoxLayout,
    QLabel,
    QSizePolicy,
    QToolTip,
    QVBoxLayout,
    QWidget,
)

from app.monitor import (
    STATE_COLORS,
    STATE_NAMES,
    LiveSeries,
    frequency,
    occupancy,
    process_rss_bytes,
    row_info,
)
from app.worker import ModelInfo
from engine.cache import NO_ROW
from engine.memory import human_bytes

BACKGROUND = "#1b1d23"
FOREGROUND = "#c9d1d9"
WINDOW_SECONDS = 60.0


def _title(text: str) -> QLabel:
    label = QLabel(text)
    label.setObjectName("title")
    return label


def fixed_axes(plot: pg.PlotItem) -> None:
    """A plot that neither the mouse nor pyqtgraph rescales: no menu, no buttons, and
    axes that never show an SI multiplier such as "(x0.001)" (an empty plot's range)."""
    plot.setMenuEnabled(False)
    plot.setMouseEnabled(x=False, y=False)
    plot.hideButtons()
    for name in ("left", "bottom", "top", "right"):
        plot.getAxis(name).enableAutoSIPrefix(False)


def _heat_plot(widget: pg.GraphicsLayoutWidget) -> tuple[pg.PlotItem, pg.ImageItem]:
    # The bottom axis has ticks and no label (the section's title names it): the rows
    # keep the height, on a laptop's screen.
    plot = widget.addPlot(row=0, col=0)
    fixed_axes(plot)
    plot.invertY(True)
    plot.setLabel("left", "MoE layer")
    plot.getAxis("left").setTickSpacing(major=1, minor=1)
    # no model yet: an empty unit square, not pyqtgraph's default range
    plot.setRange(xRange=(0, 1), yRange=(0, 1), padding=0)
    plot.getAxis("bottom").setTicks([[], []])
    plot.getAxis("left").setTicks([[], []])
    image = pg.ImageItem(axisOrder="row-major")
    plot.addItem(image)
    return plot, image


class OccupancyView(pg.GraphicsLayoutWidget):
    """One row per MoE layer, one column per pool row: real slots, then the side rows of
    bank 0 and 1 (one region in the persistent LFU mode), coloured by state. Hovering
    shows the row's facts."""

    def __init__(self):
        super().__init__()
        self.plot, self.image = _heat_plot(self)
        lut = np.array([QColor(c).getRgb()[:3] for c in STATE_COLORS], np.uint8)
        self.image.setLookupTable(lut)
        self.image.setLevels((0, len(STATE_COLORS)))
        self.plot.showAxis("top")
        self.plot.getAxis("top").setStyle(tickLength=0)
        self.plot.getAxis("top").setTicks([[], []])  # the regions' names, once shaped
        self.separators = [
            pg.InfiniteLine(angle=90, pen=pg.mkPen("#e6e6e6", width=2)) for _ in range(2)
        ]
        for line in self.separators:
            self.plot.addItem(line)
        self.snapshot = None
        self.hover_text = ""
        self._shape = (0, 0, 0)
        self._lfu = True
        self.scene().sigMouseMoved.connect(self._hover)

    def set_shape(self, layers: int, slots: int, side: int) -> None:
        """Axes and region separators for `layers` x (slots + 2 * side) rows."""
        cols = slots + 2 * side
        self.image.setImage(np.zeros((layers, cols), np.uint8), autoLevels=False)
        self.plot.setRange(xRange=(0, cols), yRange=(0, layers), padding=0)
        self.separators[0].setPos(slots)
        self.separators[1].setPos(slots + side)
        self._shape = (layers, slots, side)
        self._region_labels()
        step = max(1, cols // 16)
        self.plot.getAxis("bottom").setTicks(
            [[(c + 0.5, str(c)) for c in range(0, cols, step)], []]
        )
        self.plot.getAxis("left").setTicks([[(r + 0.5, str(r)) for r in range(layers)], []])

    def set_side_lfu(self, lfu: bool) -> None:
        """Labels the side rows as one LFU region (both banks) or the double buffer's two
        banks."""
        self._lfu = lfu
        self._region_labels()

    def _region_labels(self) -> None:
        _, slots, side = self._shape
        top = [(slots / 2, "real slots")]
        if side and self._lfu:
            top += [(slots + side, "side rows (LFU)")]
        elif side:
            top += [(slots + side / 2, "side bank 0"), (slots + 1.5 * side, "side bank 1")]
        self.separators[0].setVisible(side > 0)
        self.separators[1].setVisible(side > 0 and not self._lfu)
        self.plot.getAxis("top").setTicks([top, []])

    def draw(self, snap) -> np.ndarray:
        """Draws `snap`; returns the state image it set."""
        states, _ = occupancy(snap)
        if not np.array_equal(states, self.image.image):
            self.image.setImage(states, autoLevels=False)
        self.snapshot = snap
        return states

    def cell_at(self, scene_pos: QPointF) -> tuple[int, int] | None:
        """(layer, row) under a scene position, or None outside the image."""
        if self.snapshot is None:
            return None
        p = self.image.mapFromScene(scene_pos)
        layer, row = int(np.floor(p.y())), int(np.floor(p.x()))
        n, cols = self.image.image.shape
        return (layer, row) if 0 <= layer < n and 0 <= row < cols else None

    def _hover(self, scene_pos: QPointF) -> None:
        cell = self.cell_at(scene_pos)
        if cell is None:
            self.hover_text = ""
            QToolTip.hideText()
            return
        self.hover_text = row_info(self.snapshot, *cell).text()
        view_pos = self.mapFromScene(scene_pos)
        QToolTip.showText(self.mapToGlobal(view_pos), self.hover_text, self)


class FrequencyView(pg.GraphicsLayoutWidget):
    """LFU frequency per layer and expert, log colour scale; dots mark the experts held
    in a real slot, rings those published in a side row."""

    def __init__(self):
        super().__init__()
        self.plot, self.image = _heat_plot(self)
        cmap = pg.colormap.get("inferno")
        self.colorbar = pg.ColorBarItem(
            values=(0, 1), colorMap=cmap, interactive=False, width=14, label="log10(1 + freq.)"
        )
        self.colorbar.setImageItem(self.image, insert_in=self.plot)
        self.real_marks = pg.ScatterPlotItem(
            size=5, symbol="s", pen=None, brush=pg.mkBrush("#7fd4ff")
        )
        self.side_marks = pg.ScatterPlotItem(
            size=11, symbol="o", pen=pg.mkPen("#3fbf7f", width=1.5), brush=None
        )
        self.plot.addItem(self.real_marks)
        self.plot.addItem(self.side_marks)
        self._top = None
        self._in_real = self._in_side = None

    def set_shape(self, layers: int, num_experts: int) -> None:
        """Axes for `layers` x `num_experts`."""
        self.image.setImage(np.zeros((layers, num_experts), np.float32), autoLevels=False)
        self.plot.setRange(xRange=(0, num_experts), yRange=(0, layers), padding=0)
        step = max(1, num_experts // 16)
        self.plot.getAxis("bottom").setTicks(
            [[(e + 0.5, str(e)) for e in range(0, num_experts, step)], []]
        )
        self.plot.getAxis("left").setTicks([[(r + 0.5, str(r)) for r in range(layers)], []])

    def draw(self, snap) -> np.ndarray:
        """Draws `snap`; returns the heat image it set."""
        heat, in_real, in_side = frequency(snap)
        if not np.array_equal(heat, self.image.image):
            self.image.setImage(heat, autoLevels=False)
        top = max(0.5, np.ceil(float(heat.max()) * 4) / 4)  # steps of 0.25: few rescales
        if top != self._top:
            self._top = top
            self.colorbar.setLevels((0.0, top))
        for marks, mask, last in (
            (self.real_marks, in_real, self._in_real),
            (self.side_marks, in_side, self._in_side),
        ):
            if not np.array_equal(mask, last):
                rows, cols = np.nonzero(mask)
                marks.setData(cols + 0.5, rows + 0.5)
        self._in_real, self._in_side = in_real, in_side
        return heat


def _round_up(v: float) -> float:
    """The smallest round number (1, 1.5, 2, 3, 4, 5, 6, 8 x 10^k) at or above `v`, at
    least 1."""
    if v <= 1:
        return 1.0
    base = 10 ** np.floor(np.log10(v))
    return float(next(m * base for m in (1, 1.5, 2, 3, 4, 5, 6, 8, 10) if m * base >= v))


SERIES = (
    ("decode_tps", "decode tok/s", "#7cc4ff", 1.0),
    ("hit_rate", "hit rate %", "#3fbf7f", 100.0),
    ("side_hits_ps", "side hits /s", "#b05ce0", 1.0),
    ("inflight", "fills in flight", "#f0a030", 1.0),
    ("read_Bps", "MB read /s", "#ff7b72", 1e-6),
)
# Series that count things: their ticks are whole numbers.
INTEGER_SERIES = frozenset({"inflight"})


def y_ticks(top: float, integer: bool = False) -> list[tuple[float, str]]:
    """The y ticks of a series plot from 0 to `top`: 0, the middle and the top (the
    middle only where it is a whole number, for a series of counts), so that a plot a
    few dozen pixels tall still reads, which pyqtgraph's automatic ticks do not."""
    values = [0.0, top / 2, top]
    if integer:
        values = [v for v in values if v == int(v)]
    return [(v, f"{v:g}") for v in values]


class SeriesView(pg.GraphicsLayoutWidget):
    """The time series of `LiveSeries`, last minute, one small plot each; the x axis is
    seconds before now."""

    def __init__(self):
        super().__init__()
        self.curves = {}
        self.plots = []
        self._xmin = None
        self._ytop = {}
        for i, (key, title, color, _) in enumerate(SERIES):
            plot = self.addPlot(row=0, col=i)  # one row: each plot keeps the height
            plot.setTitle(title, size="9pt")
            plot.layout.setRowFixedHeight(0, 18)  # pyqtgraph's 30 pixels for a title of 9pt
            fixed_axes(plot)
            self.plots.append(plot)
            plot.getAxis("bottom").setStyle(tickLength=-4)
            curve = plot.plot(pen=pg.mkPen(color, width=2), connect="finite")
            self.curves[key] = curve
            self._set_top(key, plot, 100.0 if key == "hit_rate" else 1.0)
        self._set_xmin(-5.0)

    def _set_top(self, key: str, plot: pg.PlotItem, top: float) -> None:
        self._ytop[key] = top
        plot.setYRange(0, top, padding=0.02)
        plot.getAxis("left").setTicks([y_ticks(top, key in INTEGER_SERIES), []])

    def _set_xmin(self, xmin: float) -> None:
        self._xmin = xmin
        for plot in self.plots:
            plot.setXRange(xmin, 0, padding=0)

    def draw(self, series: LiveSeries, now: float) -> None:
        """Draws `series` as of time `now`."""
        x, ys = series.arrays(now)
        for plot, (key, _, _, scale) in zip(self.plots, SERIES, strict=True):
            y = ys[key] * scale
            self.curves[key].setData(x, y)
            if key != "hit_rate":  # y from 0 to a round number above the peak
                top = _round_up(float(np.nanmax(y, initial=0.0)))
                if top != self._ytop.get(key):
                    self._set_top(key, plot, top)
        # the x axis grows from 5 s to WINDOW_SECONDS as history accumulates
        xmin = -min(WINDOW_SECONDS, max(5.0, float(np.ceil(-x[0]))) if len(x) else 5.0)
        if xmin != self._xmin:
            self._set_xmin(xmin)


TOTALS = (
    ("hits", "hits"),
    ("misses", "misses"),
    ("hit_rate", "hit rate"),
    ("side_hits", "side hits"),
    ("promotions", "promoted / declined"),
    ("pins_dropped", "pins dropped (cost hits)"),
    ("prefetch", "fills used / wasted"),
    ("prefetch_accuracy", "prefetch accuracy"),
    ("prefetch_degree", "prefetch degree · threshold"),
    ("bytes_read", "read from disk"),
    ("host_tier", "host memory hits / bytes"),
    ("evictions", "evictions"),
    ("inflight", "fills in flight"),
    ("pool", "pool memory"),
    ("rss", "process memory (RSS)"),
    ("forward", "forward passes"),
)


def _degree_text(snap) -> str:
    """The layers' prefetch degree (the experts a prediction fills) as their mean over
    the layers that have side rows, and the threshold a fill must reach now."""
    targets = (snap.side_state != NO_ROW).any(axis=1) if snap.side_state.size else []
    degrees = snap.degree[targets] if len(targets) else snap.degree[:0]
    if degrees.size == 0:
        return "—"
    return f"{degrees.mean():.1f} · {snap.threshold:.2f}"


class InspectorPanel(QWidget):
    """The whole inspector. `set_model` once per load, `show_snapshot` per poll."""

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        pg.setConfigOptions(background=BACKGROUND, foreground=FOREGROUND, antialias=False)
        self.occupancy = OccupancyView()
        self.frequency = FrequencyView()
        self.series_view = SeriesView()
        self.series = LiveSeries(maxlen=int(WINDOW_SECONDS * 10) + 10)
        self.pool_bytes = 0

        # Each section's title shares its row with the section's key or hint, so that
        # the plots keep their height on a laptop's screen.
        self.hover_label = QLabel("Hover a cell for its layer, row, expert and frequency.")
        self.hover_label.setObjectName("hint")
        # the hover text never widens the window: it is cut where the row ends
        self.hover_label.setSizePolicy(QSizePolicy.Policy.Ignored, QSizePolicy.Policy.Preferred)
        self.occupancy.scene().sigMouseMoved.connect(
            lambda _: self.hover_label.setText(self.occupancy.hover_text or self.hover_label.text())
        )
        occupancy_title = QHBoxLayout()
        occupancy_title.addWidget(_title("Slot occupancy"))
        occupancy_title.addSpacing(10)
        occupancy_title.addWidget(self.hover_label, 1)

        key = QHBoxLayout()
        key.setSpacing(4)
        for name, color in zip(STATE_NAMES, STATE_COLORS, strict=True):
            swatch = QLabel()
            swatch.setFixedSize(14, 14)
            swatch.setStyleSheet(f"background: {color}; border: 1px solid #555;")
            key.addWidget(swatch)
            key.addWidget(QLabel(name))
            key.addSpacing(8)
        key.addStretch(1)

        marks = QLabel(
            '<span style="color:#7fd4ff">■</span> held in a real slot &nbsp; '
            '<span style="color:#3fbf7f">○</span> published in a side row'
        )
        marks.setObjectName("hint")
        frequency_title = QHBoxLayout()
        frequency_title.addWidget(_title("LFU frequency"))
        frequency_title.addSpacing(10)
        frequency_title.addWidget(marks, 1)

        live_title = QHBoxLayout()
        live_title.addWidget(_title("Live"))
        live_title.addSpacing(10)
        seconds = QLabel("the last minute; x: seconds before now")
        seconds.setObjectName("hint")
        live_title.addWidget(seconds, 1)

        self.totals = {}
        self.total_names = {}
        self.grid = QGridLayout()
        self.grid.setHorizontalSpacing(14)
        self.grid.setVerticalSpacing(2)
        for k, label in TOTALS:
            name = QLabel(label)
            name.setObjectName("hint")
            value = QLabel("–")
            value.setObjectName("value")
            value.setAlignment(Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter)
            self.total_names[k] = name
            self.totals[k] = value
        self._place_totals([t for t in TOTALS if t[0] != "host_tier"])

        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.setSpacing(4)
        layout.addLayout(occupancy_title)
        layout.addLayout(key)
        # the heights below which a map's rows or a plot's ticks stop reading
        self.occupancy.setMinimumHeight(90)
        self.frequency.setMinimumHeight(90)
        self.series_view.setMinimumHeight(100)
        layout.addWidget(self.occupancy, 5)
        layout.addLayout(frequency_title)
        layout.addWidget(self.frequency, 5)
        layout.addLayout(live_title)
        layout.addWidget(self.series_view, 4)
        layout.addLayout(self.grid)

    def _place_totals(self, shown) -> None:
        """Lays out the totals `shown` ((key, label) pairs) three to a row; the others
        are hidden."""
        keys = [k for k, _ in shown]
        for k in self.totals:
            self.grid.removeWidget(self.total_names[k])
            self.grid.removeWidget(self.totals[k])
        for i, k in enumerate(keys):
            r, c = divmod(i, 3)
            self.grid.addWidget(self.total_names[k], r, 2 * c)
            self.grid.addWidget(self.totals[k], r, 2 * c + 1)
        for k in self.totals:  # after adding: a layout shows what it adds, later
            self.total_names[k].setVisible(k in keys)
            self.totals[k].setVisible(k in keys)

    def set_model(self, info: ModelInfo) -> None:
        """Shapes the plots for `info` and restarts the time series. The host-memory
        row shows only where the model has a host tier (MLX CUDA)."""
        c = info.config
        n = len(info.layers)
        self.occupancy.set_shape(n, max(info.plan.layer_slots), c.side_slots)
        self.frequency.set_shape(n, info.num_experts)
        self.occupancy.set_side_lfu(c.side_lfu)
        self.series.clear()
        self.pool_bytes = info.pool_bytes
        tier = info.plan.tier_slots > 0  # experts kept in host memory (MLX CUDA)
        self._place_totals([t for t in TOTALS if tier or t[0] != "host_tier"])

    def show_snapshot(self, snap, now: float, tokens: int, full: bool = True) -> None:
        """Draws one poll: `snap`, at monotonic time `now`, `tokens` received so far.
        The occupancy map, the totals and the series' samples follow every poll; the
        LFU map and the plotted series only when `full` (the timer asks every other
        poll: they change slowly, and each redraw takes the GIL from the worker)."""
        totals = snap.totals()
        self.series.sample(now, totals, tokens)
        self.occupancy.draw(snap)
        if full:
            self.frequency.draw(snap)
            self.series_view.draw(self.series, now)
        t = totals
        values = {
            "hits": f"{t['hits']:,}",
            "misses": f"{t['misses']:,}",
            "hit_rate": f"{t['hit_rate']:.1%}" if t["hits"] + t["misses"] else "—",
            "side_hits": f"{t['side_hits']:,}",
            "promotions": f"{t['promotions']:,} / {t['promotions_declined']:,}",
            "pins_dropped": f"{t['pins_dropped']:,}",
            "prefetch": f"{t['prefetch_used']:,} / {t['prefetch_wasted']:,}",
            "prefetch_accuracy": f"{t['prefetch_accuracy']:.1%}" if t["prefetch_issued"] else "—",
            "prefetch_degree": _degree_text(snap),
            "bytes_read": human_bytes(t["bytes_read"]),
            "host_tier": (
                f"{t['host_hits']:,} / {human_bytes(t['host_bytes'])}" if t["host_hits"] else "—"
            ),
            "evictions": f"{t['evictions']:,}",
            "inflight": str(t["inflight"]),
            "pool": human_bytes(self.pool_bytes),
            "rss": human_bytes(process_rss_bytes()),
            "forward": f"{snap.forward:,}",
        }
        for k, v in values.items():
            self.totals[k].setText(v)
