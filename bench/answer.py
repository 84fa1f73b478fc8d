"""The host's share of a decode step on a GPU: the acquire mailbox's answers, on any machine.

On MLX CUDA each MoE layer's acquire kernel waits while a host thread answers it
(`engine.device_acquire`): `ExpertCache.acquire` on the request's ids, the misses staged
from the host tier, the copies handed back. Where a layer's ids are not all in the hit
table the device waits for every microsecond of that answer, so it is part of the layer's
time. This benchmark times the answers alone:
a store with a model's routing shapes (MoE layers, experts, top-k) and records of a few
KB, a host tier holding every expert, and `rows` random rows of top-k ids per request
(rows = conversations in one batched decode step; random routing, as the synthetic
30B-A3B store's), posted through `AcquireMailbox.post` as the kernels post them. Where the
pools are host memory (the CPU backend) the mailbox's memory is plain host memory and
`post` performs the copies itself, so only the host's work is timed, not the bus.

    python -m bench.answer [--rows 1,4] [--fractions 0.25,0.5] [--policies predictive,lru]
        [--steps 100] [--work DIR]

Per row: microseconds per answer (the mailbox thread's, from request to reply) and per
`acquire` inside it, misses per request, the share of requests whose rows came from the
hit table (not waited for), and the ratio of each policy's answer to the first policy's.
"""

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from engine.cache import open_cache, snapshot
from engine.config import EVICTION_POLICIES, StreamConfig
from engine.device_acquire import AcquireMailbox
from engine.flags import positive_int
from engine.store import ExpertStore, is_store
from engine.synthetic import QWEN3_30B_A3B, tiny_config, write_store

HIDDEN = 64  # the tiny records' hidden size: the answer's cost does not depend on it


def shaped_store(work: Path, layers: int, experts: int, top_k: int) -> ExpertStore:
    """A store of `layers` MoE layers of `experts` tiny experts, top-`top_k`, in `work`
    (written on first use; a few MB)."""
    out = work / f"answer-{layers}x{experts}-top{top_k}"
    if not is_store(out):
        write_store(out, tiny_config(layers, experts, top_k, HIDDEN, 32), group_size=32)
    return ExpertStore(out)


def answer_cost(
    store: ExpertStore, slots: int, rows: int, policy: str, steps: int = 100, seed: int = 0
) -> dict:
    """Times `steps` decode steps of `rows` random rows through the mailbox of a cache of
    `slots` real slots per layer, every record in the host tier, after 20 untimed steps.

    Returns {"answer_us": the mailbox thread's microseconds per answer, "acquire_us":
    `acquire_seconds` per request in microseconds, "post_us": the poster's wall time per
    request (the answer plus the hand-offs), "misses": misses per request, "host_hits":
    misses staged from the tier per request, "hit_table_share": the share of requests
    posted with rows from the hit table}.

    Raises:
        ValueError: rows x top-k ids exceed `slots` (an over-capacity step).
    """
    m = store.manifest
    layers, experts, k = len(m.layers), m.num_experts, m.top_k
    if rows * k > slots:
        raise ValueError(
            f"{rows} rows of top-{k} ids exceed {slots} slots: such a step is over capacity "
            "and takes the layer scratch, not the mailbox"
        )
    cache = open_cache(
        store, StreamConfig(expert_slots=slots, side_slots=0, policy=policy, io_uring=False)
    )
    ids_per_request = rows * k
    mailbox = AcquireMailbox(
        cache, HIDDEN, max_ids=max(16, 2 * ids_per_request), fill_slots=16, tier_slots=experts
    )
    for li in range(layers):  # staging off: each record read once and kept in the tier
        cache.load_layer(li, list(range(experts)))
    cache.set_staging(True)
    rng = np.random.default_rng(seed)

    def step():
        for li in range(layers):
            ids = np.concatenate([rng.choice(experts, k, replace=False) for _ in range(rows)])
            mailbox.post(li, ids.astype(np.int32), None)

    for _ in range(20):
        step()
    before, busy = snapshot(cache).totals(), mailbox.answer_seconds
    answered, fast = mailbox.answered, mailbox.fast_answers
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    mailbox.wait()  # the last requests' answers, not waited for where from the hit table
    wall = time.perf_counter() - t0
    after = snapshot(cache).totals()
    requests = mailbox.answered - answered
    per = 1e6 / requests
    out = {
        "answer_us": (mailbox.answer_seconds - busy) * per,
        "acquire_us": (after["acquire_seconds"] - before["acquire_seconds"]) * per,
        "post_us": wall * per,
        "misses": (after["misses"] - before["misses"]) / requests,
        "host_hits": (after["host_hits"] - before["host_hits"]) / requests,
        "hit_table_share": (mailbox.fast_answers - fast) / requests,
    }
    return out


def suite(
    work: Path,
    rows=(1, 4),
    fractions=(0.25, 0.5),
    policies=("predictive", "lru"),
    steps: int = 100,
    shapes=QWEN3_30B_A3B,
    log=print,
) -> list[dict]:
    """`answer_cost` for each fraction of the experts, rows per request and policy, on a
    store of `shapes`' routing (a config dict with num_hidden_layers, num_experts,
    num_experts_per_tok); returns one dict per row of the printed table."""
    layers, experts = shapes["num_hidden_layers"], shapes["num_experts"]
    k = shapes["num_experts_per_tok"]
    store = shaped_store(work, layers, experts, k)
    log(f"{layers} MoE layers, {experts} experts, top-{k}; random rows; host tier of every expert")
    log(
        "\n| slots | rows | policy | µs per answer | ÷ first policy | µs in acquire "
        "| µs per post | misses per request | from the hit table |"
    )
    log("|---|---|---|---|---|---|---|---|---|")
    out = []
    for frac in fractions:
        slots = max(k, round(experts * frac))
        for n in [n for n in rows if n * k <= slots]:
            first = None
            for policy in policies:
                r = answer_cost(store, slots, n, policy, steps) | {
                    "slots": slots,
                    "rows": n,
                    "policy": policy,
                }
                first = first or r["answer_us"]
                log(
                    f"| {slots} | {n} | {policy} | {r['answer_us']:.1f} | "
                    f"{r['answer_us'] / first:.2f}x | {r['acquire_us']:.1f} | "
                    f"{r['post_us']:.1f} | {r['misses']:.1f} | {r['hit_table_share']:.0%} |"
                )
                out.append(r)
    return out


def _list(kind):
    def parse(text: str):
        try:
            return [kind(v) for v in text.split(",")]
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list") from None

    return parse


def main(argv: list[str] | None = None) -> int:
    """Parses the flags, runs `suite` and prints its table; returns the exit code."""
    p = argparse.ArgumentParser(prog="python -m bench.answer", description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=_list(int), default=[1, 4], help="rows per request")
    p.add_argument("--fractions", type=_list(float), default=[0.25, 0.5])
    p.add_argument("--policies", type=_list(str), default=["predictive", "lru"])
    p.add_argument("--steps", type=positive_int, default=100, help="timed decode steps")
    p.add_argument("--work", type=Path, help="where the tiny store is kept (default: a temp dir)")
    args = p.parse_args(argv)
    bad = [x for x in args.policies if x not in EVICTION_POLICIES]
    if bad:
        p.error(f"--policies: {', '.join(bad)} not in {', '.join(EVICTION_POLICIES)}")
    if any(not 0 < f <= 1 for f in args.fractions) or any(n < 1 for n in args.rows):
        p.error("--fractions must be in (0, 1] and --rows at least 1")
    with tempfile.TemporaryDirectory() as tmp:
        suite(args.work or Path(tmp), args.rows, args.fractions, args.policies, args.steps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
