"""A reply of `expertstream serve` as the generation thread writes it, whether it is
generated alone or in a batch: stop strings over its growing text (`StopMatcher`), its
events and usage (`Reply`), and the server's counters it adds to (`ServerStats`).
"""

import threading
import time
from dataclasses import dataclass, field

from engine.serve.bodies import Job


class StopMatcher:
    """Stop strings over a reply that grows piece by piece: `add` returns the text that
    may be sent now, holding back a tail that could be the start of a stop string, and
    cuts the reply where the first stop string begins (`hit`; `matched`: that string)."""

    def __init__(self, stops: list[str]):
        self.stops = stops
        self.text = ""
        self.sent = 0
        self.hit = False
        self.matched: str | None = None

    def add(self, piece: str) -> str:
        """Appends `piece`; returns what can be sent (nothing more after a hit)."""
        if self.hit:
            return ""
        self.text += piece
        found = [(i, s) for s in self.stops if (i := self.text.find(s, self.sent)) >= 0]
        if found:
            self.hit = True
            end, self.matched = min(found)
        else:
            end = len(self.text) - self._pending()
        out, self.sent = self.text[self.sent : end], end
        return out

    def flush(self) -> str:
        """The held-back tail, at the end of a reply no stop string cut."""
        out, self.sent = ("" if self.hit else self.text[self.sent :]), len(self.text)
        return out

    def _pending(self) -> int:
        """Length of the longest unsent tail that a stop string starts with."""
        tail = self.text[self.sent :]
        return max(
            (
                k
                for s in self.stops
                for k in range(min(len(s) - 1, len(tail)), 0, -1)
                if tail.endswith(s[:k])
            ),
            default=0,
        )


@dataclass
class ServerStats:
    """Request and token counters of the server's lifetime (guarded by `lock`).

    Attributes:
        requests: requests queued (refused ones are `requests_refused`).
        requests_refused: requests refused with 503 (the queue was full).
        completed, cancelled, failed: queued requests by how they ended.
        prompt_tokens: prompt tokens of the replies, cached ones included.
        cached_tokens: prompt tokens taken from the prompt cache (not prefilled).
        completion_tokens: tokens generated.
        generation_seconds: wall seconds during which a reply was generating (replies
            generated side by side counted once).
        decode_steps, decode_rows: the batch's decode steps, and the rows they forwarded
            (one token each; their ratio: the mean batch).
        prefill_tokens, prefill_seconds, decode_tokens, decode_seconds: what the replies
            prefilled and decoded and how long that took (the queue's wait estimate).
        last_error: why the latest reply failed; None once a later one succeeds.
        last_prefill_tps, last_decode_tps: the latest reply's prefill and decode
            tokens/s; None before the first reply, and without a prefill / decode step
            (`GenerationResult.prefill_tps`, `.decode_tps`).
    """

    requests: int = 0
    requests_refused: int = 0
    completed: int = 0
    cancelled: int = 0
    failed: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    generation_seconds: float = 0.0
    prefill_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_tokens: int = 0
    decode_seconds: float = 0.0
    decode_steps: int = 0
    decode_rows: int = 0
    last_prefill_tps: float | None = None
    last_decode_tps: float | None = None
    last_error: str | None = None
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)


class Reply:
    """One job's reply as it is generated, by either loop of the generation thread: its
    start, its text cut at a stop string (`StopMatcher`), the log-probabilities of the
    text sent, and its end (usage, the server's counters, the job's last event).

    Args:
        stats: the server's counters.
        tokenizer: mlx-lm's TokenizerWrapper (the text of log-probabilities' tokens).
        job: the job replied to.

    Attributes:
        began: when its generation began (`time.monotonic()`).
        cached: prompt tokens the prompt cache gave (`start`).
        sent: tokens generated so far.
    """

    def __init__(self, stats: ServerStats, tokenizer, job: Job):
        self.stats, self.tokenizer, self.job = stats, tokenizer, job
        self.matcher = StopMatcher(job.stop)
        self.records: list[dict] = []  # log-probabilities of tokens whose text is held back
        self.began = time.monotonic()
        self.cached = 0
        self.sent = 0  # tokens handed to the reply (a pipeline's last one is not in its result)

    def start(self, cached: int) -> None:
        """The generation begins over `cached` prompt tokens from the prompt cache."""
        self.cached = cached
        self.job.emit("start", {"cached_tokens": cached})

    def respond(self, token: int, text: str, logprobs) -> None:
        """Takes one generated `token`, the `text` it adds to the reply and its step's
        log-probabilities (an MLX array (vocab,))."""
        self.sent += 1
        if (top := self.job.logprobs) is not None:
            self.records.append(logprobs_record(self.tokenizer, token, logprobs, top))
        if piece := self.matcher.add(text):
            self.job.emit("text", piece, self.records[:])
            self.records.clear()

    def stopping(self) -> bool:
        """The reply is to end now: its client went, the server ends it, or a stop string
        cut its text."""
        return self.job.cancel.is_set() or self.matcher.hit

    def figures(self) -> dict:
        """What `/v1/stats` says of a reply in progress."""
        return {
            "prompt_tokens": len(self.job.prompt),
            "cached_tokens": self.cached,
            "generated_tokens": self.sent,
            "seconds": time.monotonic() - self.began,
        }

    def fail(self, e: Exception) -> None:
        """Ends the reply with the generation's error (counted in `failed`, kept as
        `last_error`)."""
        message = f"generation failed: {type(e).__name__}: {e}"
        with self.stats.lock:
            self.stats.failed += 1
            self.stats.last_error = message
        self.job.emit("error", message)

    def end(
        self,
        tokens: int,
        finish: str | None,
        stopped: bool,
        prefill_tps: float | None,
        decode_tps: float | None,
    ) -> None:
        """Ends the reply after `tokens` generated ones: `finish` the generation's reason
        ("stop" at the end-of-sequence token, "length"), `stopped` when `stopping` ended
        it, the prefill and decode tokens/s (None without a prefill or decode step)."""
        job, s, cached = self.job, self.stats, self.cached
        if self.matcher.hit:
            finish = "stop"
        elif stopped:  # the cancel was seen: a cancel after the last token ends nothing
            finish = None
        elif (rest := self.matcher.flush()) or self.records:
            job.emit("text", rest, self.records[:])
        prompt = len(job.prompt)
        usage = {
            "prompt_tokens": prompt,
            "completion_tokens": tokens,
            "total_tokens": prompt + tokens,
            "cached_tokens": cached,
        }
        with s.lock:
            if finish is None:
                s.cancelled += 1
            else:
                s.completed += 1
            s.prompt_tokens += prompt
            s.cached_tokens += cached
            s.completion_tokens += tokens
            if prefill_tps:
                s.prefill_tokens += prompt - cached
                s.prefill_seconds += (prompt - cached) / prefill_tps
            if decode_tps:
                s.decode_tokens += tokens
                s.decode_seconds += tokens / decode_tps
            s.last_prefill_tps, s.last_decode_tps = prefill_tps, decode_tps
            s.last_error = None
        if finish is None and job.ended_by:
            job.emit("error", f"{job.ended_by}: the reply was cut after {self.sent} tokens", 503)
        else:
            job.emit("done", {"finish": finish, "stop": self.matcher.matched, "usage": usage})


def logprobs_record(tokenizer, token: int, logprobs, top: int) -> dict:
    """The log-probability of `token` and of the `top` most likely tokens at its step
    (`logprobs`: mlx-lm's log-probabilities of the step, (vocab,), the sampler's
    distribution before temperature), with each token's text."""
    import mlx.core as mx

    decode = tokenizer.decode
    out = {"token": decode([token]), "logprob": logprobs[token].item(), "top": []}
    if top:
        ids = mx.argpartition(-logprobs, top - 1)[:top]
        values = logprobs[ids].tolist()
        pairs = sorted(zip(values, ids.tolist(), strict=True), key=lambda p: -p[0])
        out["top"] = [(decode([i]), v) for v, i in pairs]
    return out
