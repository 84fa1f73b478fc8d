"""The desktop app under stress, offscreen on the embedded model.

The worker raising mid-reply, Stop during prefill, closing the window during a reply,
switching model mid-reply and toggling the live modes rapidly: no freeze, no crash, the
conversation kept and a clear message. (A read error, a rebuild queued mid-reply and a
single round of live toggles are in test_app.py.)
"""

import os
import shutil
import time

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import pytest  # noqa: E402
import test_app  # noqa: E402
from PySide6.QtCore import Qt, QTimer  # noqa: E402
from test_app import MODEL, PROMPT, TIMEOUT_MS, chat_turn  # noqa: E402

import engine.generate  # noqa: E402
from app.conversation import ASSISTANT, USER  # noqa: E402

window = test_app.window  # the fixture: the app's window on the embedded model, loaded

WAIT_MS = 30_000  # every wait of a step that should take at most a few seconds
# About 550 tokens: its prefill (all experts over capacity) takes a few seconds, and
# Stop / close are only honoured after the prefill's forward (see the tests).
LONG_PROMPT = " ".join(["Once upon a time there was a little cat who liked to play."] * 40)


def raising_after(n: int, monkeypatch):
    """Makes the engine's token stream raise after its `n`-th token."""
    real = engine.generate.stream_generate

    def stream(*args, **kwargs):
        for i, r in enumerate(real(*args, **kwargs)):
            if i == n:
                raise RuntimeError(f"simulated engine fault after {n} tokens")
            yield r

    monkeypatch.setattr(engine.generate, "stream_generate", stream)


def start_reply(qtbot, w, prompt: str, max_tokens: int) -> None:
    """Types `prompt` and clicks Send (greedy); returns without waiting."""
    w.chat.temperature.setValue(0.0)
    w.chat.max_tokens.setValue(max_tokens)
    w.chat.prompt.setPlainText(prompt)
    qtbot.mouseClick(w.chat.send_button, Qt.MouseButton.LeftButton)
    assert w.busy == "generating"


def test_worker_raising_mid_reply_keeps_the_partial_reply(window, qtbot, monkeypatch):
    first = chat_turn(qtbot, window, PROMPT, 6)
    turns = [(USER, PROMPT), (ASSISTANT, first.text)]

    raising_after(5, monkeypatch)
    assert chat_turn(qtbot, window, " Then", 40) is None
    assert len(window.reply_tokens) == 5  # the tokens before the fault reached the view
    partial = window.conversation.turns[-1][1]
    assert partial and window.conversation.turns == turns + [(USER, " Then"), (ASSISTANT, partial)]
    shown = window.chat.transcript.toPlainText()
    assert "simulated engine fault after 5 tokens" in shown and "partial reply is kept" in shown
    assert window.statusBar().currentMessage() == (
        "Reply failed: simulated engine fault after 5 tokens"
    )
    assert window.busy is None and window.chat.send_button.isEnabled()
    assert not window.chat.stop_button.isEnabled()
    turns = list(window.conversation.turns)

    # A fault before the first token: the message is taken back, the user is told.
    raising_after(0, monkeypatch)
    assert chat_turn(qtbot, window, " Lost", 10) is None
    assert window.conversation.turns == turns
    assert "send it again" in window.chat.transcript.toPlainText()

    monkeypatch.undo()
    again = chat_turn(qtbot, window, " And", 6)
    assert again is not None and len(again.tokens) == 6 and not again.stopped
    assert window.conversation.turns == turns + [(USER, " And"), (ASSISTANT, again.text)]


def test_stop_during_prefill_ends_the_reply(window, qtbot):
    # A long prompt, stopped before any token reached the window. The engine polls Stop
    # after each token: the prompt's forward runs to its end, then at most one token.
    prompt = LONG_PROMPT
    window.chat.temperature.setValue(0.0)
    window.chat.max_tokens.setValue(200)
    window.chat.prompt.setPlainText(prompt)
    with qtbot.waitSignal(window.replyDone, timeout=WAIT_MS) as done:
        qtbot.mouseClick(window.chat.send_button, Qt.MouseButton.LeftButton)
        assert window.busy == "generating" and window.reply_tokens == []
        t0 = time.monotonic()
        qtbot.mouseClick(window.chat.stop_button, Qt.MouseButton.LeftButton)
        assert window.statusBar().currentMessage() == "Stopping…"
    qtbot.waitUntil(window.chat.send_button.isEnabled, timeout=WAIT_MS)
    elapsed = time.monotonic() - t0
    reply = done.args[0]
    assert reply is not None and reply.stopped and len(reply.tokens) <= 1
    assert reply.prompt_tokens > 400
    assert elapsed < WAIT_MS / 1000, elapsed
    assert window.busy is None and not window.chat.stop_button.isEnabled()
    assert "(stopped)" in window.statusBar().currentMessage()
    assert window.conversation.turns == [(USER, prompt), (ASSISTANT, reply.text)]

    # The next reply runs to its end: the stop did not stick.
    again = chat_turn(qtbot, window, " The end", 4)
    assert again is not None and len(again.tokens) == 4 and not again.stopped


@pytest.mark.parametrize("when", ["decode", "prefill"])
def test_closing_the_window_during_a_reply(window, qtbot, when):
    prompt = PROMPT if when == "decode" else LONG_PROMPT
    start_reply(qtbot, window, prompt, 1000)
    if when == "decode":
        qtbot.waitUntil(lambda: len(window.reply_tokens) >= 3, timeout=WAIT_MS)
    else:
        qtbot.wait(100)  # the engine thread is in the prompt's forward
        assert window.reply_tokens == []
    assert window.busy == "generating"
    loads = []
    window.engine.worker.loaded.connect(lambda info: loads.append(info.name))
    window.open_model(MODEL)  # queued behind the reply: dropped by the close
    assert window.pending is not None
    t0 = time.monotonic()
    closed = window.close()
    elapsed = time.monotonic() - t0
    assert closed and not window.isVisible()
    assert elapsed < WAIT_MS / 1000, elapsed
    # The engine stopped and dropped the model; the signals still queued for the
    # closed window are delivered without harm, and the queued model switch never runs.
    assert window.engine.snapshot() is None
    qtbot.wait(500)
    assert loads == [] and window.engine.snapshot() is None
    assert len(window.reply_tokens) < 1000
    assert window.conversation.turns[0] == (USER, prompt)


def test_switching_model_mid_reply_waits_for_the_reply(window, qtbot, tmp_path):
    source = tmp_path / "switched-model"
    shutil.copytree(MODEL, source)
    first = chat_turn(qtbot, window, PROMPT, 4)
    turns = [(USER, PROMPT), (ASSISTANT, first.text)]
    loads = []
    window.engine.worker.loaded.connect(lambda info: loads.append(info.name))

    def open_mid_reply(n):
        if n == 2:
            window.open_model(str(source))
            assert window.busy == "generating" and window.pending is not None
            message = window.statusBar().currentMessage()
            assert "Queued" in message and "when the reply in progress ends" in message

    window.tokenShown.connect(open_mid_reply)
    with qtbot.waitSignal(window.modelLoaded, timeout=TIMEOUT_MS) as loaded:
        reply = chat_turn(qtbot, window, " Then", 12)
        window.tokenShown.disconnect(open_mid_reply)
        assert loads == []  # the reply ran to its end on the old model
        assert reply is not None and len(reply.tokens) == 12 and not reply.stopped
        assert window.busy == "loading"
    assert loaded.args[0].name == "switched-model" and window.info.name == "switched-model"
    turns += [(USER, " Then"), (ASSISTANT, reply.text)]
    assert window.conversation.turns == turns
    assert window.busy is None and window.pending is None
    again = chat_turn(qtbot, window, " More", 4)
    assert again is not None
    assert window.conversation.turns == turns + [(USER, " More"), (ASSISTANT, again.text)]


def test_rapid_live_toggles_keep_the_tokens(window, qtbot):
    n_tokens, n_toggles = 64, 30
    baseline = chat_turn(qtbot, window, PROMPT, n_tokens)
    window.new_chat()
    live = window.controls.live
    names = ["prefetch", "side_lfu", "sync"]
    start = {name: live[name].isChecked() for name in names}
    seen = []  # (toggle index, tokens shown, busy) at each toggle

    def flip():
        i = len(seen)
        if i >= n_toggles:
            timer.stop()
            return
        box = live[names[i % len(names)]]
        box.setChecked(not box.isChecked())
        seen.append((i, len(window.reply_tokens), window.busy))

    timer = QTimer()
    timer.setInterval(3)
    timer.timeout.connect(flip)
    window.tokenShown.connect(lambda n: n == 1 and timer.start())
    toggled = chat_turn(qtbot, window, PROMPT, n_tokens)
    timer.stop()
    assert len(seen) == n_toggles
    mid_reply = [s for s in seen if s[2] == "generating"]
    assert len(mid_reply) >= n_toggles // 2, seen
    assert toggled.tokens == baseline.tokens
    assert window.conversation.turns == [(USER, PROMPT), (ASSISTANT, baseline.text)]
    # 30 flips of 3 boxes: each flipped 10 times, back where it started; the engine too.
    assert {name: live[name].isChecked() for name in names} == start
    sm = window.engine.worker._sm
    assert (sm.predictor.enabled, sm.cache.side_lfu, sm.cache.sync) == (
        start["prefetch"],
        start["side_lfu"],
        start["sync"],
    )
