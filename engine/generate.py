"""Generation with a streamed model: mlx-lm's own sampling and chat template, plus the
cache's figures.

`stream_generate` yields mlx-lm `GenerationResponse`s unchanged; `generate` collects a
whole reply into a `GenerationResult` with the stats the CLI and the app report.
"""

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import mlx.core as mx
from mlx_lm.generate import GenerationResponse
from mlx_lm.generate import stream_generate as mlx_stream_generate
from mlx_lm.sample_utils import make_sampler

from engine import autopin
from engine.model import StreamedModel
from engine.predictor import GenerationStopped


def prompt_tokens(sm: StreamedModel, prompt: str, chat: bool) -> list[int]:
    """Token ids of `prompt`: through the tokenizer's chat template when `chat` and the
    model has one (a single user turn, generation prompt added), else as given.

    Raises:
        ValueError: the store has no tokenizer, the prompt encodes to no tokens, or to an
            id outside the model's vocabulary.
    """
    tok = sm.tokenizer
    if tok is None:
        raise ValueError(
            f"{sm.store.path} has no tokenizer files (tokenizer.json / tokenizer_config.json); "
            "text generation needs the model's tokenizer"
        )
    if chat and getattr(tok, "chat_template", None):
        ids = tok.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True
        )
    else:
        ids = tok.encode(prompt)
    if not ids:
        raise ValueError("the prompt is empty after tokenization")
    vocab = sm.store.config.get("vocab_size")
    if vocab and max(ids) >= vocab:
        raise ValueError(
            f"the tokenizer produced token id {max(ids)}, outside the model's vocabulary of "
            f"{vocab} (vocab_size in config.json): tokenizer and model do not match"
        )
    return list(ids)


def check_context(sm: StreamedModel, n_prompt: int, max_tokens: int) -> None:
    """Raises ValueError when prompt + reply exceed the model's context window
    (`max_position_embeddings` of config.json), naming both numbers."""
    limit = sm.store.config.get("max_position_embeddings")
    if limit and n_prompt + max_tokens > limit:
        raise ValueError(
            f"prompt ({n_prompt} tokens) + max_tokens ({max_tokens}) exceeds the model's "
            f"context of {limit} tokens (max_position_embeddings)"
        )


def stream_generate(
    sm: StreamedModel,
    prompt: list[int],
    max_tokens: int = 256,
    temperature: float = 0.0,
    top_p: float = 1.0,
    prompt_cache=None,
) -> Iterator[GenerationResponse]:
    """Yields one mlx-lm GenerationResponse per token (greedy at temperature 0).

    Args:
        prompt: token ids.
        max_tokens: reply length limit, tokens.
        prompt_cache: an mlx-lm KV cache to continue a conversation, or None.

    Raises:
        engine.cache.ExpertReadError (ChecksumError, ExpertReadTimeout): an expert could
            not be read; no token computed without it is yielded.
        GenerationStopped: the caller's stop hook asked to stop mid-forward.
    """
    check_context(sm, len(prompt), max_tokens)
    sampler = make_sampler(temp=temperature, top_p=top_p)
    for response in mlx_stream_generate(
        sm.model,
        sm.tokenizer,
        mx.array(prompt),
        max_tokens=max_tokens,
        sampler=sampler,
        prompt_cache=prompt_cache,
    ):
        # A read that failed inside a stream-ordered acquire left row 0 in its place: the
        # token is wrong, so its error is raised before the token is handed out.
        sm.cache.raise_stream_error()
        yield response


@dataclass
class GenerationResult:
    """A finished reply.

    Attributes:
        text: the decoded reply.
        tokens: generated token ids.
        prompt_tokens: prompt length, tokens.
        prefill_tps / decode_tps: mlx-lm's prompt and generation tokens per second.
        peak_memory_bytes: MLX peak memory of the process, bytes.
        cache: cache counter totals for this reply (`CacheSnapshot.totals()` deltas;
            hit_rate and prefetch_accuracy recomputed over the reply).
        stopped: the caller's `stop` ended the reply early.
    """

    text: str
    tokens: list[int]
    prompt_tokens: int
    prefill_tps: float
    decode_tps: float
    peak_memory_bytes: int
    cache: dict = field(default_factory=dict)
    stopped: bool = False

    def stats(self) -> dict:
        """The stats object of `expertstream generate --json`."""
        c = self.cache
        return {
            "hits": c["hits"],
            "misses": c["misses"],
            "hit_rate": c["hit_rate"],
            "bytes_read": c["bytes_read"],
            "side_hits": c["side_hits"],
            "prefetch_issued": c["prefetch_issued"],
            "prefetch_used": c["prefetch_used"],
            "prefetch_wasted": c["prefetch_wasted"],
            "prefetch_accuracy": c["prefetch_accuracy"],
            "evictions": c["evictions"],
            "overcap_calls": c["overcap_calls"],
            "prompt_tokens": self.prompt_tokens,
            "generated_tokens": len(self.tokens),
            "prefill_tps": self.prefill_tps,
            "decode_tps": self.decode_tps,
            "peak_memory_bytes": self.peak_memory_bytes,
        }


def cache_delta(before: dict, after: dict) -> dict:
    """Counter totals accumulated between two `CacheSnapshot.totals()`."""
    d = {
        k: after[k] - before[k]
        for k in after
        if k not in ("hit_rate", "prefetch_accuracy", "inflight")
    }
    lookups = d["hits"] + d["misses"]
    d["hit_rate"] = d["hits"] / lookups if lookups else 0.0
    d["prefetch_accuracy"] = (
        d["prefetch_used"] / d["prefetch_issued"] if d["prefetch_issued"] else 0.0
    )
    return d


def generate(
    sm: StreamedModel,
    prompt: list[int],
    max_tokens: int = 256,
    temperature: float = 0.0,
    top_p: float = 1.0,
    on_response: Callable[[GenerationResponse], None] | None = None,
    stop: Callable[[], bool] | None = None,
) -> GenerationResult:
    """Generates a whole reply and updates autopin afterwards (when enabled).

    Args:
        on_response: called with each mlx-lm GenerationResponse as it is produced.
        stop: polled at every MoE layer call (so also during a long prefill) and after
            each token; the reply ends early when it returns True
            (`GenerationResult.stopped`).
    """
    mx.reset_peak_memory()
    before = sm.snapshot().totals()
    text, tokens, last, stopped = [], [], None, False
    sm.predictor.should_stop = stop
    try:
        for r in stream_generate(sm, prompt, max_tokens, temperature, top_p):
            tokens.append(r.token)
            text.append(r.text)
            last = r
            if on_response:
                on_response(r)
            if stop and stop():
                stopped = True
                break
    except GenerationStopped:
        stopped = True
    finally:
        sm.predictor.should_stop = None
    after = sm.snapshot().totals()
    if sm.config.autopin_frac > 0:  # re-pin between replies, and keep the set for next time
        pins = autopin.repin(sm.cache, sm.autopin_budget())
        autopin.save(sm.store.path / autopin.PIN_FILE, pins, sm.store.manifest.num_experts)
    return GenerationResult(
        text="".join(text),
        tokens=tokens,
        prompt_tokens=len(prompt),
        prefill_tps=last.prompt_tps if last else 0.0,
        decode_tps=last.generation_tps if last else 0.0,
        peak_memory_bytes=int(mx.get_peak_memory()),
        cache=cache_delta(before, after),
        stopped=stopped,
    )
