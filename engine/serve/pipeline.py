"""`expertstream serve --pipeline`: rank 0 serves HTTP, every other rank follows it.

Under `mlx.launch`, rank 0 runs engine.serve.server (the same routes, flags and queue) with a
`PipelineGenerationThread`; every other rank runs `follow`. They talk only through the
pipeline's collectives (engine.pipeline), every rank joining them in the same order:

- a command round (`gather_json`, rank 0's value taken): a reply's parameters (prompt
  ids, max_tokens, temperature, top_p, seed), None every HEARTBEAT_S while idle (so
  that a rank that died is noticed between requests), or "stop" when rank 0 shuts down;
- the reply (`reply`): every rank runs the same generation loop on the same sampled
  tokens. max_tokens and the end-of-sequence token end it at the same token on every
  rank by themselves; a stop string or a cancel (client gone, shutdown) is rank 0's to
  see, so after each token every rank adds its wish to stop to a one-number all_sum,
  read one token later so that it overlaps the next forward: all ranks end one token
  after the wish, which is left out of the reply (the stop is not polled mid-forward,
  as a single process does);
- a stats round: every rank's cache counters (`rank_stats`), which rank 0 keeps for
  `/v1/stats` (gathered at load and after each reply, so a stats request never waits
  for a collective: during a reply it shows the figures as of the previous one).

A failed rank stops the pipeline: a collective that fails on rank 0 fails the request
and every queued one and ends the server with the error (exit code 2); a follower exits
with its error, and with 0 on rank 0's "stop". Every wait on the other ranks is bounded
(`engine.pipeline.bounded`: STEP_TIMEOUT_S for a round or a token, PROMPT_TIMEOUT_S for
a prompt), ending the process past it: MLX's ring backend may wait without a bound on a
rank that went away (a collective issued after the one that failed never returns).
"""

import dataclasses
import os
import queue
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx
from mlx_lm.generate import generation_stream

from engine.cache import REPORTED_STATS
from engine.config import StreamConfig
from engine.generate import GenerationResult, generate
from engine.model import load_stage
from engine.pipeline import (
    PipelineError,
    bounded,
    combine_stats,
    exit_now,
    gather_json,
    lost,
    rank_stats,
)
from engine.serve.reply import Reply
from engine.serve.server import GenerationThread, Job

# Seconds between rank 0's idle command rounds.
HEARTBEAT_S = 2.0
# Seconds the other ranks may take to reach a round, or the next token of a reply...
STEP_TIMEOUT_S = 60.0
# ... and a reply's prompt and first token.
PROMPT_TIMEOUT_S = 600.0
STOP = "stop"


def command_round(command, group):
    """Rank 0's `command` (JSON) on every rank; the other ranks pass None.

    Raises:
        PipelineError: the connection to another rank was lost.
    """
    with bounded(STEP_TIMEOUT_S, "the other ranks did not answer"):
        return gather_json(command, group)[0]


def stats_round(sm, group) -> list[dict]:
    """Every rank's `rank_stats`, in rank order, on every rank.

    Raises:
        PipelineError: the connection to another rank was lost.
    """
    with bounded(STEP_TIMEOUT_S, "the other ranks did not send their figures"):
        return gather_json(rank_stats(sm), group)


def reply(
    sm,
    group,
    params: dict,
    on_response: Callable | None = None,
    stop: Callable[[], bool] | None = None,
) -> GenerationResult:
    """This rank's part of one reply, which every rank runs with the same `params`.

    After each token every rank adds its wish to stop to a one-number all_sum on the
    generation stream, where it runs between this token's forward and the next on every
    rank, and reads the sum of the token before: a wish ends the reply on every rank one
    token later, never waiting on a forward in flight (the vote's round trip overlaps
    the next forward). The extra token is left out of the returned reply.

    Args:
        sm: this rank's engine.model.StreamedModel (`load_stage`).
        params: `{"prompt": [ids], "max_tokens", "temperature", "top_p", "seed"}`.
        on_response: as engine.generate.generate's (rank 0 sends the text); it also
            sees the extra token (a stop string has already cut the text).
        stop: this rank's wish to stop, polled after each token.

    Returns:
        The reply up to the first token after which any rank wished to stop.

    Raises:
        PipelineError: this rank failed, or the connection to another rank was lost.
    """
    last = [None, ""]  # the vote after the previous token (in flight), its token's text

    def agreed() -> bool:
        wish = stop is not None and stop()
        with mx.stream(generation_stream):
            vote = mx.distributed.all_sum(mx.array(int(wish)), group=group)
        mx.async_eval(vote)
        previous, last[0] = last[0], vote
        stopping = previous is not None and previous.item() > 0
        renew(STEP_TIMEOUT_S, "the other ranks did not finish a token")
        return stopping

    def respond(r) -> None:
        last[1] = r.text
        if on_response is not None:
            on_response(r)

    mx.random.seed(params["seed"])  # every rank samples the same token
    try:
        with bounded(PROMPT_TIMEOUT_S, "the other ranks did not finish the prompt") as renew:
            result = generate(
                sm,
                params["prompt"],
                params["max_tokens"],
                params["temperature"],
                params["top_p"],
                on_response=respond,
                stop=agreed,
                stop_mid_forward=False,
            )
            # Sampling leaves the random key lazy on this thread's stream (as the server
            # does; not after a failure, when that stream may wait forever).
            mx.eval(mx.random.state)
    except Exception as e:  # noqa: BLE001  (any failure leaves the ranks out of step)
        raise lost(group.rank(), e) from None
    if result.stopped:  # the token after the wish
        text = result.text[: len(result.text) - len(last[1])]
        return dataclasses.replace(result, text=text, tokens=result.tokens[:-1])
    return result


def follow(path: str | Path | None, config: StreamConfig, group) -> int:
    """A follower rank: loads its stage, then runs its part of every reply rank 0
    starts, until rank 0 says stop. Returns the exit code (0); a failure once loaded
    ends the process (`exit_now`).

    Raises:
        PipelineError: a rank could not load.
    """
    sm = load_stage(path, config, group)
    # Ctrl-C reaches every rank of a host: rank 0 stops, then tells the others.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    print(f"{sm.stage} (pid {os.getpid()}): following rank 0", file=sys.stderr, flush=True)
    try:
        stats_round(sm, group)
        while (params := command_round(None, group)) != STOP:
            if params is not None:
                reply(sm, group, params)
                stats_round(sm, group)
    except PipelineError as e:
        exit_now(str(e))
    return 0


class PipelineGenerationThread(GenerationThread):
    """Rank 0's generation thread: engine.serve.server.GenerationThread that sends each job to
    the other ranks (`command_round`), generates it with them (`reply`), one at a time,
    and keeps every rank's cache figures (`ranks`).

    Args:
        path, config: the model and cache settings (`load_stage`).
        group: the pipeline's `mx.distributed.Group`, this process rank 0.
        max_queue: as GenerationThread's.

    Attributes:
        ranks: every rank's `rank_stats`, as of the last stats round.
        failure: the error that ended the pipeline, or None.
        on_failure: called (on this thread) once `failure` is set: stops the HTTP server.
    """

    fatal = (PipelineError,)

    def __init__(self, path: str | Path | None, config: StreamConfig, group, max_queue: int):
        # One reply at a time: every rank runs each reply's generation loop in step
        # (`reply`), which a batch whose rows join and leave between steps would have to
        # agree on at every step.
        super().__init__(self._load_stage, max_queue, max_batch=1)
        self._path, self._config, self.group = path, config, group
        self.ranks: list[dict] = []
        self.failure: str | None = None
        self.on_failure: Callable[[], None] | None = None
        self._lock = threading.Lock()  # orders submit and the failure's drain

    def submit(self, job: Job) -> None:
        """Queues `job`; after a failure, fails it at once."""
        with self._lock:
            if self.failure is None:
                return super().submit(job)
        job.emit("error", self.failure)

    def cache_stats(self) -> dict:
        """Every rank's counters added up, and each rank's own under `ranks` (as of the
        end of the last reply: `gathered`)."""
        total = combine_stats(self.ranks)
        return {k: total[k] for k in REPORTED_STATS} | {
            "ranks": self.ranks,
            "gathered": "at load and after each reply",
        }

    def _load_stage(self):
        sm = load_stage(self._path, self._config, self.group)
        print(f"{sm.stage} (pid {os.getpid()}): serving", file=sys.stderr, flush=True)
        self.ranks = stats_round(sm, self.group)
        return sm

    def _next_job(self) -> Job | None:
        while True:
            try:
                job = self._jobs.get(timeout=HEARTBEAT_S)
            except queue.Empty:
                command_round(None, self.group)
                continue
            if job is None:
                command_round(STOP, self.group)
            return job

    def _generate(self, reply_to: Reply):
        job = reply_to.job
        seed = job.seed if job.seed is not None else int.from_bytes(os.urandom(4))
        params = {
            "prompt": job.prompt,
            "max_tokens": job.max_tokens,
            "temperature": job.temperature,
            "top_p": job.top_p,
            "seed": seed,
        }
        reply_to.start(0)
        try:
            command_round(params, self.group)
            result = reply(
                self.sm,
                self.group,
                params,
                lambda r: reply_to.respond(r.token, r.text, r.logprobs),
                reply_to.stopping,
            )
            self.ranks = stats_round(self.sm, self.group)
        except PipelineError as e:
            job.emit("error", str(e))
            raise
        return result

    def _run(self) -> None:
        # Ctrl-C and SIGTERM are the main thread's (uvicorn's) to handle: delivered to this
        # thread, they could interrupt a receive of the ring backend mid-collective and
        # leave the ranks out of step until a deadline ends them.
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
        try:
            super()._run()
        except PipelineError as e:
            with self._lock:
                self.failure = str(e)
                self._drain(self.failure)
            if self.on_failure is not None:
                self.on_failure()
