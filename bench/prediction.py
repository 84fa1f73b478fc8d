"""The prefetch predictor's recall and precision per layer distance.

While MoE layer L runs, `engine.predictor.Predictor` applies the router of target layer
T = L + d to L's hidden state and prefetches its top `budget` experts. This measures, on
a model's own decode steps, how many of T's routed experts such a prediction holds
(recall = hits / (tokens x top_k)) and how many of its `budget` fills are used (precision
= hits / (tokens x budget)), for every distance d, against two alternatives at the same
number of fills:

- `coact`: online co-activation statistics, the same-token counterpart of the predictive
  eviction policy's cross-layer tables: counts of "a routed at L, e routed at T" for the
  tokens seen so far (prompt tokens included), P(e | L's experts) from them (shrunk
  towards T's expert popularity), top `budget`;
- `router+coact`: the router's log-probabilities plus `weight` x the co-activation
  log-lift log(P(e | L's experts) / P(e)), top `budget`.

The hidden states come from the predictor's per-layer entry (`prefetch_token`, wrapped)
and the routed ids from the engine's acquire hook (every call takes the synchronous path
while it is set); the routers are the model's own (the predictor's).
Timing is not part of it: "in time" depends on the storage, which suite 1 measures.
"""

import mlx.core as mx
import numpy as np

from engine.config import StreamConfig
from engine.model import load

COACT_PRIOR = 2.0  # pseudo-observations per context expert, spread by popularity


def capture(model_path, prompts: list[list[int]], max_tokens: int):
    """Runs greedy generation of `max_tokens` after each prompt; returns, per MoE layer,
    the hidden states entering it (tokens, hidden) float32, the routed ids (tokens, k)
    int32, a (tokens,) bool mask of decode tokens, and the model (for its routers)."""
    from bench.common import timed_generate

    sm = load(model_path, StreamConfig())
    hidden_calls: list[tuple[int, np.ndarray]] = []
    id_calls: list[tuple[int, np.ndarray]] = []
    prefetch_token = sm.predictor.prefetch_token

    def tap(layer, x):  # sees every MoE layer call's hidden states, before its ids
        h = np.asarray(x.astype(mx.float32))
        hidden_calls.append((layer, h.reshape(-1, h.shape[-1])))
        return prefetch_token(layer, x)

    sm.predictor.prefetch_token = tap
    sm.predictor.on_acquire = lambda layer, ids: id_calls.append((layer, ids))
    try:
        for p in prompts:
            timed_generate(sm.model, p, max_tokens)
    finally:
        sm.predictor.on_acquire = None
        sm.predictor.prefetch_token = prefetch_token
    calls = [
        (li, i.reshape(len(h), -1), h)
        for (li, h), (_, i) in zip(hidden_calls, id_calls, strict=True)
    ]
    layers = sm.cache.num_layers
    hidden = [np.concatenate([h for li, _, h in calls if li == L]) for L in range(layers)]
    ids = [np.concatenate([i for li, i, _ in calls if li == L]) for L in range(layers)]
    decode = np.concatenate([np.full(len(i), len(i) == 1) for li, i, _ in calls if li == 0])
    return sm, hidden, ids, decode


def _topb(scores: np.ndarray, b: int) -> np.ndarray:
    return np.argpartition(-scores, b - 1, axis=-1)[:, :b]


def _hits(pred: np.ndarray, ids: np.ndarray) -> int:
    return int((pred[:, :, None] == ids[:, None, :]).any(-1).sum())


def _coact_logprobs(ids_from: np.ndarray, ids_to: np.ndarray, num_experts: int) -> np.ndarray:
    """Per token t, log P(e at T | experts at L for t) from the counts of tokens < t, and
    log P(e at T) (popularity), each (tokens, E); both shrunk as COACT_PRIOR says."""
    n, E = len(ids_from), num_experts
    counts = np.zeros((E, E))
    totals = np.zeros(E)
    pop = np.zeros(E)
    out_cond = np.empty((n, E))
    out_pop = np.empty((n, E))
    for t in range(n):
        p = (pop + 1.0 / E) / (pop.sum() + 1.0)
        given = ids_from[t]
        prior = COACT_PRIOR * len(given)
        out_cond[t] = (counts[given].sum(0) + prior * p) / (totals[given].sum() + prior)
        out_pop[t] = p
        for a in given:
            counts[a, ids_to[t]] += 1
            totals[a] += len(ids_to[t])
        pop[ids_to[t]] += 1
    return np.log(out_cond), np.log(out_pop)


def prediction_suite(
    model_path,
    prompts: list[list[int]],
    max_tokens: int = 128,
    budget: int | None = None,
    distances=(1, 2, 3, 4),
    weights=(0.5, 1.0, 2.0),
    log=print,
) -> dict:
    """Recall and precision of the router, co-activation and combined predictors per
    distance, over the decode tokens of the run. `budget`: fills per prediction (default
    2 x top_k, the benchmark's side region). Returns {"budget", "top_k", "tokens",
    "rows": [{"distance", "predictor", "recall", "precision", "pairs"}]}."""
    sm, hidden, ids, decode = capture(model_path, prompts, max_tokens)
    k = ids[0].shape[1]
    E = sm.cache.num_experts
    b = budget or min(E, 2 * k)
    rows = []
    layers = len(ids)
    for d in distances:
        acc: dict[str, list[int]] = {}
        pairs = 0
        for L in range(layers - d):
            T = L + d
            if sm.predictor.routers[T] is None:  # a family whose router is not found
                continue
            logits = sm.predictor.routers[T](mx.array(hidden[L])).astype(mx.float32)
            router = np.asarray(logits - mx.logsumexp(logits, axis=-1, keepdims=True))
            cond, pop = _coact_logprobs(ids[L], ids[T], E)
            truth = ids[T][decode]
            scored = {"router": router, "coact": cond}
            for w in weights:
                scored[f"router+coact x{w:g}"] = router + w * (cond - pop)
            for name, s in scored.items():
                acc.setdefault(name, []).append(_hits(_topb(s[decode], b), truth))
            pairs += 1
        n = int(decode.sum()) * pairs
        if n == 0:
            continue
        for name, hits in acc.items():
            total = sum(hits)
            rows.append(
                {
                    "distance": d,
                    "predictor": name,
                    "recall": total / (n * k),
                    "precision": total / (n * b),
                    "pairs": pairs,
                }
            )
        log(
            f"distance {d}: "
            + ", ".join(f"{r['predictor']} {r['recall']:.1%}" for r in rows if r["distance"] == d)
        )
    return {"budget": b, "top_k": k, "tokens": int(decode.sum()), "rows": rows}
