"""How much the inspector's polling costs the decode speed.

    QT_QPA_PLATFORM=offscreen python -m app.bench [--model PATH] [--tokens N] [--rounds R]

Runs greedy replies in the real window (offscreen), alternating the inspector's timer
off and at 10 Hz, and prints the median decode tokens/s of each and the polling cost.
Run it on an otherwise idle machine: other load swamps a few percent.
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

    def reply(polling: bool) -> float:
        if polling:
            window.timer.start()
        else:
            window.timer.stop()
        window.new_chat()
        window.send(args.prompt)
        loop.exec()
        return window.last_reply.decode_tps

    reply(True)  # warm-up: fills the cache, compiles the sampler
    speeds = {False: [], True: []}
    for _ in range(args.rounds):
        for polling in (False, True):
            speeds[polling].append(reply(polling))
    off, on = statistics.median(speeds[False]), statistics.median(speeds[True])
    # each pair ran back to back: their ratio cancels slow drifts of the machine's load
    pairs = [(a - b) / a for a, b in zip(speeds[False], speeds[True], strict=True)]
    print(f"decode tok/s, median of {args.rounds} replies of {args.tokens} tokens:")
    print(f"  inspector off:     {off:7.2f}   {[round(s, 1) for s in speeds[False]]}")
    print(f"  inspector {args.hz:g} Hz:  {on:7.2f}   {[round(s, 1) for s in speeds[True]]}")
    print(
        f"  polling cost: {100 * statistics.median(pairs):+.1f}% of decode speed "
        "(median of the back-to-back pairs)"
    )
    window.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
