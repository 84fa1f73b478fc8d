"""The chat view: transcript with tokens appearing as they arrive, prompt box, Send /
Stop / New chat, sampling settings and the last reply's figures."""

from typing import TYPE_CHECKING

from PySide6.QtCore import Qt, QTimer, Signal
from PySide6.QtGui import QColor, QFont, QKeyEvent, QTextCharFormat, QTextCursor
from PySide6.QtWidgets import (
    QDoubleSpinBox,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QPlainTextEdit,
    QPushButton,
    QSpinBox,
    QTextBrowser,
    QVBoxLayout,
    QWidget,
)

from engine.chat import joiner
from engine.memory import human_bytes

if TYPE_CHECKING:  # engine.generate imports MLX, which the engine thread imports first
    from engine.generate import GenerationResult

FLUSH_MS = 50  # longest a received token waits to be shown
USER_COLOR = "#7cc4ff"
REPLY_COLOR = "#e6e6e6"
NOTE_COLOR = "#8a93a3"
ERROR_COLOR = "#ff7b72"


def _fmt(color: str, bold: bool = False, italic: bool = False) -> QTextCharFormat:
    f = QTextCharFormat()
    f.setForeground(QColor(color))
    f.setFontWeight(QFont.Weight.Bold if bold else QFont.Weight.Normal)
    f.setFontItalic(italic)
    return f


class PromptEdit(QPlainTextEdit):
    """A few lines of prompt; Enter sends, Shift+Enter starts a new line."""

    submitted = Signal()

    def keyPressEvent(self, event: QKeyEvent) -> None:  # noqa: N802  (Qt override)
        if event.key() in (Qt.Key.Key_Return, Qt.Key.Key_Enter) and not (
            event.modifiers() & Qt.KeyboardModifier.ShiftModifier
        ):
            self.submitted.emit()
            return
        super().keyPressEvent(event)


class ChatPanel(QWidget):
    """Renders the conversation; emits what the user asks for."""

    sendRequested = Signal(str)
    stopRequested = Signal()
    newChatRequested = Signal()

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.continuation = True
        self._text = ""  # what the transcript shows, for plain-continuation spacing
        self._pending: list[str] = []  # reply text not yet shown
        self._reply_tokens = 0
        self._flush_timer = QTimer(self, singleShot=True, interval=FLUSH_MS)
        self._flush_timer.timeout.connect(self.flush)

        self.transcript = QTextBrowser()
        self.transcript.setObjectName("transcript")
        self.transcript.setOpenLinks(False)

        self.prompt = PromptEdit()
        self.prompt.setObjectName("prompt")
        self.prompt.setPlaceholderText("Type a message. Enter sends, Shift+Enter: new line.")
        self.prompt.setFixedHeight(64)
        self.prompt.submitted.connect(self._submit)

        self.send_button = QPushButton("Send")
        self.send_button.setObjectName("primary")
        self.send_button.clicked.connect(self._submit)
        self.stop_button = QPushButton("Stop")
        self.stop_button.clicked.connect(self.stopRequested)
        self.new_button = QPushButton("New chat")
        self.new_button.clicked.connect(self.newChatRequested)

        self.temperature = QDoubleSpinBox(
            decimals=2, minimum=0.0, maximum=2.0, singleStep=0.1, value=0.0
        )
        self.temperature.setToolTip("Sampling temperature; 0 is greedy (deterministic).")
        self.top_p = QDoubleSpinBox(
            decimals=2, minimum=0.01, maximum=1.0, singleStep=0.05, value=1.0
        )
        self.top_p.setToolTip(
            "Nucleus sampling: keep the smallest set of tokens whose "
            "probability adds up to top-p (1: all)."
        )
        self.system = QLineEdit()
        self.system.setObjectName("system")
        self.system.setPlaceholderText("System prompt (for models with a chat template)")
        self.max_tokens = QSpinBox(minimum=1, maximum=8192, value=128)
        self.max_tokens.setToolTip("Longest reply, in tokens.")

        self.figures = QLabel("No reply yet.")
        self.figures.setObjectName("figures")
        self.figures.setWordWrap(True)

        buttons = QHBoxLayout()
        buttons.addWidget(self.send_button)
        buttons.addWidget(self.stop_button)
        buttons.addStretch(1)
        buttons.addWidget(self.new_button)

        row = QHBoxLayout()
        for label, box in (
            ("temperature", self.temperature),
            ("top-p", self.top_p),
            ("max tokens", self.max_tokens),
        ):
            row.addWidget(QLabel(label))
            row.addWidget(box)
            row.addSpacing(8)
        row.addStretch(1)

        # the title and the system prompt share a row: the window must fit a laptop's
        # 720 pixels of height with the inspector's plots readable
        top = QHBoxLayout()
        title = QLabel("Chat")
        title.setObjectName("title")
        top.addWidget(title)
        top.addSpacing(8)
        top.addWidget(self.system, 1)

        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.addLayout(top)
        layout.addWidget(self.transcript, 1)
        layout.addWidget(self.prompt)
        layout.addLayout(buttons)
        layout.addLayout(row)
        layout.addWidget(self.figures)
        self.set_state(ready=False, generating=False)

    def _submit(self) -> None:
        text = self.prompt.toPlainText()
        if text.strip() and self.send_button.isEnabled():
            self.sendRequested.emit(text)

    def settings(self) -> dict:
        """The reply settings: system (prompt), max_tokens, temperature, top_p."""
        return {
            "system": self.system.text() if not self.continuation else "",
            "max_tokens": self.max_tokens.value(),
            "temperature": self.temperature.value(),
            "top_p": self.top_p.value(),
        }

    def set_mode(self, chat_template: bool) -> None:
        """Chat-template models show turns as blocks; others one continued text."""
        self.continuation = not chat_template
        self.system.setEnabled(chat_template)
        self.system.setToolTip(
            "Sent first, as the system message of the chat template."
            if chat_template
            else "This model has no chat template: it continues text, without a system prompt."
        )
        self.transcript.setPlaceholderText(
            "Write the start of a story and press Enter: this model continues text "
            "(it has no chat template)."
            if self.continuation
            else "Say something and press Enter."
        )

    def set_state(self, ready: bool, generating: bool) -> None:
        """Enables Send when a model is ready and no reply runs; Stop while one runs."""
        self.send_button.setEnabled(ready and not generating)
        self.stop_button.setEnabled(generating)

    def _insert(self, text: str, fmt: QTextCharFormat, new_block: bool = False) -> None:
        bar = self.transcript.verticalScrollBar()
        at_bottom = bar.value() >= bar.maximum() - 4
        cursor = self.transcript.textCursor()
        cursor.movePosition(QTextCursor.MoveOperation.End)
        if new_block and not self.transcript.document().isEmpty():
            cursor.insertBlock()
        cursor.insertText(text, fmt)
        if at_bottom:
            bar.setValue(bar.maximum())

    def show_user(self, text: str) -> None:
        """Shows a sent message and clears the prompt box."""
        self.prompt.clear()
        if self.continuation:
            piece = joiner(self._text, text) + text
            self._insert(piece, _fmt(USER_COLOR, bold=True))
            self._text += piece
        else:
            self._insert("You", _fmt(NOTE_COLOR, bold=True), new_block=True)
            self._insert(text, _fmt(USER_COLOR), new_block=True)
            self._insert("Model", _fmt(NOTE_COLOR, bold=True), new_block=True)
            self._insert("", _fmt(REPLY_COLOR), new_block=True)

    def append_reply(self, text: str) -> None:
        """Queues one token's text; it is shown within FLUSH_MS (one text insertion and
        one repaint per batch, not per token: the GUI thread stays out of the way of
        the worker's GIL)."""
        self._pending.append(text)
        self._reply_tokens += 1
        if not self._flush_timer.isActive():
            self._flush_timer.start()

    def flush(self) -> None:
        """Shows the queued reply text now."""
        self._flush_timer.stop()
        text = "".join(self._pending)
        self._pending.clear()
        if text:
            self._insert(text, _fmt(REPLY_COLOR))
            self._text += text
        if self._reply_tokens:
            self.figures.setText(f"Generating… {self._reply_tokens} tokens")

    def show_note(self, text: str, error: bool = False) -> None:
        """A line of its own in the transcript (loads, errors); not part of the chat."""
        self.flush()
        self._reply_tokens = 0
        color = ERROR_COLOR if error else NOTE_COLOR
        self._insert(("⚠ " if error else "") + text, _fmt(color, italic=not error), new_block=True)
        self._insert("", _fmt(REPLY_COLOR), new_block=True)
        self._text = ""

    def end_reply(self, reply: "GenerationResult") -> None:
        """Shows the rest of the reply and its figures."""
        self.flush()
        self._reply_tokens = 0
        c = reply.cache
        stopped = " (stopped)" if reply.stopped else ""
        kept = f" (+{reply.cached_tokens} kept)" if reply.cached_tokens else ""
        prefill, decode, hit_rate = (
            "—" if v is None else format(v, spec)  # a rate of nothing (stopped early)
            for v, spec in (
                (reply.prefill_tps, ".1f"),
                (reply.decode_tps, ".1f"),
                (c["hit_rate"], ".1%"),
            )
        )
        self.figures.setText(
            f"Last reply{stopped}: {len(reply.tokens)} tokens · prompt {reply.prompt_tokens}{kept}"
            f" · prefill {prefill} tok/s · decode {decode} tok/s"
            f" · hit rate {hit_rate} · read {human_bytes(c['bytes_read'])}"
        )

    def clear(self) -> None:
        """Empties the transcript (New chat)."""
        self._pending.clear()
        self.transcript.clear()
        self._text = ""
