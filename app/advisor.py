"""The budget advisor panel: hit rate (and estimated decode tokens/s) vs expert budget,
replayed from this session's routing trace, with one line of advice.

The replay (`engine.advisor.sweep`) runs on the process's advisor thread, never on the
GUI or the engine thread: `AdvisorRunner.analyze` is handed the trace as numpy (the
recorder copies it off the engine thread) and plain figures, and answers with a signal.
A reply that starts stops the replay within a token (`AdvisorRunner.stop`), so the
panel's only cost to the decode is nothing: it does no work while a reply runs, and none
while idle (no timers).
"""

import threading

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import QObject, Qt, Signal
from PySide6.QtWidgets import (
    QHBoxLayout,
    QLabel,
    QPushButton,
    QSpinBox,
    QVBoxLayout,
    QWidget,
)

from app.inspector import fixed_axes
from app.worker import ServiceThread, error_text
from engine.memory import human_bytes

POLICY_COLORS = {"lru": "#f0a030"}
CURRENT_COLOR = "#7cc4ff"
BELADY_COLOR = "#9aa3b2"
SUGGEST_COLOR = "#3fbf7f"
TPS_COLOR = "#ff7b72"


def _style(plot: pg.PlotItem) -> None:
    fixed_axes(plot)
    plot.showGrid(x=True, y=True, alpha=0.15)


class AdvisorPlot(pg.GraphicsLayoutWidget):
    """Hit rate vs real slots per layer (memory on the top axis) for the session's
    policy, LRU and Belady's MIN; below, the estimated decode tokens/s. A vertical line
    marks the current budget, a dashed one the suggested budget."""

    def __init__(self):
        super().__init__()
        self.hits = self.addPlot(row=0, col=0)
        self.speed = self.addPlot(row=1, col=0)
        for plot in (self.hits, self.speed):
            _style(plot)
        self.hits.setLabel("left", "hit rate %")
        self.hits.showAxis("top")
        self.hits.addLegend(offset=(-10, 10), labelTextSize="9pt")
        self.speed.setLabel("left", "tok/s (est., ★ measured)")
        self.speed.setLabel("bottom", "real slots per MoE layer")
        self.speed.setXLink(self.hits)
        self.ci.layout.setRowStretchFactor(0, 3)
        self.ci.layout.setRowStretchFactor(1, 2)
        self.curves: dict[str, pg.PlotDataItem] = {}
        self.tps_curve = self.speed.plot(pen=pg.mkPen(TPS_COLOR, width=2), symbol="o", symbolSize=5)
        self.tps_curve.setSymbolBrush(TPS_COLOR)
        self.measured = pg.ScatterPlotItem(size=11, symbol="star", brush=pg.mkBrush("#ffffff"))
        self.speed.addItem(self.measured)
        self.lines = []
        for plot in (self.hits, self.speed):
            now = pg.InfiniteLine(angle=90, pen=pg.mkPen(CURRENT_COLOR, width=1.5))
            new = pg.InfiniteLine(
                angle=90, pen=pg.mkPen(SUGGEST_COLOR, width=1.5, style=Qt.PenStyle.DashLine)
            )
            plot.addItem(now)
            plot.addItem(new)
            self.lines.append((now, new))
        self.note = pg.TextItem("", color="#8a93a3", anchor=(0.5, 0.5))
        self.speed.addItem(self.note)
        self._empty()

    def _empty(self) -> None:
        # Before the first sweep: the axes' ranges with no ticks on the budget axes and
        # no budget lines, not pyqtgraph's default range around 0.
        self.hits.setRange(xRange=(0, 1), yRange=(0, 100), padding=0.02)
        self.speed.setYRange(0, 1, padding=0.02)
        for axis in (self.hits.getAxis("bottom"), self.hits.getAxis("top")):
            axis.setTicks([[], []])
        self.speed.getAxis("bottom").setTicks([[], []])
        self.speed.getAxis("left").setTicks([[], []])
        for line in (line for pair in self.lines for line in pair):
            line.setVisible(False)

    def draw(self, curve, suggested: int | None) -> None:
        """Draws an `engine.advisor.Curve` with the `suggested` slots marked."""
        x = np.asarray(curve.slots, float)
        for name, rates in curve.hit_rate.items():
            if name not in self.curves:
                label = {"belady": "Belady's MIN (ceiling)"}.get(name, name.upper())
                if name == curve.policy:
                    label += " (this session's policy)"
                color = (
                    BELADY_COLOR
                    if name == "belady"
                    else CURRENT_COLOR
                    if name == curve.policy
                    else POLICY_COLORS.get(name, "#b05ce0")
                )
                style = Qt.PenStyle.DashLine if name == "belady" else Qt.PenStyle.SolidLine
                self.curves[name] = self.hits.plot(
                    pen=pg.mkPen(color, width=2, style=style), name=label
                )
            self.curves[name].setData(x, 100 * np.asarray(rates))
        self.hits.setYRange(0, 100, padding=0.02)
        self.hits.setXRange(x[0], x[-1], padding=0.03)
        for axis in (self.hits.getAxis("bottom"), self.speed.getAxis("bottom")):
            axis.setTicks(None)  # pyqtgraph's, which _empty took away
        self.speed.getAxis("left").setTicks(None)
        step = max(1, len(x) // 6)
        top = [
            (float(c), _short_bytes(b))
            for c, b in zip(curve.slots, curve.bytes or [], strict=False)
        ]
        self.hits.getAxis("top").setTicks([top[::step], []])
        for now, new in self.lines:
            now.setVisible(True)
            now.setPos(curve.current)
            new.setPos(suggested if suggested is not None else curve.current)
            new.setVisible(suggested is not None and suggested != curve.current)
        if curve.tps:
            self.tps_curve.setData(x, curve.tps)
            self.measured.setData([curve.current], [curve.measured.decode_tps])
            self.speed.setYRange(0, 1.1 * max(max(curve.tps), curve.measured.decode_tps))
            self.note.setText("")
        else:
            self.tps_curve.setData([], [])
            self.measured.setData([], [])
            self.speed.setYRange(0, 1)
            self.note.setText("tokens/s: needs a reply measured in this session")
            self.note.setPos((x[0] + x[-1]) / 2, 0.5)


def _short_bytes(n: float) -> str:
    return human_bytes(n).replace(".0 ", " ")


def figures_text(curve) -> str:
    """What was measured and what is estimated, as HTML for the panel. The measured hit
    rate is the inspector's figure as it shows it; the replayed one at the same budget
    is named apart, with why it differs."""
    m = curve.measured
    replayed = curve.at(curve.current)
    parts = [
        f"Replayed {curve.tokens:,} tokens of this session one at a time (real region only): "
        f"hit rate {replayed:.1%} at {curve.current} slots, from an empty cache and without "
        "the side region's prefetch."
    ]
    if m is not None:
        parts.append(
            f"<b>Measured</b> at {curve.current} slots: decode {m.decode_tps:.1f} tok/s over "
            f"{m.decode_tokens:,} tokens, hit rate {m.hit_rate:.1%} (the inspector's: side "
            "hits count, and a prompt's forward looks up each of its distinct experts once), "
            f"reads {human_bytes(m.read_Bps)}/s."
        )
    if curve.tps:
        parts.append(
            f"<b>Estimated</b>: tok/s at the other budgets ({1e3 * curve.compute_s:.1f} ms "
            "compute per token + each miss read at the measured rate); hit rates are replayed."
        )
    return " ".join(parts)


class AdvisorRunner(QObject):
    """Runs sweeps on the advisor thread; `finished(curve, advice)` or `failed(message)`
    come back on the GUI thread. `stop()` ends a running sweep (a reply is starting)."""

    finished = Signal(object, object)
    failed = Signal(str)
    stopped = Signal()

    def __init__(self):
        super().__init__()
        self._thread = ServiceThread.get("expertstream-advisor")
        self._stop = threading.Event()
        self.running = False

    def analyze(self, trace, config, current, budget, measured) -> None:
        """Queues the advice session (`engine.advisor.advice_for`) of `trace` (numpy
        only) under StreamConfig `config`, from `current` slots per layer."""
        self._stop.clear()
        self.running = True
        self._thread.submit(lambda: self._run(trace, config, current, budget, measured))

    def stop(self) -> None:
        self._stop.set()

    def _run(self, trace, config, current, budget, measured) -> None:
        from engine.advisor import advice_for
        from engine.replay import ReplayStopped

        try:
            curve, advice = advice_for(trace, config, current, budget, measured, self._stop.is_set)
        except ReplayStopped:
            self.running = False
            self.stopped.emit()
            return
        except Exception as e:  # noqa: BLE001  (shown in the panel; the app goes on)
            self.running = False
            self.failed.emit(error_text(e))
            return
        self.running = False
        self.finished.emit(curve, advice)


class AdvisorPanel(QWidget):
    """The Advisor tab. Emits `analyzeRequested`, `applyRequested(slots)`,
    `saveTraceRequested` and `traceTokensChanged(tokens)` (0: recording off)."""

    analyzeRequested = Signal()
    applyRequested = Signal(int)
    saveTraceRequested = Signal()
    traceTokensChanged = Signal(int)

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.plot = AdvisorPlot()
        self.curve = None
        self.advice = None
        title = QLabel("Budget advisor")
        title.setObjectName("title")
        hint = QLabel(
            "What more (or less) expert memory would buy: this session's routing replayed "
            "through the cache at other budgets (bottom axis: real slots per layer; top: "
            "expert memory), after each reply, off the decode path."
        )
        hint.setObjectName("hint")
        hint.setWordWrap(True)
        self.advice_label = QLabel("No trace yet: send a message.")
        self.advice_label.setObjectName("advice")
        self.advice_label.setWordWrap(True)
        self.advice_label.setStyleSheet("font-size: 11pt; font-weight: bold; color: #ffffff;")
        self.figures = QLabel("")
        self.figures.setObjectName("hint")
        self.figures.setWordWrap(True)
        self.status = QLabel("")
        self.status.setObjectName("hint")

        self.analyze_button = QPushButton("Analyze now")
        self.analyze_button.clicked.connect(self.analyzeRequested)
        self.apply_button = QPushButton("Use the suggestion")
        self.apply_button.setEnabled(False)
        self.apply_button.setToolTip("Set the expert slots to the suggestion and rebuild the pool")
        self.apply_button.clicked.connect(
            lambda: self.advice and self.applyRequested.emit(self.advice.slots)
        )
        self.save_button = QPushButton("Save trace…")
        self.save_button.setToolTip(
            "Save the session's routing trace (.npz, as the benchmarks read)"
        )
        self.save_button.clicked.connect(self.saveTraceRequested)
        self.trace_tokens = QSpinBox(minimum=0, maximum=1_000_000, singleStep=1024)
        self.trace_tokens.setSpecialValueText("off")
        self.trace_tokens.setSuffix(" tokens")
        self.trace_tokens.setToolTip("Routing kept for the advisor: the last N tokens (0: off)")
        self.trace_tokens.editingFinished.connect(
            lambda: self.traceTokensChanged.emit(self.trace_tokens.value())
        )

        buttons = QHBoxLayout()
        buttons.addWidget(self.analyze_button)
        buttons.addWidget(self.apply_button)
        buttons.addWidget(self.save_button)
        buttons.addStretch(1)
        buttons.addWidget(QLabel("keep the last"))
        buttons.addWidget(self.trace_tokens)

        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.addWidget(title)
        layout.addWidget(hint)
        layout.addWidget(self.plot, 1)
        layout.addWidget(self.advice_label)
        layout.addWidget(self.figures)
        layout.addLayout(buttons)
        layout.addWidget(self.status)

    def show_failed(self, message: str) -> None:
        """Says why the analysis failed."""
        self.status.setText(f"The analysis failed: {message}")

    def show_stopped(self) -> None:
        """Says that a reply stopped the analysis."""
        self.status.setText("Stopped for the reply; runs again after it.")

    def show_result(self, curve, advice) -> None:
        """Draws a finished sweep and its advice."""
        self.curve, self.advice = curve, advice
        self.plot.draw(curve, advice.slots)
        self.advice_label.setText(advice.line[0].upper() + advice.line[1:] + ".")
        self.figures.setText(figures_text(curve))
        changed = advice.slots != curve.current
        self.apply_button.setEnabled(changed)
        self.apply_button.setText(
            f"Use {advice.slots} slots (rebuild)" if changed else "Use the suggestion"
        )
        self.status.setText("")
