"""The main window: wires the chat, the controls and the inspector to the engine thread.

The window keeps the conversation and the app's state (no model / loading / generating /
idle). Loads asked for while a reply runs are queued and start when it ends; the
inspector polls the engine's snapshot from a QTimer, on the GUI thread, without waiting
for the worker.
"""

import dataclasses
import time
from typing import TYPE_CHECKING

from PySide6.QtCore import QSize, Qt, QTimer, Signal
from PySide6.QtGui import QAction, QCloseEvent, QIcon, QKeySequence
from PySide6.QtWidgets import (
    QApplication,
    QFileDialog,
    QInputDialog,
    QLabel,
    QMainWindow,
    QProgressBar,
    QSplitter,
    QTabWidget,
    QVBoxLayout,
    QWidget,
)

from app.advisor import AdvisorPanel, AdvisorRunner
from app.chat import ChatPanel
from app.controls import LIVE_LABELS, ControlsPanel, summary
from app.conversation import ASSISTANT, USER, Conversation
from app.inspector import InspectorPanel
from app.worker import EngineClient, ModelInfo
from engine.hub import parse_id
from engine.memory import human_bytes
from engine.resources import resources_dir

if TYPE_CHECKING:  # engine.generate imports MLX, which the engine thread imports first
    from engine.generate import GenerationResult

POLL_HZ = 10.0
# The window's size where the screen has room for it (and its frame); on a smaller screen
# it opens maximized, within the screen's available area, which its minimum size fits
# down to a 1280x720 laptop's.
PREFERRED_SIZE = QSize(1480, 940)
FRAME_ROOM = QSize(16, 48)  # a window manager's borders and title bar


def icon_path() -> str:
    """The app icon (SVG)."""
    return str(resources_dir() / "icons" / "expertstream.svg")


def apply_style(app: QApplication) -> None:
    """The app's style sheet and icon."""
    qss = resources_dir() / "style.qss"
    if qss.is_file():
        app.setStyleSheet(qss.read_text())
    app.setWindowIcon(QIcon(icon_path()))


class MainWindow(QMainWindow):
    """ExpertStream's window. Opens `model_path` (None: the embedded model) with
    StreamConfig `overrides` over the app defaults.

    Signals (for scripts and tests): `modelLoaded(ModelInfo)`, `tokenShown(n)` when the
    n-th token of a reply arrives (its text is on screen within `chat.FLUSH_MS`),
    `replyDone(GenerationResult | None)` (None: the reply failed).
    """

    modelLoaded = Signal(object)
    tokenShown = Signal(int)
    replyDone = Signal(object)

    def __init__(
        self, model_path: str | None = None, overrides: dict | None = None, poll_hz: float = POLL_HZ
    ):
        super().__init__()
        self.setWindowTitle("ExpertStream")
        self.setWindowIcon(QIcon(icon_path()))
        self.resize(PREFERRED_SIZE)
        self.info: ModelInfo | None = None
        self.busy: str | None = None  # "loading" | "generating" | None
        self.pending: tuple[str | None, dict] | None = None
        self.conversation = Conversation()
        self.reply_tokens: list[int] = []
        self.last_reply: GenerationResult | None = None
        self.tokens_received = 0
        self._clear_after_reply = False
        self.decode = [0, 0.0]  # decode tokens and seconds of this model's replies
        self._writing = "converting"  # what a first use's progress bar says it does

        self.engine = EngineClient()
        w = self.engine.worker
        w.loadProgress.connect(self._on_progress)
        w.firstUse.connect(self._on_first_use)
        w.downloadProgress.connect(self._on_download_progress)
        w.loaded.connect(self._on_loaded)
        w.loadFailed.connect(self._on_load_failed)
        w.token.connect(self._on_token)
        w.replyFinished.connect(self._on_reply_finished)
        w.replyFailed.connect(self._on_reply_failed)

        self.chat = ChatPanel()
        self.controls = ControlsPanel()
        self.inspector = InspectorPanel()
        self.advisor = AdvisorPanel()
        self.advisor_runner = AdvisorRunner()
        self.advisor.trace_tokens.setValue(self.engine.worker.trace_tokens)
        self.advisor.analyzeRequested.connect(self.analyze)
        self.advisor.applyRequested.connect(self.apply_budget)
        self.advisor.saveTraceRequested.connect(self.save_trace)
        self.advisor.traceTokensChanged.connect(self.engine.set_trace_tokens)
        self.advisor_runner.finished.connect(self.advisor.show_result)
        # bound methods of the panel's widgets, not lambdas: a sweep that ends after the
        # window is gone then reaches no deleted widget
        self.advisor_runner.failed.connect(self.advisor.show_failed)
        self.advisor_runner.stopped.connect(self.advisor.show_stopped)
        self.chat.sendRequested.connect(self.send)
        self.chat.stopRequested.connect(self.stop)
        self.chat.newChatRequested.connect(self.new_chat)
        self.controls.liveToggled.connect(self.set_live)
        self.controls.rebuildRequested.connect(self.rebuild)
        self.controls.openRequested.connect(self.open_model)

        left = QWidget()
        left_layout = QVBoxLayout(left)
        left_layout.setContentsMargins(10, 8, 6, 8)
        left_layout.addWidget(self.chat, 1)
        left_layout.addWidget(self.controls)
        right = QWidget()
        right_layout = QVBoxLayout(right)
        right_layout.setContentsMargins(6, 8, 10, 8)
        self.tabs = QTabWidget()
        self.tabs.addTab(self.inspector, "Inspector")
        self.tabs.addTab(self.advisor, "Advisor")
        right_layout.addWidget(self.tabs)
        splitter = QSplitter(Qt.Orientation.Horizontal)
        splitter.addWidget(left)
        splitter.addWidget(right)
        splitter.setStretchFactor(0, 4)
        splitter.setStretchFactor(1, 5)
        splitter.setSizes([620, 860])
        self.setCentralWidget(splitter)

        self.progress = QProgressBar()
        self.progress.setMaximumWidth(260)
        self.progress.setTextVisible(True)
        self.progress.hide()
        self.state_label = QLabel()
        self.statusBar().addPermanentWidget(self.progress)
        self.statusBar().addPermanentWidget(self.state_label)
        self._menus()
        # Keys go to the message box from the start, as in any chat window.
        self.chat.prompt.setFocus()

        self.timer = QTimer(self)
        self._polls = 0
        self.timer.timeout.connect(self._tick)
        if poll_hz > 0:
            self.timer.start(int(1000 / poll_hz))
        self.request_load(model_path, overrides or {})

    def show_fitted(self) -> None:
        """Shows the window at `PREFERRED_SIZE` where its screen's available area holds
        it, else maximized (the window manager fits it to the area)."""
        screen = self.screen() or QApplication.primaryScreen()
        room = screen.availableGeometry().size()
        if (PREFERRED_SIZE + FRAME_ROOM).boundedTo(room) == PREFERRED_SIZE + FRAME_ROOM:
            self.resize(PREFERRED_SIZE)
            self.show()
        else:
            self.showMaximized()

    def _menus(self) -> None:
        menu = self.menuBar().addMenu("&File")
        for text, key, slot in (
            ("&Open model…", QKeySequence.StandardKey.Open, self.open_model),
            ("Open from the &Hub…", QKeySequence(), self.open_hub_model),
            ("&New chat", QKeySequence.StandardKey.New, self.new_chat),
            ("Save routing &trace…", QKeySequence.StandardKey.Save, self.save_trace),
            ("&Quit", QKeySequence.StandardKey.Quit, self.close),
        ):
            action = QAction(text, self)
            action.setShortcut(key)
            action.triggered.connect(lambda _=False, slot=slot: slot())
            menu.addAction(action)

    # state
    def _set_busy(self, busy: str | None) -> None:
        self.busy = busy
        self.chat.set_state(
            ready=self.info is not None and busy is None, generating=busy == "generating"
        )
        self.controls.apply_button.setEnabled(self.info is not None)
        self.state_label.setText(
            {"loading": "loading…", "generating": "generating…"}.get(
                busy, "ready" if self.info else "no model"
            )
        )

    def _message(self, text: str, error: bool = False, keep: bool = False) -> None:
        """Shows `text` in the status bar: 8 s, or until the next message for an error
        or a note to `keep`."""
        self.statusBar().showMessage(text, 0 if error or keep else 8000)

    # commands
    def send(self, text: str) -> None:
        """Sends a user message and starts the reply (refused while busy)."""
        if self.info is None or self.busy is not None:
            self._message(f"Cannot send now: {self.busy or 'no model is loaded'}.")
            return
        self.conversation.add(USER, text)
        self.chat.show_user(text)
        self.reply_tokens = []
        self.chat.figures.setText("Generating…")
        self._set_busy("generating")
        self.advisor_runner.stop()  # the replay yields the GIL to the reply
        self.engine.generate(self.conversation, **self.chat.settings())

    def stop(self) -> None:
        """Ends the reply after its current token."""
        if self.busy == "generating":
            self.engine.stop()
            self._message("Stopping…")

    def new_chat(self) -> None:
        """Forgets the conversation (after stopping the reply in progress)."""
        if self.busy == "generating":
            self._clear_after_reply = True
            self.engine.stop()
            return
        self.conversation.clear()
        self.chat.clear()
        self._message("New chat.")

    def set_live(self, name: str, on: bool) -> None:
        """Applies a live toggle now; it takes effect at the next forward."""
        self.engine.set_live(name, on)
        if name == "side_lfu":
            self.inspector.occupancy.set_side_lfu(on)
        self._message(
            f"{LIVE_LABELS[name][0]} {'on' if on else 'off'}: from the next forward pass."
        )

    def rebuild(self, fields: dict) -> None:
        """Reloads the current model with pool settings `fields` (other StreamConfig
        fields as they are)."""
        if self.info is None:
            self._message("No model to rebuild: open one first.")
            return
        self.request_load(self.info.path, dataclasses.asdict(self.info.config) | fields)

    def apply_budget(self, slots: int) -> None:
        """Sets the expert slots to `slots` and rebuilds the pool (after the reply in
        progress, if any)."""
        self.controls.expert_slots.setValue(slots)
        self.rebuild(self.controls.pool())

    def analyze(self) -> None:
        """Replays the session's routing at a sweep of budgets on the advisor thread
        (refused while a reply runs: it runs again after it)."""
        from engine.advisor import Measured

        status = self.advisor.status.setText
        if self.info is None or self.busy == "generating":
            status("Runs after the reply." if self.info else "No model loaded.")
            return
        trace = self.engine.trace()
        if trace is None or trace.num_tokens == 0:
            status("No routing recorded yet: send a message (and keep some tokens).")
            return
        snap = self.engine.snapshot()
        tokens, seconds = self.decode
        measured = Measured.of(
            tokens / seconds if tokens else None,
            tokens,
            snap.totals() if snap is not None else None,
        )
        status(f"Replaying {trace.num_tokens:,} tokens…")
        self.advisor_runner.analyze(
            trace,
            self.info.config,
            # expert memory gives each layer its own slots: the advisor's uniform
            # equivalent is their mean
            self.info.plan.mean_slots,
            self.info.budget,
            measured,
        )

    def save_trace(self, path: str | None = None) -> None:
        """Saves the session's routing trace as .npz (asks where when `path` is None)."""
        trace = self.engine.trace()
        if trace is None or trace.num_tokens == 0:
            self._message("No routing recorded yet: send a message first.")
            return
        if path is None:
            path, _ = QFileDialog.getSaveFileName(
                self, "Save the routing trace", "trace.npz", "Routing traces (*.npz)"
            )
            if not path:
                return
        try:
            trace.save(path)
        except OSError as e:
            self._message(f"Could not save the trace: {e}", error=True)
            return
        self._message(f"Saved {trace.num_tokens:,} tokens of routing to {path}.")

    def open_model(self, path: str | None = None) -> None:
        """Opens an mlx-lm MoE directory or an expert store (asks for it when None)."""
        if path is None:
            path = QFileDialog.getExistingDirectory(
                self, "Open an mlx-lm MoE model directory or an expert store"
            )
            if not path:
                return
        self.request_load(path, self.controls.live_settings())

    def open_hub_model(self, name: str | None = None) -> None:
        """Opens a model by its Hugging Face Hub id, `org/name[@revision]` (asks for it
        when None): downloaded into the Hugging Face cache where it is not there yet."""
        if name is None:
            name, ok = QInputDialog.getText(
                self,
                "Open from the Hugging Face Hub",
                "Model id, org/name[@revision] (e.g. mlx-community/Qwen3-30B-A3B-4bit):",
            )
            if not ok or not name.strip():
                return
        name = name.strip()
        if parse_id(name) is None:
            self._message(f"{name!r} is not a Hub id: org/name, or org/name@revision.", error=True)
            return
        self.request_load(name, self.controls.live_settings())

    def request_load(self, path: str | None, overrides: dict) -> None:
        """Loads now, or after the reply / load in progress."""
        if self.busy is not None:
            self.pending = (path, overrides)
            what = "reply" if self.busy == "generating" else "load"
            self._message(
                f"Queued: the model is (re)loaded when the {what} in progress "
                "ends" + (" (Stop to apply now)." if what == "reply" else ".")
            )
            return
        self._set_busy("loading")
        self.progress.setRange(0, 0)
        self.progress.show()
        name = "the embedded model" if path is None else path
        self._message(f"Loading {name}…")
        self.engine.load(path, overrides)

    def _run_pending(self) -> None:
        if self.pending is not None and self.busy is None:
            path, overrides = self.pending
            self.pending = None
            self.request_load(path, overrides)

    def _tick(self) -> None:
        self._polls += 1
        self.poll(full=self._polls % 2 == 0)

    def poll(self, full: bool = True) -> None:
        """Draws the engine's current snapshot; the timer redraws the slow-changing
        plots every other poll (`full`), see `InspectorPanel.show_snapshot`."""
        info = self.info
        snap = self.engine.snapshot()
        if info is None or snap is None:
            return
        slots = max(
            info.plan.layer_slots, default=0
        )  # the widest layer's (expert memory, side rows)
        if snap.slot_expert.shape[1] != slots or snap.side_expert.shape[1] != (
            2 * info.config.side_slots
        ):
            return  # a reload swapped the model; its `loaded` signal is on its way
        self.inspector.show_snapshot(snap, time.monotonic(), self.tokens_received, full)

    # worker signals
    def _on_first_use(self, what: str) -> None:
        self._writing = what

    def _on_progress(self, done: float, total: float, what: str | None = None) -> None:
        what = what or self._writing
        self.progress.setRange(0, 1000)
        self.progress.setValue(int(1000 * done / total) if total else 0)
        self.progress.setFormat(f"{what} %p%  ({human_bytes(done)} / {human_bytes(total)})")

    def _on_download_progress(self, done: float, total: float) -> None:
        self._on_progress(done, total, "downloading")

    def _on_loaded(self, info: ModelInfo) -> None:
        # What the boxes ask, the side rows' prefetch included (before set_model shows
        # the new pool): a box that differs from the loaded config was toggled while loading.
        wanted = self.controls.wanted_live() if self.info else {}
        self.info = info
        self.decode = [0, 0.0]  # measured figures are this budget's
        self.progress.hide()
        self.controls.set_model(info)
        self.inspector.set_model(info)
        self.chat.set_mode(info.chat_template)
        # a reply needs one prompt token at least: the whole context never fits
        self.chat.max_tokens.setMaximum(info.context - 1 if info.context else 8192)
        for name, on in wanted.items():  # toggled while loading
            if on != getattr(info.config, name) and self.controls.live[name].isEnabled():
                self.controls.live[name].setChecked(on)
        self.setWindowTitle(f"ExpertStream · {info.name}")
        self.chat.show_note(f"Loaded {info.name} in {info.load_seconds:.1f} s: {summary(info)}.")
        if info.note:  # the settings changed to fit: kept in view until the next message
            self.chat.show_note(f"{info.note}.")
            self._message(f"Loaded {info.name}: {info.note}.", keep=True)
        else:
            self._message(f"Loaded {info.name}.")
        if info.compile_note:
            self.chat.show_note(f"{info.compile_note}.")
        self._set_busy(None)
        self.modelLoaded.emit(info)
        self._run_pending()

    def _on_load_failed(self, message: str) -> None:
        self.progress.hide()
        self.chat.show_note(message, error=True)
        self._message(message, error=True)
        if self.info is None:
            self.controls.model_label.setText("No model loaded: use Open model…")
        self._set_busy(None)
        self._run_pending()

    def _on_token(self, text: str, token: int) -> None:
        self.chat.append_reply(text)
        self.reply_tokens.append(token)
        self.tokens_received += 1
        self.tokenShown.emit(len(self.reply_tokens))

    def _end_reply(self) -> None:
        self._set_busy(None)
        if self._clear_after_reply:
            self._clear_after_reply = False
            self.new_chat()

    def _on_reply_finished(self, reply: "GenerationResult") -> None:
        self.conversation.add(ASSISTANT, reply.text)
        self.last_reply = reply
        self.chat.end_reply(reply)
        if reply.decode_tps:  # mlx-lm's convention: over every token of the reply
            self.decode[0] += len(reply.tokens)
            self.decode[1] += len(reply.tokens) / reply.decode_tps
        self._message(
            f"Reply: {len(reply.tokens)} tokens in {reply.seconds:.1f} s"
            f"{' (stopped)' if reply.stopped else ''}."
        )
        self._end_reply()
        self.replyDone.emit(reply)
        self._run_pending()
        if self.busy is None:
            self.analyze()

    def _on_reply_failed(self, message: str, partial: str) -> None:
        if partial:
            self.conversation.add(ASSISTANT, partial)
            kept = "the partial reply is kept"
        else:
            self.conversation.turns.pop()
            kept = "your message was not added to the conversation; send it again"
        self.chat.show_note(f"Reply failed: {message} ({kept}).", error=True)
        self.chat.figures.setText("Last reply failed (see above).")
        self._message(f"Reply failed: {message}", error=True)
        self._end_reply()
        self.replyDone.emit(None)
        self._run_pending()

    def closeEvent(self, event: QCloseEvent) -> None:  # noqa: N802  (Qt override)
        self.timer.stop()
        self.advisor_runner.stop()
        self.pending = None  # a load queued behind the reply must not start once closed
        self.engine.shutdown()
        super().closeEvent(event)
