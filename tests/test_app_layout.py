"""The window on a laptop's screen, and what its plots show before there is anything to
plot: the window fits the screen's available area, every control and the status bar are
whole inside it, the heat maps keep rows a few pixels tall, and no plot shows
pyqtgraph's default range or an SI multiplier.
"""

import json
import os
import subprocess
import sys

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import numpy as np  # noqa: E402
import pyqtgraph as pg  # noqa: E402
import pytest  # noqa: E402
from PySide6.QtCore import QRect  # noqa: E402
from PySide6.QtWidgets import (  # noqa: E402
    QAbstractButton,
    QAbstractSpinBox,
    QGroupBox,
    QLabel,
    QLineEdit,
    QMenuBar,
    QPlainTextEdit,
    QSizePolicy,
    QStatusBar,
    QTabBar,
    QTextBrowser,
    QWidget,
)
from test_app import MODEL, SETTINGS, TIMEOUT_MS, chat_turn  # noqa: E402

from app.advisor import AdvisorPanel  # noqa: E402
from app.inspector import (  # noqa: E402
    BACKGROUND,
    SERIES,
    TOTALS,
    InspectorPanel,
    SeriesView,
    y_ticks,
)
from app.monitor import ABSENT, STATE_COLORS, STATE_NAMES, LiveSeries  # noqa: E402
from app.window import MainWindow  # noqa: E402
from app.worker import ModelInfo  # noqa: E402
from engine.config import StreamConfig  # noqa: E402
from engine.memory_plan import MemoryPlan  # noqa: E402

# Rows of the embedded model's 8 MoE layers at least this tall on screen, in pixels.
MIN_LAYER_PX = 7
MIN_SERIES_PX = 40

CONTROLS = (
    QAbstractButton,
    QAbstractSpinBox,
    QLabel,
    QLineEdit,
    QPlainTextEdit,
    QTextBrowser,
    QGroupBox,
    QStatusBar,
    QMenuBar,
    QTabBar,
    pg.GraphicsLayoutWidget,
)


def layout_report(window) -> dict:
    """What of `window` a user cannot see whole: controls outside the window or clipped
    by their parents ("clipped"), text cut short ("squeezed": a label or button
    narrower than its text, a spin box narrower than its value, any control lower than
    a line of its font), and the height in pixels of one MoE layer's row in the heat
    maps and of the smallest live plot."""
    whole = window.rect()
    clipped, squeezed = [], []
    for c in window.findChildren(QWidget):
        if not isinstance(c, CONTROLS) or not c.isVisible() or c.window() is not window:
            continue
        text = c.text() if hasattr(c, "text") else ""
        name = f"{type(c).__name__} {c.objectName()} {text!r}"
        where = QRect(c.mapTo(window, c.rect().topLeft()), c.size())
        shown = where & whole
        parent = c.parentWidget()
        while parent is not None and parent is not window:
            shown &= QRect(parent.mapTo(window, parent.rect().topLeft()), parent.size())
            parent = parent.parentWidget()
        if shown != where:
            clipped.append(name)
        line = c.fontMetrics().height()
        if isinstance(c, QAbstractSpinBox):
            need = (c.lineEdit().fontMetrics().horizontalAdvance(c.text()), line)
        elif isinstance(c, QAbstractButton) or (
            isinstance(c, QLabel)
            and text
            and not c.wordWrap()
            and c.sizePolicy().horizontalPolicy() != QSizePolicy.Policy.Ignored
        ):
            need = (c.sizeHint().width(), line)
        else:
            need = (0, min(line, c.minimumHeight() or line))
        if c.width() < need[0] or c.height() < need[1]:
            squeezed.append(f"{name} {c.width()}x{c.height()} < {need[0]}x{need[1]}")
    inspector = window.inspector
    layers = len(window.info.layers)
    return {
        "clipped": clipped,
        "squeezed": squeezed,
        "layer_px": [
            view.plot.getViewBox().height() / layers
            for view in (inspector.occupancy, inspector.frequency)
        ],
        "series_px": min(p.getViewBox().height() for p in inspector.series_view.plots),
    }


# Run in a process of its own: the offscreen platform's screen is set when Qt starts.
SCREEN_SCRIPT = """
import json, sys
sys.path.insert(0, sys.argv[1])  # tests/
from PySide6.QtWidgets import QApplication
from app.window import MainWindow, apply_style
from test_app_layout import layout_report

app = QApplication([])
apply_style(app)
w = MainWindow(None, {"expert_slots": 8, "side_slots": 4, "prefetch": True})

def loaded(info):
    w.show_fitted()
    w.send("Once upon a time")

def done(reply):
    w.poll()
    app.processEvents()
    g, a = w.frameGeometry(), w.screen().availableGeometry()
    print(json.dumps(layout_report(w) | {
        "frame": g.getRect(), "available": a.getRect(), "replied": reply is not None,
    }))
    app.quit()

w.modelLoaded.connect(loaded)
w.replyDone.connect(done)
w.chat.max_tokens.setValue(24)
app.exec()
# as expertstream-gui ends (app.main.main): the window deleted, the engine thread idle
import shiboken6
from app.worker import ServiceThread
w.close()
shiboken6.delete(w)
ServiceThread.drain_all()
"""


@pytest.mark.parametrize("width,height", [(1366, 768), (1280, 720)])
def test_the_window_fits_a_laptop_screen(tmp_path, width, height):
    """On a 1366x768 or 1280x720 screen (Qt's offscreen platform given that screen) the
    window opens within the screen, maximized, and after a reply shows every control
    and the status bar whole, the heat maps' rows and the live plots readable."""
    config = tmp_path / "screen.json"
    screen = {"name": "laptop", "x": 0, "y": 0, "width": width, "height": height}
    config.write_text(json.dumps({"screens": [screen | {"logicalDpi": 96}]}))
    env = os.environ | {"QT_QPA_PLATFORM": f"offscreen:configfile={config}"}
    out = subprocess.run(
        [sys.executable, "-c", SCREEN_SCRIPT, os.path.dirname(__file__)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout.splitlines()[-1])
    assert report["replied"]
    assert report["available"] == [0, 0, width, height]
    x, y, w, h = report["frame"]
    assert x >= 0 and y >= 0 and x + w <= width and y + h <= height, report["frame"]
    assert w >= width - 8 and h >= height - 8  # maximized: the screen's room is used
    assert report["clipped"] == [] and report["squeezed"] == []
    assert min(report["layer_px"]) >= MIN_LAYER_PX, report["layer_px"]
    assert report["series_px"] >= MIN_SERIES_PX


def test_the_window_fits_a_laptop_under_a_window_manager(qtbot):
    """A 1280x720 laptop under a desktop's top bar and a title bar leaves about
    1280x650 to the window: its minimum size fits that, and at that size every control
    shows whole and the heat maps' rows keep their height."""
    w = MainWindow(MODEL, SETTINGS)
    qtbot.addWidget(w)
    with qtbot.waitSignal(w.modelLoaded, timeout=TIMEOUT_MS):
        w.resize(1280, 650)
        w.show()
    assert chat_turn(qtbot, w, "Once upon a time", 16) is not None
    w.poll()
    minimum = w.minimumSizeHint()
    assert minimum.width() <= 1280 and minimum.height() <= 650, minimum
    report = layout_report(w)
    assert report["clipped"] == [] and report["squeezed"] == []
    assert min(report["layer_px"]) >= MIN_LAYER_PX, report["layer_px"]
    assert report["series_px"] >= MIN_SERIES_PX


def model_info(host_tier: bool = False) -> ModelInfo:
    tier = 16 if host_tier else 0  # host-tier slots per layer
    plan = MemoryPlan(
        config=StreamConfig(expert_slots=8),
        real_slots=(8,) * 4,
        layer_slots=(16, 8, 8, 8),
        side_rows=(0, 4, 4, 4),
        scratch_rows=4,
        record_bytes=(1000,) * 4,
        reader_threads=2,
        io_uring_depth=0,
        pool_bytes=0,
        layer_scratch_bytes=0,
        staging_bytes=0,
        tier_slots=tier,
        tier_bytes=tier * 4 * 1000,
        dense_bytes=0,
        available=None,
    )
    return ModelInfo(
        name="m", path="m", store_path="s", layers=[1, 2, 3, 4], num_experts=32, top_k=4,
        config=StreamConfig(expert_slots=8, side_slots=4, prefetch=True), plan=plan,
        chat_template=False, pool_bytes=0, budget=None, load_seconds=0.0, context=None,
    )  # fmt: skip


def test_rows_a_layer_lacks_have_a_colour_of_their_own_in_the_key(qtbot):
    """The cells of rows a layer does not have (layer 0 holds its side rows as slots,
    the others have fewer slots) are neither the background nor any row's state, and
    the key names them."""
    assert STATE_COLORS[ABSENT] != BACKGROUND
    assert len(set(STATE_COLORS)) == len(STATE_COLORS)
    panel = InspectorPanel()
    qtbot.addWidget(panel)
    keys = [label.text() for label in panel.findChildren(QLabel)]
    assert all(name in keys for name in STATE_NAMES) and STATE_NAMES[ABSENT] == "no row"
    # the map's lookup table draws ABSENT in its key's colour
    lut = panel.occupancy.image.lut
    assert tuple(lut[ABSENT]) == tuple(int(STATE_COLORS[ABSENT][i : i + 2], 16) for i in (1, 3, 5))


def _plots(widget) -> list[pg.PlotItem]:
    return [i for i in widget.findChildren(pg.GraphicsLayoutWidget) for i in i.ci.items]


def test_plots_before_a_model_show_no_default_range_or_multiplier(qtbot):
    """Before a model or a trace, the heat maps span an empty unit square with no
    ticks, the advisor's axes have no budget ticks, and no axis says "(x0.001)"."""
    inspector, advisor = InspectorPanel(), AdvisorPanel()
    for panel in (inspector, advisor):
        qtbot.addWidget(panel)
        panel.resize(700, 600)
        panel.show()
    qtbot.wait(50)
    plots = [p for w in (inspector, advisor) for p in _plots(w) if isinstance(p, pg.PlotItem)]
    assert len(plots) == 2 + 5 + 2
    for plot in plots:
        for name in ("left", "bottom", "top"):
            assert "(x" not in plot.getAxis(name).labelString(), (plot, name)
        (x0, x1), _ = plot.viewRange()
        assert -5.1 < x0 < x1 < 1.1, plot.viewRange()
    for view in (inspector.occupancy, inspector.frequency):
        assert view.plot.viewRange() == [[0, 1], [0, 1]]
        assert view.plot.getAxis("bottom")._tickLevels == [[], []]
    assert advisor.plot.hits.getAxis("bottom")._tickLevels == [[], []]
    assert not any(line.isVisible() for pair in advisor.plot.lines for line in pair)


def test_fills_in_flight_are_ticked_in_whole_numbers(qtbot):
    """A plot of a count ticks whole numbers only: 0 and 3 for a peak of 3 fills, not
    1.5; the rates tick their middle too."""
    assert y_ticks(3, integer=True) == [(0, "0"), (3, "3")]
    assert y_ticks(4, integer=True) == [(0, "0"), (2, "2"), (4, "4")]
    assert y_ticks(1, integer=True) == [(0, "0"), (1, "1")]
    assert y_ticks(1.5) == [(0, "0"), (0.75, "0.75"), (1.5, "1.5")]
    view = SeriesView()
    qtbot.addWidget(view)
    series = LiveSeries()
    totals = {"hits": 0, "misses": 0, "side_hits": 0, "bytes_read": 0, "inflight": 0}
    for t, inflight in enumerate([0, 3, 1, 2]):
        series.sample(float(t), totals | {"inflight": inflight}, 0)
    view.draw(series, 3.0)
    plot = view.plots[[key for key, *_ in SERIES].index("inflight")]
    ticks = plot.getAxis("left")._tickLevels[0]
    assert [v for v, _ in ticks] == [0, 3] and all(float(v).is_integer() for v, _ in ticks)
    assert plot.viewRange()[1][1] == pytest.approx(3 * 1.02, abs=0.1)


def test_the_host_memory_row_shows_only_with_a_host_tier(qtbot):
    """ "host memory hits / bytes" is MLX CUDA's host tier: hidden on a model without
    one (the CPU, Metal, --host-memory off), shown with one."""
    panel = InspectorPanel()
    qtbot.addWidget(panel)
    panel.show()
    row = panel.total_names["host_tier"]
    assert row.isHidden() and panel.totals["host_tier"].isHidden()
    panel.set_model(model_info(host_tier=False))
    assert row.isHidden()
    panel.set_model(model_info(host_tier=True))
    assert not row.isHidden() and not panel.totals["host_tier"].isHidden()
    # the other totals keep their places, three to a row
    places = [panel.grid.getItemPosition(panel.grid.indexOf(w))[:2] for w in panel.totals.values()]
    every = [divmod(i, 3) for i in range(len(TOTALS))]  # the inspector's 16 totals
    assert len(TOTALS) == 16 and sorted((r, (c - 1) // 2) for r, c in places) == every
    panel.set_model(model_info(host_tier=False))
    assert row.isHidden()
    assert np.array_equal(panel.occupancy.image.image.shape, (4, 16 + 8))
