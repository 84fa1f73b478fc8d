"""The `expertstream serve` subcommand's own flags: where it listens, its batch and queue,
the default reply limit, uvicorn's log level, the routing it keeps for /v1/trace and its
prompt cache.
The flags every model command shares (--model, --pipeline, the cache flags) are added by
engine.cli beside these. Imports no server module: the parser is built for every
subcommand, with or without the 'serve' extra installed.
"""

import argparse

from engine.config import PREFILL_STEP_SIZE, parse_memory
from engine.flags import port, positive_int

# Replies generated at once by default (`--max-batch`).
MAX_BATCH = 8


def prompt_cache_size(text: str) -> int:
    """`--prompt-cache`'s value: a size ("1GiB", "512MB") or "0" (off), in bytes.

    Raises:
        argparse.ArgumentTypeError: anything else, "auto" included.
    """
    wanted = f"must be a size (e.g. 1GiB) or 0 (off), got {text!r}"
    try:
        value = 0 if text.strip() == "0" else parse_memory(text)
    except ValueError:
        # parse_memory's own words offer "auto" and refuse 0, both wrong for this flag
        raise argparse.ArgumentTypeError(wanted) from None
    if value == "auto":
        raise argparse.ArgumentTypeError(wanted)
    return int(value)


def add_serve_flags(parser: argparse.ArgumentParser) -> None:
    """Adds serve's own flags to `parser` (the `serve` subcommand's parser)."""
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=port, default=8080, help="TCP port (0: any free port)")
    parser.add_argument(
        "--max-batch",
        type=positive_int,
        default=MAX_BATCH,
        help="replies generated at once, side by side (a request joins the batch between "
        "decode steps; 1: one at a time; --pipeline serves one at a time)",
    )
    parser.add_argument(
        "--max-queue",
        type=positive_int,
        default=32,
        help="requests that may wait while the batch is full; more get 503 with Retry-After",
    )
    parser.add_argument(
        "--prefill-step-size",
        type=positive_int,
        default=PREFILL_STEP_SIZE,
        metavar="N",
        help="prompt tokens per forward of a prefill: a long prompt joining the batch holds "
        "the other replies up for one such forward at a time (not with --pipeline)",
    )
    parser.add_argument(
        "--max-tokens",
        type=positive_int,
        default=256,
        help="reply limit of requests that set no max_tokens (tokens)",
    )
    parser.add_argument(
        "--log-level",
        default="info",
        choices=["critical", "error", "warning", "info", "debug"],
        help="uvicorn's log level (info: one line per request)",
    )
    parser.add_argument(
        "--record-trace",
        type=int,
        default=0,
        metavar="N",
        help="keep the routing of the last N tokens, served at GET /v1/trace as .npz "
        "(for expertstream advise --trace; 0: off)",
    )
    parser.add_argument(
        "--prompt-cache",
        type=prompt_cache_size,
        default="1GiB",
        metavar="SIZE",
        help="KV memory kept of recent conversations, so that a request continuing one "
        "prefills only its new tokens (LRU; 0: off; not with --pipeline)",
    )
