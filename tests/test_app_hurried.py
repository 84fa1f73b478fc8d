"""The app under a hurried user, offscreen on the embedded model.

New chat, a second Enter and Open model while a reply streams, and closing the window
during a conversion: each is queued or cancels cleanly, tokens never land in the wrong
turn, and the app's process exits 0. (Closing during a reply, switching model mid-reply
and rapid live toggles are in test_app_resilience.py.)
"""

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import test_app  # noqa: E402
from PySide6.QtCore import Qt  # noqa: E402
from test_app import MODEL, PROMPT, TIMEOUT_MS, chat_turn  # noqa: E402

from app.conversation import ASSISTANT, USER  # noqa: E402

window = test_app.window  # the fixture: the app's window on the embedded model, loaded

WAIT_MS = 30_000
ROOT = Path(__file__).resolve().parents[1]


def at_token(w, n: int, action) -> None:
    """Runs `action()` once, when the reply in progress shows its `n`-th token."""

    def hook(shown):
        if shown == n:
            w.tokenShown.disconnect(hook)
            action()

    w.tokenShown.connect(hook)


def test_new_chat_while_a_reply_streams(window, qtbot):
    """New chat mid-reply stops the reply and clears the conversation once it has ended;
    no token of the stopped reply reaches the new chat."""
    at_token(window, 3, window.new_chat)
    stopped = chat_turn(qtbot, window, PROMPT, 200)
    assert stopped is not None and stopped.stopped and len(stopped.tokens) < 200
    assert window.conversation.turns == []
    assert window.chat.transcript.toPlainText() == ""
    reply = chat_turn(qtbot, window, "The cat", 8)
    assert reply is not None and not reply.stopped and len(reply.tokens) == 8
    assert window.reply_tokens == reply.tokens
    assert window.conversation.turns == [(USER, "The cat"), (ASSISTANT, reply.text)]
    assert window.chat.transcript.toPlainText() == "The cat" + reply.text


def test_second_enter_while_a_reply_streams(window, qtbot):
    """Enter pressed again (with a new message typed) while a reply streams sends
    nothing: the message stays in the box, and goes with the next Enter."""

    def second_enter():
        window.chat.prompt.setPlainText(" Then the dog")
        qtbot.keyClick(window.chat.prompt, Qt.Key.Key_Return)
        qtbot.keyClick(window.chat.prompt, Qt.Key.Key_Enter)
        window.send(" Then the dog")  # the command itself refuses too
        assert window.busy == "generating"

    at_token(window, 2, second_enter)
    first = chat_turn(qtbot, window, PROMPT, 12)
    assert first is not None and len(first.tokens) == 12
    assert window.conversation.turns == [(USER, PROMPT), (ASSISTANT, first.text)]
    assert window.chat.prompt.toPlainText() == " Then the dog"
    with qtbot.waitSignal(window.replyDone, timeout=TIMEOUT_MS) as done:
        qtbot.keyClick(window.chat.prompt, Qt.Key.Key_Return)
    second = done.args[0]
    assert second is not None and window.reply_tokens == second.tokens
    assert window.conversation.turns == [
        (USER, PROMPT),
        (ASSISTANT, first.text),
        (USER, " Then the dog"),
        (ASSISTANT, second.text),
    ]


def test_every_command_at_once_while_a_reply_streams(window, qtbot, tmp_path):
    """Enter, New chat and Open model in one burst mid-reply: the reply stops, the chat
    is cleared, the model loads after it, and the next reply is whole."""
    source = tmp_path / "other-model"
    shutil.copytree(MODEL, source)

    def burst():
        qtbot.keyClick(window.chat.prompt, Qt.Key.Key_Return)
        window.new_chat()
        window.open_model(str(source))
        assert window.pending is not None

    at_token(window, 2, burst)
    with qtbot.waitSignal(window.modelLoaded, timeout=TIMEOUT_MS):
        stopped = chat_turn(qtbot, window, PROMPT, 300)
        assert stopped is not None and stopped.stopped
    assert window.info.name == "other-model" and window.busy is None
    assert window.conversation.turns == [] and window.pending is None
    reply = chat_turn(qtbot, window, PROMPT, 6)
    assert reply is not None and len(reply.tokens) == 6
    assert window.conversation.turns == [(USER, PROMPT), (ASSISTANT, reply.text)]


def test_closing_the_window_during_a_conversion(tmp_path):
    """The app opens a model directory that needs converting and is closed at the first
    progress report: the conversion is cancelled, nothing half-written stays in the store
    cache, and the process exits 0. The conversion is held at that report until the
    close has asked it to stop (else, on a loaded machine, the small model's conversion
    could end before the close reaches it)."""
    source = tmp_path / "fresh-model"
    shutil.copytree(MODEL, source)
    config = source / "config.json"
    config.write_text(config.read_text().replace("{", '{"_variant": 1, ', 1))  # a new store
    cache = tmp_path / "cache"
    code = f"""
        import sys
        from PySide6.QtWidgets import QApplication
        from app import worker
        from app.window import MainWindow

        real = worker.Worker._progress

        def held(self, done, total):
            real(self, done, total)  # reports; raises once the close asked to cancel
            self._cancel.wait(60)
            real(self, done, total)

        worker.Worker._progress = held
        app = QApplication([])
        w = MainWindow({str(source)!r}, {{}})
        progress = []

        def on_progress(done, total):
            progress.append(done)
            if len(progress) == 1:
                print("closing at", done, "of", total, flush=True)
                w.close()
                app.quit()

        w.engine.worker.loadProgress.connect(on_progress)
        w.modelLoaded.connect(lambda info: print("loaded", info.name, flush=True))
        w.show()
        code = app.exec()
        print("exit", code, "progress", len(progress), flush=True)
        sys.exit(code)
    """
    env = os.environ | {"EXPERTSTREAM_CACHE": str(cache), "QT_QPA_PLATFORM": "offscreen"}
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=WAIT_MS / 1000 * 4,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "closing at" in out.stdout and "loaded" not in out.stdout, out.stdout
    assert "Traceback" not in out.stderr, out.stderr
    # Cancelled: no store, and no temporary directory left behind.
    assert not cache.exists() or list(cache.iterdir()) == [], list(cache.iterdir())
