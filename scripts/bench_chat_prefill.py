"""Time to first token of a chat's second turn: with the KV cache kept from the first
turn (engine.generate.ChatSession) vs a fresh prefill of the whole conversation.

The embedded TinyStories model has no chat template; this gives a copy of it one (a
plain "User: / Assistant:" template), so the measured prompts are what a chat-template
model sees. Repetitions alternate the two ways; medians are printed.

    python scripts/bench_chat_prefill.py [--reps 5] [--expert-slots N]
"""

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from engine.config import StreamConfig
from engine.generate import ChatSession, generate
from engine.model import load
from engine.resources import default_model_path

# The reply follows "Assistant:" as generated (its own leading space), as the generation
# prompt left it, so the kept reply tokens match the re-rendered conversation.
TEMPLATE = (
    "{% for m in messages %}{% if m.role == 'assistant' %}Assistant:{{ m.content }}"
    "{% else %}User: {{ m.content }}{% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}Assistant:{% endif %}"
)
TURN1 = " ".join(["Once upon a time there was a little cat who liked to play in the sun."] * 20)
TURN2 = "What did the cat do next?"


def ttft(run) -> float:
    """Seconds from the call to the first generated token."""
    t0 = time.perf_counter()
    first = []
    run(lambda r: first or first.append(time.perf_counter() - t0))
    return first[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--expert-slots", type=int, default=None)
    ap.add_argument("--reply-tokens", type=int, default=32)
    args = ap.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        model = Path(shutil.copytree(default_model_path(), Path(tmp) / "tinystories-chat"))
        cfg = json.loads((model / "tokenizer_config.json").read_text())
        (model / "tokenizer_config.json").write_text(json.dumps(cfg | {"chat_template": TEMPLATE}))
        sm = load(model, StreamConfig(expert_slots=args.expert_slots))
        tok = sm.tokenizer
        turn1 = [{"role": "user", "content": TURN1}]
        ids1 = tok.apply_chat_template(turn1, add_generation_prompt=True)
        reply = generate(sm, ids1, args.reply_tokens).text
        turns = turn1 + [
            {"role": "assistant", "content": reply},
            {"role": "user", "content": TURN2},
        ]
        ids2 = tok.apply_chat_template(turns, add_generation_prompt=True)

        kept, fresh, prefilled = [], [], []
        for _ in range(args.reps):
            session = ChatSession(sm)
            session.generate(ids1, args.reply_tokens)

            def second_turn(cb, session=session):
                r = session.generate(ids2, 1, on_response=cb)
                prefilled.append(r.prompt_tokens)

            kept.append(ttft(second_turn))
            fresh.append(ttft(lambda cb: generate(sm, ids2, 1, on_response=cb)))
    k, f = statistics.median(kept), statistics.median(fresh)
    print(
        f"turn 1: {len(ids1)} prompt tokens + {args.reply_tokens} reply tokens; "
        f"turn 2 conversation: {len(ids2)} tokens, {statistics.median(prefilled)} prefilled "
        f"with the kept cache\n"
        f"time to first token of turn 2 (median of {args.reps}): kept cache {k * 1e3:.1f} ms, "
        f"fresh prefill {f * 1e3:.1f} ms, ratio {f / k:.1f}x"
    )


if __name__ == "__main__":
    main()
