"""The desktop app, driven offscreen with real chat turns on the embedded model.

A reply's tokens equal the CLI's for the same prompt and settings; the occupancy heat map
is exactly the engine's snapshot mapped to display states; live toggles flipped
mid-reply leave the greedy tokens unchanged; pool rebuilds asked for mid-reply wait for
the reply's end; errors are shown and the conversation is kept.
"""

import ctypes
import json
import os
import re
import shutil
import subprocess
import sys
import threading

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
from PySide6.QtCore import QPointF, Qt  # noqa: E402
from PySide6.QtGui import QImage  # noqa: E402

import app.main  # noqa: E402
from app.controls import summary  # noqa: E402
from app.conversation import ASSISTANT, USER, Conversation  # noqa: E402
from app.main import debian_package, has_display, not_found, uses_xcb  # noqa: E402
from app.main import main as app_main  # noqa: E402
from app.monitor import (  # noqa: E402
    ABSENT,
    EMPTY,
    IN_FLIGHT,
    JUST_LOADED,
    PINNED,
    RESIDENT,
    SIDE_READY,
    LiveSeries,
)
from app.window import MainWindow  # noqa: E402
from engine import cache as C  # noqa: E402
from engine.chat import plain_text  # noqa: E402
from engine.convert import convert  # noqa: E402
from engine.resources import default_model_path  # noqa: E402

MODEL = str(default_model_path())
PROMPT = "Once upon a time"
MAX_TOKENS = 20
# Fewer slots than the embedded model's 32 experts, so replies stream and evict.
SETTINGS = {"expert_slots": 8, "side_slots": 4, "prefetch": True}
CLI_FLAGS = ["--expert-slots", "8", "--side-slots", "4", "--prefetch"]
TIMEOUT_MS = 180_000

# The display state of each engine code, written out independently of app.monitor.
SLOT_STATES = {
    C.SLOT_EMPTY: EMPTY,
    C.SLOT_RESIDENT: RESIDENT,
    C.SLOT_PINNED: PINNED,
    C.SLOT_LOADING: IN_FLIGHT,
    C.SLOT_JUST_LOADED: JUST_LOADED,
    C.NO_ROW: ABSENT,
}
ROW_STATES = {
    C.ROW_FREE: EMPTY,
    C.ROW_IN_FLIGHT: IN_FLIGHT,
    C.ROW_PUBLISHED: SIDE_READY,
    C.NO_ROW: ABSENT,
}


def cli_generate(prompt: str, max_tokens: int) -> dict:
    """`expertstream generate --json` (greedy) with the window's cache settings."""
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "engine.cli",
            "generate",
            "--model",
            MODEL,
            "--prompt",
            prompt,
            "--max-tokens",
            str(max_tokens),
            "--json",
            *CLI_FLAGS,
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    return json.loads(out.stdout)


def expected_states(snap) -> np.ndarray:
    return np.array(
        [
            [SLOT_STATES[int(s)] for s in slots] + [ROW_STATES[int(s)] for s in side]
            for slots, side in zip(snap.slot_state, snap.side_state, strict=True)
        ],
        np.uint8,
    )


@pytest.fixture
def window(qtbot):
    """The app's window on the embedded model, loaded."""
    w = MainWindow(MODEL, SETTINGS)
    qtbot.addWidget(w)
    with qtbot.waitSignal(w.modelLoaded, timeout=TIMEOUT_MS):
        w.show()
    return w


def chat_turn(qtbot, w: MainWindow, prompt: str, max_tokens: int = MAX_TOKENS):
    """Types `prompt`, clicks Send (greedy), and returns the Reply (None: failed)."""
    w.chat.temperature.setValue(0.0)
    w.chat.max_tokens.setValue(max_tokens)
    w.chat.prompt.setPlainText(prompt)
    with qtbot.waitSignal(w.replyDone, timeout=TIMEOUT_MS) as blocker:
        qtbot.mouseClick(w.chat.send_button, Qt.MouseButton.LeftButton)
    return blocker.args[0]


def test_the_slots_box_stops_at_top_k(window):
    """The window's expert-slots box cannot go below the model's top-k (4 of 32)."""
    assert (window.controls.expert_slots.minimum(), window.controls.expert_slots.maximum()) == (
        4,
        32,
    )


def test_typing_goes_to_the_message_box_from_the_start(window, qtbot):
    """A new window takes keys into the message box, not the system prompt or nowhere."""
    assert window.focusWidget() is window.chat.prompt
    qtbot.keyClicks(window.focusWidget(), "Once upon")
    assert window.chat.prompt.toPlainText() == "Once upon"


def test_plain_continuation_joins_turns():
    conv = Conversation(
        [
            (USER, "Once upon a time"),
            (ASSISTANT, ", there was a cat."),
            (USER, "The cat"),
            (ASSISTANT, "sat"),
            (USER, " on a mat"),
        ]
    )
    assert (
        plain_text(conv.messages(system="ignored"))
        == "Once upon a time, there was a cat. The catsat on a mat"
    )


def test_live_series_rates_are_over_the_last_second():
    def totals(hits, misses, side_hits, bytes_read, inflight=0):
        return {
            "hits": hits,
            "misses": misses,
            "side_hits": side_hits,
            "bytes_read": bytes_read,
            "inflight": inflight,
        }

    series = LiveSeries(rate_window=1.0)
    series.sample(0.0, totals(0, 0, 0, 0), 0)
    series.sample(0.5, totals(30, 10, 5, 1000), 20)
    series.sample(1.0, totals(60, 20, 10, 2000, inflight=3), 40)
    series.sample(1.5, totals(60, 20, 10, 2000), 40)  # idle for half a second
    series.sample(3.0, totals(60, 20, 10, 2000), 40)  # idle
    x, ys = series.arrays(now=3.0)
    np.testing.assert_allclose(x, [-2.5, -2.0, -1.5, 0.0])
    np.testing.assert_allclose(ys["decode_tps"], [40, 40, 20, 0])
    np.testing.assert_allclose(ys["hit_rate"], [0.75, 0.75, 0.75, np.nan])
    np.testing.assert_allclose(ys["side_hits_ps"], [10, 10, 5, 0])
    np.testing.assert_allclose(ys["read_Bps"], [2000, 2000, 1000, 0])
    np.testing.assert_allclose(ys["inflight"], [0, 3, 0, 0])


def test_reply_tokens_equal_the_cli(window, qtbot):
    reply = chat_turn(qtbot, window, PROMPT)
    cli = cli_generate(PROMPT, MAX_TOKENS)
    assert reply.tokens == cli["tokens"]
    assert window.reply_tokens == cli["tokens"]  # every token reached the view
    assert reply.text == cli["text"]
    assert PROMPT + cli["text"] in window.chat.transcript.toPlainText()
    assert window.conversation.turns == [(USER, PROMPT), (ASSISTANT, cli["text"])]
    assert 0 < reply.cache["hit_rate"] <= 1 and reply.cache["misses"] > 0
    assert "decode" in window.chat.figures.text()

    # A second turn continues the whole text, as the CLI does with that text as prompt.
    follow = chat_turn(qtbot, window, "The next day", 12)
    cli2 = cli_generate(plain_text(window.conversation.messages()).removesuffix(follow.text), 12)
    assert follow.tokens == cli2["tokens"]

    # One token: no decode step, so no decode rate (not one token over ~0 seconds).
    decode = list(window.decode)
    one = chat_turn(qtbot, window, " Then", 1)
    assert one is not None, window.statusBar().currentMessage()
    assert len(one.tokens) == 1 and one.decode_tps is None
    assert "decode — tok/s" in window.chat.figures.text() and window.decode == decode


def test_heatmap_is_the_engine_snapshot(window, qtbot, monkeypatch):
    taken = []
    engine_snapshot = window.engine.snapshot

    def recording():
        snap = engine_snapshot()
        taken.append(snap)
        return snap

    monkeypatch.setattr(window.engine, "snapshot", recording)
    drawn = []

    def poll_now(n):  # one poll at every token: what is drawn vs the snapshot it took
        window.poll()
        inspector = window.inspector
        drawn.append(
            (
                taken[-1],
                inspector.occupancy.image.image.copy(),
                inspector.frequency.image.image.copy(),
            )
        )

    window.tokenShown.connect(poll_now)
    chat_turn(qtbot, window, PROMPT)
    window.tokenShown.disconnect(poll_now)
    window.poll()  # idle now: the engine's state holds still
    drawn.append(
        (
            taken[-1],
            window.inspector.occupancy.image.image.copy(),
            window.inspector.frequency.image.image.copy(),
        )
    )

    assert len(drawn) > 2
    n_layers = len(window.info.layers)
    for snap, states, heat in drawn:
        # MoE layer 0 is no prefetch target: it holds its 2 x 4 side rows as real slots
        assert states.shape == (n_layers, 16 + 2 * 4)
        assert (states[0, 16:] == ABSENT).all() and (states[1:, 8:16] == ABSENT).all()
        np.testing.assert_array_equal(states, expected_states(snap))
        np.testing.assert_array_equal(heat, np.log10(1 + snap.freq).astype(np.float32))
    assert any((s == SIDE_READY).any() for _, s, _ in drawn), "prefetch never published"
    snap, states, _ = drawn[-1]
    assert (states[:, :8] == RESIDENT).sum() >= n_layers * 4
    # The totals say the fills used and wasted, and each layer's degree (up to 4 side rows)
    t = snap.totals()
    assert t["prefetch_issued"] > 0
    totals = window.inspector.totals
    assert totals["prefetch"].text() == f"{t['prefetch_used']:,} / {t['prefetch_wasted']:,}"
    mean, threshold = totals["prefetch_degree"].text().split(" · ")
    assert 0 <= float(mean) <= 4 and float(threshold) == pytest.approx(snap.threshold, abs=0.005)

    # Hovering a cell names its layer, row, expert and frequency.
    view = window.inspector.occupancy
    layer, row = (int(i[-1]) for i in np.nonzero(snap.slot_expert >= 0))
    view.scene().sigMouseMoved.emit(view.image.mapToScene(QPointF(row + 0.5, layer + 0.5)))
    expert = int(snap.slot_expert[layer, row])
    assert view.hover_text.startswith(f"MoE layer {layer}  ·  row {row} (real slot {row})")
    assert f"expert {expert}" in view.hover_text
    assert f"frequency {snap.freq[layer, expert]:.2f}" in view.hover_text
    assert window.inspector.hover_label.text() == view.hover_text


def test_live_toggles_mid_reply_keep_the_tokens(window, qtbot):
    n_tokens = 48
    baseline = chat_turn(qtbot, window, PROMPT, n_tokens)
    window.new_chat()
    live = window.controls.live
    side_bank1_used = []
    forward_at = {}

    def toggle(n):
        snap = window.engine.snapshot()
        if n in (4, 12, 20):
            forward_at[n] = snap.forward
        if n == 4:
            live["side_lfu"].setChecked(False)  # legacy double buffer
            live["sync"].setChecked(True)
        elif n == 12:
            live["sync"].setChecked(False)
        elif n == 20:
            live["side_lfu"].setChecked(True)
        side_bank1_used.append(bool((snap.side_state[:, 4:] != C.ROW_FREE).any()))

    window.tokenShown.connect(toggle)
    toggled = chat_turn(qtbot, window, PROMPT, n_tokens)
    window.tokenShown.disconnect(toggle)
    assert toggled.tokens == baseline.tokens
    assert any(side_bank1_used), "the double buffer's bank 1 was never filled"
    # every toggle came with forwards of the reply still to run: mid-reply indeed
    end = window.engine.snapshot().forward
    assert all(end - f >= 4 for f in forward_at.values()), (forward_at, end)
    assert window.conversation.turns == [(USER, PROMPT), (ASSISTANT, baseline.text)]


def test_rebuild_waits_for_the_reply_and_errors_keep_the_conversation(window, qtbot, tmp_path):
    def rebuild_then_stop(n):
        if n == 2:
            window.controls.expert_slots.setValue(12)
            qtbot.mouseClick(window.controls.apply_button, Qt.MouseButton.LeftButton)
            assert window.pending is not None and window.busy == "generating"
            assert "Queued" in window.statusBar().currentMessage()
            qtbot.mouseClick(window.chat.stop_button, Qt.MouseButton.LeftButton)

    window.tokenShown.connect(rebuild_then_stop)
    with qtbot.waitSignal(window.modelLoaded, timeout=TIMEOUT_MS) as loaded:
        reply = chat_turn(qtbot, window, PROMPT, 200)
        window.tokenShown.disconnect(rebuild_then_stop)
        assert reply.stopped and 2 <= len(reply.tokens) < 200
    assert loaded.args[0].config.expert_slots == 12
    # 12 real slots per layer, and layer 0 (no prefetch target) its 2 x 4 side rows too
    assert window.engine.snapshot().slot_expert.shape[1] == 12 + 2 * 4
    assert window.info.plan.real_slots == (12,) * len(window.info.layers)
    assert window.info.plan.layer_slots == (12 + 2 * 4,) + (12,) * (len(window.info.layers) - 1)
    turns = [(USER, PROMPT), (ASSISTANT, reply.text)]
    assert window.conversation.turns == turns

    # Opening something that is not a model: the error is shown, the model stays.
    with qtbot.waitSignal(window.engine.worker.loadFailed, timeout=TIMEOUT_MS):
        window.open_model(str(tmp_path))
    qtbot.waitUntil(lambda: window.busy is None)
    assert "neither an expert store" in window.statusBar().currentMessage()
    assert "neither an expert store" in window.chat.transcript.toPlainText()
    assert window.info.config.expert_slots == 12 and window.conversation.turns == turns

    # A failing reply (prompt over the context window) is shown, saying what to lower;
    # the box never offers the whole context, which no reply can fill.
    limit = window.info.context
    assert window.chat.max_tokens.maximum() == limit - 1
    failed = chat_turn(qtbot, window, PROMPT, limit - 1)
    shown = window.chat.transcript.toPlainText()
    assert failed is None and "exceeds the model's context" in shown
    assert f"max tokens ({limit - 1})" in shown and "lower max tokens to " in shown
    assert window.conversation.turns == turns
    again = chat_turn(qtbot, window, " Then", 6)
    assert again is not None and len(again.tokens) >= 1
    assert window.conversation.turns == turns + [(USER, " Then"), (ASSISTANT, again.text)]


def test_open_model_converts_with_a_progress_bar(window, qtbot, tmp_path):
    source = tmp_path / "copied-model"
    shutil.copytree(MODEL, source)
    # Stores are keyed by content: a changed file gets the copy a store of its own.
    (source / "NOTE.md").write_text("a copy for the progress bar test")
    seen = []
    window.engine.worker.loadProgress.connect(
        lambda done, total: seen.append((done, total, window.progress.isVisible()))
    )
    with qtbot.waitSignal(window.modelLoaded, timeout=TIMEOUT_MS) as loaded:
        window.open_model(str(source))
    assert len(seen) >= 2 and all(visible for _, _, visible in seen)
    assert seen[-1][0] == seen[-1][1] > 0
    assert window.progress.value() == 1000 and not window.progress.isVisible()
    assert loaded.args[0].name == "copied-model"
    assert chat_turn(qtbot, window, PROMPT, 4) is not None


def test_open_from_the_hub_downloads_with_a_progress_bar(window, qtbot, tmp_path, monkeypatch):
    from hub_server import Hub, point_hub, repo_files

    files = repo_files(default_model_path())
    hub = Hub({"test-org/tinystories-moe": files})
    point_hub(monkeypatch, tmp_path / "hub", hub.url)
    seen = []
    window.engine.worker.downloadProgress.connect(
        lambda done, total: seen.append((done, total, window.progress.text()))
    )
    try:
        with qtbot.waitSignal(window.modelLoaded, timeout=TIMEOUT_MS) as loaded:
            window.open_hub_model("test-org/tinystories-moe")
    finally:
        hub.close()
    wanted = sum(len(data) for name, data in files.items() if name != "README.md")
    assert seen[-1][:2] == (wanted, wanted) and seen[-1][2].startswith("downloading 100%  (")
    assert loaded.args[0].path == "test-org/tinystories-moe"
    assert chat_turn(qtbot, window, PROMPT, 4) is not None

    window.open_hub_model("not an id")
    assert "'not an id' is not a Hub id" in window.statusBar().currentMessage()


def test_a_read_error_is_shown_and_the_app_goes_on(window, qtbot, tmp_path):
    chat_turn(qtbot, window, PROMPT, 4)
    turns = list(window.conversation.turns)
    # A blob store of the model with one byte flipped in every record of the first MoE
    # layer.
    bad = convert(MODEL, tmp_path / "store")
    manifest = json.loads((bad / "manifest.json").read_text())
    layer = manifest["layers"][0]
    with open(bad / layer["file"], "r+b") as f:
        for e in range(manifest["num_experts"]):
            f.seek(e * layer["stride"] + 100)
            byte = f.read(1)[0]
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte ^ 0xFF]))
    good = window.info.path
    with qtbot.waitSignal(window.modelLoaded, timeout=TIMEOUT_MS):
        window.open_model(str(bad))

    assert chat_turn(qtbot, window, " Then", 4) is None
    assert "checksum mismatch" in window.chat.transcript.toPlainText()
    assert "Reply failed" in window.statusBar().currentMessage()
    assert window.conversation.turns == turns and window.busy is None

    with qtbot.waitSignal(window.modelLoaded, timeout=TIMEOUT_MS):
        window.open_model(good)
    again = chat_turn(qtbot, window, " Then", 4)
    assert again is not None and window.conversation.turns[: len(turns)] == turns


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--prompt", ""], "argument --prompt: is empty"),  # as the CLI refuses it
        (["--max-tokens", "0"], "argument --max-tokens: must be an integer >= 1, got '0'"),
        (["--max-tokens", "-5"], "argument --max-tokens: must be an integer >= 1, got '-5'"),
        (["--shot-at", "0"], "argument --shot-at: must be an integer >= 1, got '0'"),
        (
            ["--size", "1366x0"],
            "argument --size: '1366x0' is not a window size: give WIDTHxHEIGHT in pixels",
        ),
        (["--size", "big"], "argument --size: 'big' is not a window size"),
        (["--expert-slots", "0"], "error: --expert-slots 0: must be >= 1"),
        (
            ["--expert-slots", "8", "--expert-memory", "50MiB"],
            "error: --expert-slots and --expert-memory are both given: give one of them",
        ),
        (["--side-slots", "0", "--prefetch"], "error: --prefetch needs side-region slots"),
    ],
)
def test_bad_flags_are_refused_before_a_window_opens(capsys, argv, message):
    try:
        code = app_main(["--screenshot", "never.png", *argv])
    except SystemExit as e:
        code = e.code
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("expertstream-gui") and message in err, err
    assert err.count("\n") == 1 and not os.path.exists("never.png")


def test_settings_out_of_range_are_named_as_the_window_labels_them():
    from app.worker import Worker

    worker = Worker(threading.Event(), threading.Event())
    failed, loaded = [], []
    worker.loadFailed.connect(failed.append)
    worker.loaded.connect(loaded.append)
    worker.load(MODEL, {"expert_slots": 33})
    worker.load(MODEL, {"side_slots": 0, "expert_slots": 0})
    worker.load(MODEL, {"expert_slots": 3})  # below top-k, as the command line refuses it
    assert failed == [
        "could not open " + MODEL + ": expert slots 33: must be <= 32, the model's experts "
        "per MoE layer",
        "could not open " + MODEL + ": expert slots 0: must be >= 1",
        "could not open " + MODEL + ": expert slots 3: must be >= 4, the experts each token "
        "is routed to per MoE layer (top-k)",
    ]
    worker.load(MODEL, {"expert_memory": 64 * 2**20})  # no default slot count beside it
    assert len(failed) == 3 and loaded[0].config.expert_slots is None
    worker.unload()


def test_a_load_says_that_mlx_cuda_compiles_its_kernels_first(qtbot, monkeypatch):
    """Where MLX CUDA's kernel cache is empty (engine.kernel_cache) the transcript says the
    first replies wait for its compiles, under the load's line; elsewhere it says nothing."""
    from engine import kernel_cache

    note = "MLX compiles its CUDA kernels as the first replies use them"
    monkeypatch.setattr(kernel_cache, "compile_note", lambda: note)
    w = MainWindow(MODEL, {"expert_slots": 8})
    qtbot.addWidget(w)
    with qtbot.waitSignal(w.modelLoaded, timeout=TIMEOUT_MS) as loaded:
        w.show()
    assert loaded.args[0].compile_note == note
    shown = w.chat.transcript.toPlainText()
    assert shown.index(f"{note}.") > shown.index(f"Loaded {loaded.args[0].name} in"), shown
    monkeypatch.setattr(kernel_cache, "compile_note", lambda: "")
    with qtbot.waitSignal(w.modelLoaded, timeout=TIMEOUT_MS) as loaded:
        w.open_model(str(MODEL))
    assert loaded.args[0].compile_note == ""
    assert w.chat.transcript.toPlainText().count(f"{note}.") == 1


def test_a_default_pool_larger_than_memory_streams_with_expert_memory_auto(qtbot, monkeypatch):
    """The embedded model with 1 side row: its 16 default expert slots (+ 6 side and
    scratch rows) take 12.3 MB beside 1.7 MB of dense weights; with 12 MB available the
    app streams with expert memory auto (6 MB: 12 or 13 slots per layer) and says so in
    its own words, and the inspector draws those slots. A size the user sets that does
    not fit is refused naming the window's settings."""
    from engine import memory_plan

    monkeypatch.setattr(memory_plan, "available_bytes", lambda: 12_000_000)
    # Reads through the reader threads: the figures below leave out io_uring's buffers
    # (at least 2 MiB, which would not fit beside this tiny budget).
    w = MainWindow(MODEL, {"side_slots": 1, "reader_threads": 2, "io_uring": False})
    qtbot.addWidget(w)
    with qtbot.waitSignal(w.modelLoaded, timeout=TIMEOUT_MS) as loaded:
        w.show()
    info = loaded.args[0]
    assert info.config.expert_memory == "auto" and info.config.expert_slots is None
    # the pools' figure counts the read buffers, a record's read each (larger in place)
    assert re.fullmatch(
        r"The default 16 expert slots per layer \(1[01]\.\d MB\) and the dense weights "
        r"\(1\.7 MB\) exceed the 12\.0 MB of memory available: expert memory is set to "
        r"auto \(50% of it, 12–13 slots per layer\), so the experts stream from disk",
        info.note,
    ), info.note
    # bytes in decimal units, as the CLI and the plot's "MB read /s": 8 layers' pools of
    # 18 or 19 rows of 61.4 kB records
    assert info.pool_bytes == 8_908_800
    assert w.controls.model_label.text().endswith(
        "12–13 slots + 2 × 1 side rows (MoE layer 0 holds its side rows as slots) · pool 8.9 MB"
    )
    assert w.statusBar().currentMessage() == f"Loaded {info.name}: {info.note}."
    assert w.controls.expert_memory.text() == "auto"
    slots = info.plan.real_slots
    assert sorted(set(slots)) == [12, 13]
    assert info.plan.layer_slots == (slots[0] + 2, *slots[1:])  # layer 0: no prefetch target
    reply = chat_turn(qtbot, w, PROMPT, 8)
    assert reply is not None and reply.cache["misses"] > 0
    w.poll()  # idle: the engine's state holds still
    states = w.inspector.occupancy.image.image
    np.testing.assert_array_equal(states, expected_states(w.engine.snapshot()))
    assert states.shape == (len(info.layers), max(info.plan.layer_slots) + 2)
    assert (states[:, :12] == RESIDENT).all()

    from app.worker import Worker

    worker = Worker(threading.Event(), threading.Event())
    failed = []
    worker.loadFailed.connect(failed.append)
    worker.load(MODEL, {"expert_slots": 32, "side_slots": 1, "io_uring": False})
    assert len(failed) == 1 and "the dense weights 1.7 MB" in failed[0]
    assert failed[0].endswith(
        "of memory is available: lower expert slots, or use expert memory auto (or lower side rows)"
    ), failed[0]


def test_expert_memory_auto_shows_the_slots_the_pool_was_sized_with(qtbot, monkeypatch):
    """ "auto" is half the memory available when the pools are sized; the pools and
    weights then take some of it. The slots the window and the advisor show are the ones
    the cache was built with, not auto evaluated again after the load (which gave fewer
    slots, and told that every layer held its side rows as slots)."""
    from app.worker import Worker
    from engine import cache, memory_plan

    available = [12_000_000]
    monkeypatch.setattr(memory_plan, "available_bytes", lambda: available[0])
    opened = cache.open_planned

    def open_and_take_memory(*args, **kwargs):
        c = opened(*args, **kwargs)
        available[0] = 9_000_000  # what the load left
        return c

    monkeypatch.setattr(cache, "open_planned", open_and_take_memory)
    worker = Worker(threading.Event(), threading.Event())
    loaded = []
    worker.loaded.connect(loaded.append)
    worker.load(MODEL, {"side_slots": 1, "reader_threads": 2, "io_uring": False})
    info = loaded[0]
    assert info.config.expert_memory == "auto"
    slots = info.plan.real_slots
    assert sorted(set(slots)) == [12, 13]  # 6 MB of 61.4 kB records, 8 layers
    assert info.plan.layer_slots == (slots[0] + 2, *slots[1:])  # layer 0: no target
    assert "(MoE layer 0 holds its side rows as slots)" in summary(info)
    assert info.budget.slots_per_layer == max(slots)
    assert info.budget.pool_bytes == info.pool_bytes
    worker.unload()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="display check is Linux's")
def test_without_a_display_it_says_how_to_run_headless():
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("DISPLAY", "WAYLAND_DISPLAY", "QT_QPA_PLATFORM")
    }
    assert not has_display(env)
    out = subprocess.run(
        [sys.executable, "-m", "app.main"], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 2
    assert "QT_QPA_PLATFORM=offscreen" in out.stderr and "expertstream generate" in out.stderr


LDD = """\tlinux-vdso.so.1 (0x00007ffd)
\tlibQt6XcbQpa.so.6 => /x/PySide6/Qt/lib/libQt6XcbQpa.so.6 (0x00007f3a)
\tlibxcb-icccm.so.4 => not found
\tlibxcb-keysyms.so.1 => not found
\tlibxcb-icccm.so.4 => not found
"""


def test_missing_xcb_libraries_are_named_with_their_packages(monkeypatch, capsys):
    assert not_found(LDD) == ["libxcb-icccm.so.4", "libxcb-keysyms.so.1"]
    names = ["libxcb-cursor.so.0", "libxkbcommon-x11.so.0", "libEGL.so.1"]
    assert [debian_package(n) for n in names] == ["libxcb-cursor0", "libxkbcommon-x11-0", "libegl1"]
    # xcb is Qt's platform where it is asked for, or on Linux outside a Wayland session
    linux = sys.platform.startswith("linux")
    assert uses_xcb({"DISPLAY": ":0"}) == linux
    assert uses_xcb({"DISPLAY": ":0", "QT_QPA_PLATFORM": "xcb"}) == linux
    assert not uses_xcb({"DISPLAY": ":0", "QT_QPA_PLATFORM": "offscreen"})
    assert not uses_xcb({"DISPLAY": ":0", "WAYLAND_DISPLAY": "wayland-0"})
    # what it reports missing cannot be loaded here, truly
    for name in app.main.missing_xcb_libraries():
        with pytest.raises(OSError):
            ctypes.CDLL(name)

    # said before Qt starts (which aborts the process, naming at most one of them)
    monkeypatch.setattr(sys, "platform", "linux")
    monkeypatch.setenv("DISPLAY", ":0")
    monkeypatch.delenv("QT_QPA_PLATFORM")
    monkeypatch.delenv("WAYLAND_DISPLAY", raising=False)
    monkeypatch.setattr(app.main, "missing_xcb_libraries", lambda: names[:2])
    assert app_main([]) == 2
    err = capsys.readouterr().err
    assert "needs libraries this system lacks: libxcb-cursor.so.0, libxkbcommon-x11.so.0\n" in err
    assert "sudo apt-get install libxcb-cursor0 libxkbcommon-x11-0\n" in err
    assert "QT_QPA_PLATFORM=offscreen expertstream-gui --screenshot" in err


def test_screenshot_is_taken_mid_reply(tmp_path):
    png = tmp_path / "shot.png"
    env = os.environ | {"QT_QPA_PLATFORM": "offscreen"}
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "app.main",
            "--screenshot",
            str(png),
            "--prompt",
            PROMPT,
            "--max-tokens",
            "24",
            *CLI_FLAGS,
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    # Qt's offscreen platform says "This plugin does not support propagateSizeHints()"
    # several times a run, which means nothing to a user: the app drops that message.
    assert "propagateSizeHints" not in out.stderr, out.stderr
    # Exactly one grab, at the 18th token: a grab nested in another (through Qt's event
    # processing) used to save once per later token and run the reply to its end.
    saved = [line for line in out.stdout.splitlines() if line.startswith("saved ")]
    assert saved == [f"saved {png} at reply token 18 of at most 24"]
    image = QImage(str(png))
    assert image.width() >= 1200 and image.height() >= 800


def test_the_screenshot_is_grabbed_before_the_reply_is_stopped(window, tmp_path, monkeypatch):
    """A token delivered while the window is being grabbed (by the grab's own event
    processing) does not stop the reply before the picture is saved: the picture never
    shows "Stopping…"; the reply is stopped once it is saved."""
    from PySide6.QtCore import QTimer
    from PySide6.QtWidgets import QApplication

    status = window.statusBar().currentMessage
    saved = []
    monkeypatch.setattr(app.main, "_save_png", lambda pixmap, path: saved.append(status()))
    png = tmp_path / "shot.png"
    args = app.main.build_parser().parse_args(["--screenshot", str(png), "--max-tokens", "24"])
    app.main._screenshot(window, args, QApplication.instance())
    window.busy = "generating"  # as while a reply streams: Stop then says "Stopping…"
    QTimer.singleShot(0, lambda: window.tokenShown.emit(19))  # delivered inside the grab
    window.tokenShown.emit(18)
    assert len(saved) == 1 and "Stopping" not in saved[0], saved
    assert status() == "Stopping…"


def test_a_model_that_cannot_be_opened_is_named_in_plain_words(tmp_path):
    """The window's message names the path and the reason, not Python's exception."""
    from app.worker import Worker, error_text

    worker = Worker(threading.Event(), threading.Event())
    failed = []
    worker.loadFailed.connect(failed.append)
    missing = tmp_path / "missing"
    worker.load(str(missing), {})
    assert failed == [f"could not open {missing}: model path {missing} does not exist"]
    assert error_text(PermissionError(13, "Permission denied", "config.json")) == (
        "config.json: Permission denied"
    )
    assert error_text(KeyError()) == "an internal error (KeyError, no message)"


def test_side_rows_turn_prefetch_on_and_off_at_the_rebuild(qtbot):
    from app.controls import ControlsPanel
    from app.worker import ModelInfo
    from engine.config import StreamConfig

    def info(**config):
        return ModelInfo(
            name="m", path="m", store_path="s", layers=[1, 2, 3, 4], num_experts=32,
            top_k=4, config=StreamConfig(**config), plan=four_layers([8] * 4),
            chat_template=False,
            pool_bytes=0, budget=None, load_seconds=0.0, context=None,
        )  # fmt: skip

    panel = ControlsPanel()
    qtbot.addWidget(panel)
    panel.set_model(info(expert_slots=8, side_slots=0))
    box = panel.live["prefetch"]
    assert not box.isEnabled() and not box.isChecked()
    assert panel.pool()["prefetch"] is False
    # Side rows for a pool without any turn prefetch on, as --side-slots 8 does.
    panel.side_slots.setValue(8)
    assert (panel.pool()["side_slots"], panel.pool()["prefetch"]) == (8, True)
    # Once the pool has side rows, the box decides; no side rows turn prefetch off.
    panel.set_model(info(expert_slots=8, side_slots=8, prefetch=True))
    assert box.isEnabled() and box.isChecked() and panel.pool()["prefetch"] is True
    box.setChecked(False)
    assert panel.pool()["prefetch"] is False
    box.setChecked(True)
    panel.side_slots.setValue(0)
    assert (panel.pool()["side_slots"], panel.pool()["prefetch"]) == (0, False)


def test_rebuild_with_side_rows_leaves_prefetch_on_in_the_engine_and_none_off(qtbot):
    # The whole window, not only ControlsPanel.pool: the load's end re-applies the boxes
    # toggled while loading, and must not undo the prefetch the side rows turned on/off.
    w = MainWindow(MODEL, {"expert_slots": 8, "side_slots": 0, "prefetch": False})
    qtbot.addWidget(w)
    with qtbot.waitSignal(w.modelLoaded, timeout=TIMEOUT_MS):
        w.show()
    box = w.controls.live["prefetch"]

    def rebuild(side_rows: int) -> tuple:
        w.controls.side_slots.setValue(side_rows)
        with qtbot.waitSignal(w.modelLoaded, timeout=TIMEOUT_MS):
            qtbot.mouseClick(w.controls.apply_button, Qt.MouseButton.LeftButton)
        sm = w.engine.worker._sm
        return (w.info.config.prefetch, box.isChecked(), box.isEnabled(), sm.predictor.enabled)

    assert (box.isChecked(), box.isEnabled()) == (False, False)
    assert rebuild(4) == (True, True, True, True)
    assert rebuild(0) == (False, False, False, False)  # not left checked and disabled
    assert rebuild(4) == (True, True, True, True)
    box.setChecked(False)  # once the pool has side rows, the box decides
    assert rebuild(2) == (False, False, True, False)


def test_summary_names_the_layers_that_hold_their_side_rows_as_slots():
    from app.worker import ModelInfo
    from engine.config import StreamConfig

    def info(pool_slots, tier_slots=0):
        return ModelInfo(
            name="m", path="m", store_path="s", layers=[1, 2, 3, 4], num_experts=32,
            top_k=4, config=StreamConfig(expert_slots=8, side_slots=4, prefetch=True),
            plan=four_layers(pool_slots, tier_slots), chat_template=False, pool_bytes=0,
            budget=None, load_seconds=0.0, context=None,
        )  # fmt: skip

    assert summary(info([8] * 4)).endswith("8 slots + 2 × 4 side rows · pool 0 B")
    assert "(MoE layer 0 holds its side rows as slots)" in summary(info([16, 8, 8, 8]))
    assert "(MoE layers 0, 2 hold their side rows as slots)" in summary(info([16, 8, 16, 8]))
    assert summary(info([8] * 4, tier_slots=20)).endswith(
        "· pool 0 B · host tier 20 slots per layer (80.0 kB)"
    )


def four_layers(layer_slots, tier_slots=0):
    """The memory plan of 4 MoE layers of 8 real slots (`layer_slots` in the pool) and
    1 kB records, with `tier_slots` host-tier slots per layer."""
    from engine.config import StreamConfig
    from engine.memory_plan import MemoryPlan

    return MemoryPlan(
        config=StreamConfig(expert_slots=8), real_slots=(8,) * 4,
        layer_slots=tuple(layer_slots), side_rows=(4,) * 4, scratch_rows=4,
        record_bytes=(1000,) * 4, reader_threads=2, io_uring_depth=0, pool_bytes=0,
        layer_scratch_bytes=0, staging_bytes=0, tier_slots=tier_slots,
        tier_bytes=tier_slots * 4 * 1000, dense_bytes=0, available=None,
    )  # fmt: skip
