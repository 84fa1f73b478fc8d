"""`expertstream-gui`: the desktop app's entry point.

    expertstream-gui [--model PATH] [--expert-slots N] [--side-slots N] [...]
    expertstream-gui --screenshot PNG --prompt TEXT [--model PATH] [--max-tokens N]
        [--tab advisor] [--size WxH]

The second form runs one chat turn, saves a PNG of the whole window while tokens are
still being generated, and exits (with QT_QPA_PLATFORM=offscreen it needs no display).
"""

import argparse
import ctypes
import os
import re
import subprocess
import sys
from pathlib import Path

from app.defaults import app_defaults_help
from engine.config import ConfigError, StreamConfig
from engine.flags import (
    Parser,
    add_cache_flags,
    config_error_message,
    config_overrides,
    positive_int,
    prompt_text,
)
from engine.safe_io import atomic_write

NO_DISPLAY = """expertstream-gui: no display found (DISPLAY and WAYLAND_DISPLAY are unset).
  To run without a display, render offscreen:
      QT_QPA_PLATFORM=offscreen expertstream-gui --screenshot out.png --prompt "Once upon a time"
  or use the command line:
      expertstream generate --prompt "Once upon a time"
"""


NO_XCB = """expertstream-gui: Qt's X11 platform (xcb) needs libraries this system lacks: {names}
  On Debian/Ubuntu: sudo apt-get install {packages}
  Or run without a window:
      QT_QPA_PLATFORM=offscreen expertstream-gui --screenshot out.png --prompt "Once upon a time"
"""

# Loaded by Qt's xcb plugin at run time (not a link dependency that ldd lists): without it
# Qt 6.5+ aborts the process.
XCB_CURSOR = "libxcb-cursor.so.0"


def window_size(text: str) -> tuple[int, int]:
    """A `--size` such as "1366x768" as (width, height) in pixels.

    Raises:
        argparse.ArgumentTypeError: not two positive integers joined by "x".
    """
    m = re.fullmatch(r"\s*(\d+)\s*[xX]\s*(\d+)\s*", text)
    if not m or not int(m[1]) or not int(m[2]):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a window size: give WIDTHxHEIGHT in pixels, e.g. 1366x768"
        )
    return int(m[1]), int(m[2])


def build_parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="expertstream-gui",
        description="Chat with a Mixture-of-Experts model whose experts stream from disk, "
        "and watch its expert cache live.",
    )
    p.add_argument(
        "--model", help="mlx-lm MoE model directory or expert store (default: the embedded model)"
    )
    p.add_argument(
        "--screenshot",
        metavar="PNG",
        help="run one chat turn, save the window as PNG while tokens are being generated, and exit",
    )
    p.add_argument(
        "--prompt",
        type=prompt_text,
        default="Once upon a time",
        help="the message of --screenshot",
    )
    p.add_argument(
        "--max-tokens", type=positive_int, default=64, help="reply length of --screenshot (>= 1)"
    )
    p.add_argument(
        "--tab",
        choices=["inspector", "advisor"],
        default="inspector",
        help="the tab --screenshot shows (advisor: grabbed once the reply is analysed)",
    )
    p.add_argument(
        "--size",
        type=window_size,
        metavar="WxH",
        help="the window's size in pixels, e.g. 1366x768 (default: 1480x940 where the "
        "screen holds it, else maximized; with --screenshot, 1480x940)",
    )
    p.add_argument(
        "--shot-at",
        type=positive_int,
        help="grab after this many reply tokens (default: three quarters of --max-tokens)",
    )
    add_cache_flags(p, app_defaults_help()).description = "All can be changed in the window."
    return p


def has_display(environ=None) -> bool:
    """False on Linux when neither a display server nor a Qt platform is set."""
    env = os.environ if environ is None else environ
    if not sys.platform.startswith("linux"):
        return True
    return any(env.get(k) for k in ("DISPLAY", "WAYLAND_DISPLAY", "QT_QPA_PLATFORM"))


def uses_xcb(environ=None) -> bool:
    """Whether Qt will open its window through the xcb (X11) platform plugin: on Linux,
    QT_QPA_PLATFORM names it, or is unset outside a Wayland session."""
    env = os.environ if environ is None else environ
    if not sys.platform.startswith("linux"):
        return False
    platform = env.get("QT_QPA_PLATFORM", "")
    return platform.startswith("xcb") or (not platform and not env.get("WAYLAND_DISPLAY"))


def not_found(ldd_output: str) -> list[str]:
    """The sonames `ldd` reports as "not found", in order, each once."""
    names = re.findall(r"^\s*(\S+) => not found", ldd_output, re.M)
    return list(dict.fromkeys(names))


def missing_xcb_libraries() -> list[str]:
    """The shared libraries (sonames) that Qt's xcb platform plugin needs and this
    system cannot load: what `ldd` of the plugin finds missing, and `XCB_CURSOR`. Qt
    aborts the process when one is missing, naming at most one; this is checked before.
    [] where the plugin is not found (Qt then says so itself) or `ldd` cannot run."""
    from PySide6.QtCore import QLibraryInfo

    plugins = Path(QLibraryInfo.path(QLibraryInfo.LibraryPath.PluginsPath))
    plugin = plugins / "platforms" / "libqxcb.so"
    if not plugin.is_file():
        return []
    try:
        ldd = subprocess.run(["ldd", str(plugin)], capture_output=True, text=True, timeout=30)
        missing = not_found(ldd.stdout)
    except (OSError, subprocess.TimeoutExpired):
        missing = []
    try:
        ctypes.CDLL(XCB_CURSOR)
    except OSError:
        missing.append(XCB_CURSOR)
    return missing


def debian_package(soname: str) -> str:
    """The Debian/Ubuntu package of a library by its soname, as Debian names them:
    "libxcb-cursor.so.0" -> "libxcb-cursor0", "libxkbcommon-x11.so.0" ->
    "libxkbcommon-x11-0", "libEGL.so.1" -> "libegl1"."""
    name, _, version = soname.lower().partition(".so.")
    return f"{name}-{version}" if name[-1:].isdigit() else f"{name}{version}"


def _save_png(pixmap, path: str) -> str | None:
    """Writes the QPixmap `pixmap` as a PNG to `path` atomically
    (`engine.safe_io.atomic_write`: a run killed mid-write leaves the old file or the new
    one). Returns None, or why it could not be written."""
    from PySide6.QtCore import QBuffer, QByteArray, QIODevice

    data = QByteArray()
    buffer = QBuffer(data)
    buffer.open(QIODevice.OpenModeFlag.WriteOnly)
    if not pixmap.save(buffer, "PNG"):
        return "the window could not be encoded as PNG"
    try:
        with atomic_write(path) as f:
            f.write(data.data())
    except OSError as e:
        return e.strerror or str(e)
    return None


def _screenshot(window, args, app) -> None:
    """Sends --prompt once the model is loaded, grabs the window at the --shot-at-th
    token (or at the reply's end if it is shorter), then stops and quits."""
    from PySide6.QtCore import Qt, QTimer

    shot_at = args.shot_at or max(1, args.max_tokens * 3 // 4)
    state = {"saved": False, "grabbing": False}

    def grab(when: str) -> None:
        # processEvents below delivers queued tokenShown/replyDone signals, which call
        # grab again: without the guard each nested call saves over the last one and
        # the reply runs on to its end instead of stopping at --shot-at.
        if state["saved"] or state["grabbing"]:
            return
        state["grabbing"] = True
        window.chat.flush()
        window.poll()
        app.processEvents()  # pending layout updates, e.g. of the advisor's new text
        problem = _save_png(window.grab(), args.screenshot)
        state["grabbing"] = False
        if problem:
            print(
                f"expertstream-gui: could not write {args.screenshot}: {problem}", file=sys.stderr
            )
            app.exit(1)
            return
        state["saved"] = True
        print(f"saved {args.screenshot} {when}")

    def on_loaded(_info) -> None:
        if args.tab == "advisor":
            window.tabs.setCurrentWidget(window.advisor)
        window.chat.max_tokens.setValue(args.max_tokens)
        window.chat.prompt.setPlainText(args.prompt)
        window.send(args.prompt)

    def on_token(n: int) -> None:
        if n >= shot_at and not state["saved"] and args.tab == "inspector":
            grab(f"at reply token {n} of at most {args.max_tokens}")
            # Stopped once saved, not before: a token delivered by the grab's own
            # processEvents gets here while it runs, and stopping then put "Stopping…"
            # in the status bar of the picture.
            if state["saved"]:
                window.stop()

    def on_done(reply) -> None:
        if state["grabbing"]:
            # Delivered by the grab's own processEvents (the reply ended while the window
            # was being grabbed): decide once that grab has saved, not before (which quit
            # with 1, the shot not yet saved).
            QTimer.singleShot(0, lambda: on_done(reply))
            return
        if reply is None:
            print("expertstream-gui: the reply failed (see the screenshot)", file=sys.stderr)
        elif args.tab == "advisor":
            return  # grabbed when the analysis of the reply is drawn
        grab(f"at the reply's end ({len(window.reply_tokens)} tokens)")
        app.exit(0 if state["saved"] and reply is not None else 1)

    def on_analysed(*_) -> None:
        grab(f"with the advisor's analysis of {len(window.reply_tokens)} reply tokens")
        app.exit(0 if state["saved"] else 1)

    def on_analysis_failed(message: str) -> None:
        print(f"expertstream-gui: the advisor failed: {message}", file=sys.stderr)
        grab("after the advisor failed")
        app.exit(1)

    def on_load_failed(message: str) -> None:
        print(f"expertstream-gui: {message}", file=sys.stderr)
        app.exit(1)

    window.modelLoaded.connect(on_loaded)
    window.tokenShown.connect(on_token)
    window.replyDone.connect(on_done)
    if args.tab == "advisor":
        window.advisor_runner.finished.connect(on_analysed, Qt.ConnectionType.QueuedConnection)
        window.advisor_runner.failed.connect(on_analysis_failed)
    window.engine.worker.loadFailed.connect(on_load_failed)


# Qt messages that say nothing to a user: the offscreen platform (headless runs,
# --screenshot) prints this once per window and dialog that sizes itself.
QUIET_QT_MESSAGES = frozenset({"This plugin does not support propagateSizeHints()"})


def _quiet_qt_messages() -> None:
    """Drops `QUIET_QT_MESSAGES`; every other Qt message goes where it went (a handler
    installed before, such as pytest-qt's, or stderr as Qt writes it)."""
    from PySide6.QtCore import qInstallMessageHandler

    previous = None

    def handle(kind, context, message: str) -> None:
        if message in QUIET_QT_MESSAGES:
            return
        if previous is not None:
            previous(kind, context, message)
        else:
            print(message, file=sys.stderr)

    previous = qInstallMessageHandler(handle)


def main(argv: list[str] | None = None) -> int:
    """Entry point of `expertstream-gui`; returns the exit code."""
    args = build_parser().parse_args(argv)
    try:
        overrides = config_overrides(args)
        StreamConfig(**overrides)  # the flags' ranges, before any window opens
    except ConfigError as e:
        print(f"expertstream-gui: error: {config_error_message(e, args)}", file=sys.stderr)
        return 2
    except ValueError as e:
        print(f"expertstream-gui: error: {e}", file=sys.stderr)
        return 2
    if not has_display():
        print(NO_DISPLAY, file=sys.stderr, end="")
        return 2
    if uses_xcb() and (missing := missing_xcb_libraries()):
        packages = " ".join(debian_package(name) for name in missing)
        print(NO_XCB.format(names=", ".join(missing), packages=packages), file=sys.stderr, end="")
        return 2

    import shiboken6
    from PySide6.QtWidgets import QApplication

    from app.window import MainWindow, apply_style
    from app.worker import ServiceThread

    _quiet_qt_messages()
    app = QApplication.instance() or QApplication([sys.argv[0]])
    app.setApplicationName("ExpertStream")
    app.setDesktopFileName("expertstream")
    apply_style(app)
    window = MainWindow(args.model, overrides)
    if args.screenshot:
        _screenshot(window, args, app)
    if args.size:
        window.resize(*args.size)
        window.show()
    elif args.screenshot:  # grabbed, not looked at on a screen (offscreen has none)
        window.show()
    else:
        window.show_fitted()
    code = app.exec()
    window.close()
    # Deleted now, while the QApplication lives: left to PySide's exit clean-up, the
    # plots' graphics items can be destroyed after their scene (a crash at exit).
    shiboken6.delete(window)
    ServiceThread.drain_all()
    return code


if __name__ == "__main__":
    sys.exit(main())
