"""How much the inspector's polling, or the advisor, costs the decode speed.

    QT_QPA_PLATFORM=offscreen python -m app.bench [--what polling|advisor] [--model PATH]
        [--tokens N] [--rounds R]

Runs greedy replies in the real window (offscreen), alternating two settings, and prints
the median decode tokens/s of each and the cost: `polling`, the inspector's timer off and
at 10 Hz; `advisor`, routing recording off (and no analysis) and on with the Advisor tab
shown, analysing after every reply (the next reply stops it). Run it on an otherwise idle
machine: other load swamps a few percent.
"""

import argparse
import os
import statistics
import sys


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m app.bench", description=__doc__.split("\n")[0])
    p.add_argument("--model", help="model directory or store (default: the embedded model)")
    p.add_argument("--prompt", default="Once upon a time")
    p.add_argument("--tokens", type=int, default=128, help="tokens per reply")
    p.add_argument("--rounds", type=int, default=5, help="replies per setting")
    p.add_argument("--hz", type=float, default=10.0, help="polling rate to measure")
    p.add_argument("--expert-slots", type=int, help="real-region slots (default: app's)")
    p.add_argument(
        "--what", choices=["polling", "advisor"], default="polling", help="the cost to measure"
    )
    args = p.parse_args(argv)
    os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

    from PySide6.QtCore import QEventLoop
    from PySide6.QtWidgets import QApplication

    from app.window import MainWindow

    qapp = QApplication.instance() or QApplication([sys.argv[0]])
    qapp.setApplicationName("ExpertStream")
    overrides = {} if args.expert_slots is None else {"expert_slots": args.expert_slots}
    window = MainWindow(args.model, overrides, poll_hz=args.hz)
    window.show()
    loop = QEventLoop()
    window.modelLoaded.connect(lambda _: loop.quit())
    window.engine.worker.loadFailed.connect(lambda m: (print(m), loop.exit(1)))
    if loop.exec():
        return 1
    window.replyDone.connect(lambda _: loop.quit())
    window.chat.max_tokens.setValue(args.tokens)

    analysed = []
    window.advisor_runner.finished.connect(lambda *_: (analysed.append(1), loop.quit()))

    def reply(on: bool) -> float:
        if args.what == "polling":
            window.timer.start() if on else window.timer.stop()
        else:  # recording off also leaves the analysis after each reply nothing to do
            window.engine.set_trace_tokens(4096 if on else 0)  # before the next reply
            window.tabs.setCurrentWidget(window.advisor if on else window.inspector)
        window.new_chat()
        window.send(args.prompt)
        loop.exec()
        tps = window.last_reply.decode_tps
        if args.what == "advisor" and on:
            loop.exec()  # the analysis of this reply ends before the next reply starts
        return tps

    if args.what == "advisor":
        window.timer.stop()  # measured alone
    reply(True)  # warm-up: fills the cache, compiles the sampler
    speeds = {False: [], True: []}
    for _ in range(args.rounds):
        for on in (False, True):
            speeds[on].append(reply(on))
    off, on = statistics.median(speeds[False]), statistics.median(speeds[True])
    # each pair ran back to back: their ratio cancels slow drifts of the machine's load
    pairs = [(a - b) / a for a, b in zip(speeds[False], speeds[True], strict=True)]
    names = {
        "polling": ("inspector off", f"inspector {args.hz:g} Hz"),
        "advisor": ("recording off", "recording + advisor"),
    }[args.what]
    print(f"decode tok/s, median of {args.rounds} replies of {args.tokens} tokens:")
    for name, key, value in ((names[0], False, off), (names[1], True, on)):
        print(f"  {name + ':':<22}{value:7.2f}   {[round(s, 1) for s in speeds[key]]}")
    if args.what == "advisor":
        print(f"  analyses finished between replies: {len(analysed)}")
    print(
        f"  {args.what} cost: {100 * statistics.median(pairs):+.1f}% of decode speed "
        "(median of the back-to-back pairs)"
    )
    window.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
