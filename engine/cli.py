"""`expertstream` command line: parses flags and calls the engine, nothing more."""

import argparse
import contextlib
import dataclasses
import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

from engine import kernel_cache
from engine.config import ConfigError, PoolMemoryError
from engine.flags import (
    Parser,
    add_cache_flags,
    config_error_message,
    flag_names,
    positive_int,
    prompt_text,
    seed,
    stream_config,
    temperature,
    top_p,
)
from engine.memory import human_bytes
from engine.safe_io import os_error_text
from engine.serve.flags import add_serve_flags

# What --model takes, in every command's help.
MODEL_HELP = (
    "expert store, mlx-lm MoE model directory, or Hugging Face Hub id org/name[@revision] "
    "(downloaded into the Hugging Face cache: HF_HOME, HF_HUB_OFFLINE, HF_TOKEN apply; a "
    "directory of that name wins)"
)


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Adds "(default: X)" to a flag's help, except for None and False defaults (the
    help says what happens without the flag)."""

    def _get_help_string(self, action):
        if action.default is None or action.default is False or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


@contextlib.contextmanager
def _new_store(dest: str, force: bool):
    """Writing the store `dest`: an existing one, without --force, is the user's mistake."""
    try:
        yield
    except FileExistsError as e:
        if force:
            raise
        raise ValueError(f"{dest} already exists: --force replaces it") from e


@contextlib.contextmanager
def _bar(desc: str):
    """A `progress(done_bytes, total_bytes)` drawn as a bar on stderr where it is a
    terminal (a log gets no bar redrawn in it)."""
    from tqdm import tqdm

    bar = None

    def progress(done, total):
        nonlocal bar
        if not sys.stderr.isatty():
            return
        if bar is None:
            bar = tqdm(total=total, unit="B", unit_scale=True, desc=desc, file=sys.stderr)
        bar.total = total
        bar.n = done
        bar.refresh()

    try:
        yield progress
    finally:
        if bar is not None:
            bar.close()


@contextlib.contextmanager
def _convert_progress(line: str):
    """A convert's `progress(done_bytes, total_bytes)` on stderr: `line` once, with the
    experts' size, then a bar where stderr is a terminal. Both wait for the first report,
    so that an error before it prints alone."""
    said = False
    with _bar("experts") as bar:

        def progress(done, total):
            nonlocal said
            if not said:
                print(f"{line} ({human_bytes(total)} of experts)", file=sys.stderr, flush=True)
                said = True
            bar(done, total)

        yield progress


@contextlib.contextmanager
def _first_use_progress(model):
    """A first use's (`progress`, `announce`) on stderr: one line when the store is about
    to be written, saying what it writes and how big, then a bar where stderr is a
    terminal."""
    from engine.store import IN_PLACE

    def announce(kind, written, experts):
        if kind == IN_PLACE:
            line = (
                f"indexing {model} in place, once per model: reading its "
                f"{human_bytes(experts)} of experts once for their checksums, writing an "
                f"index of at most {human_bytes(written)} (the experts stay in its files)"
            )
        else:
            line = (
                f"converting {model} to an expert store, once per model: writing its "
                f"{human_bytes(experts)} of experts again, as {human_bytes(written)} of "
                "blob files"
            )
        print(line, file=sys.stderr, flush=True)

    with _bar("experts") as progress:
        yield progress, announce


def _download_progress(name: str):
    """A download's `progress(done_bytes, total_bytes)` on stderr: one line at its first
    byte, naming the model and where it goes; huggingface_hub draws its own bars on a
    terminal."""
    from engine.hub import hub_cache_dir

    said = False

    def progress(done, total):
        nonlocal said
        if not said:
            said = True
            print(
                f"downloading {name} from the Hugging Face Hub into {hub_cache_dir()} (its "
                "config, tokenizer and weights; an interrupted download resumes)",
                file=sys.stderr,
                flush=True,
            )

    return progress


def _convert(args) -> int:
    from engine.convert import convert
    from engine.hub import model_dir

    model = model_dir(args.model_dir, _download_progress(args.model_dir))
    line = f"converting {args.model_dir} to {args.store_dir}"
    with _convert_progress(line) as progress, _new_store(args.store_dir, args.force):
        path = convert(model, args.store_dir, force=args.force, progress=progress)
    print(f"wrote {path}")
    return 0


def _load(model: str | Path | None, config):
    """`engine.open_model.open_model` for one process: a model directory's first use
    says what it writes on stderr (`_first_use_progress`), a Hub id's download too
    (`_download_progress`), and without --expert-slots or --expert-memory (every expert),
    a model whose plan exceeds the memory available is streamed with --expert-memory
    auto instead, said on stderr with what auto bought
    (`engine.memory_plan.MemoryPlan.words`); on MLX CUDA with its kernel cache empty, a
    note says the first replies wait for its compiles (`engine.kernel_cache`)."""
    from engine.open_model import open_model
    from engine.resources import default_model_path

    def say_auto(plan) -> None:
        print(
            f"note: every expert ({human_bytes(plan.asked.expert_bytes)}) and the dense "
            f"weights ({human_bytes(plan.asked.dense_bytes)}) exceed the "
            f"{human_bytes(plan.available)} of memory available: streaming with "
            f"{plan.words(flag_names())} (--expert-slots or --expert-memory sets it)",
            file=sys.stderr,
        )

    model = model or default_model_path()
    compiles = kernel_cache.compile_note()
    with _first_use_progress(model) as (progress, announce):
        sm = open_model(
            model,
            config,
            auto_when_too_large=config.expert_slots is None and config.expert_memory is None,
            on_auto=say_auto,
            progress=progress,
            download=_download_progress(str(model)),
            announce=announce,
        )
    if config.expert_memory is not None:
        print(_pool_line(sm), file=sys.stderr)
    if compiles:
        print(f"note: {compiles}", file=sys.stderr)
    return sm


def _copy_stage(args) -> int:
    from engine.pipeline import parse_stage
    from engine.stage_store import copy_stage

    rank, size = parse_stage(args.stage)
    with _new_store(args.dest, args.force):
        path, stage = copy_stage(args.store_dir, args.dest, rank, size, force=args.force)
    print(f"wrote {path}: the store of {stage}")
    return 0


def _check_output(flag: str, path: str | None) -> None:
    """Refuses an output file that could not be written (its folder missing or not
    writable, or a folder itself) before anything is loaded or generated."""
    if path is None:
        return
    folder = Path(path).parent
    if Path(path).is_dir():
        raise ValueError(f"{flag} {path}: is a folder; give a file name")
    if not folder.is_dir():
        raise ValueError(f"{flag} {path}: the folder {folder} does not exist")
    if not os.access(folder, os.W_OK):
        raise ValueError(f"{flag} {path}: the folder {folder} is not writable")


def _check_generate_flags(args) -> None:
    """Refuses flag combinations that cannot work, before anything is loaded or printed
    (single values are refused by their argparse types)."""
    if args.system is not None and args.chat is False:
        raise ValueError("--system is the system prompt of the chat template: not with --no-chat")
    _check_output("--record-trace", args.record_trace)


def _read_prompt(args) -> None:
    """`--prompt -`: the prompt is what comes on stdin (as mlx-lm reads it), without the
    newline that ends it (`echo ... |`).

    Raises:
        ValueError: nothing but whitespace came.
    """
    if args.prompt != "-":
        return
    text = sys.stdin.read().removesuffix("\n")
    if not text.strip():
        raise ValueError("--prompt -: stdin held no text: pipe the prompt in, or give it")
    args.prompt = text


def _figure(value: float | None, spec: str = ".1f") -> str:
    """A tokens/s or rate figure of the stats line, formatted by `spec`; "—" where there is
    none (no decode step, nothing looked up)."""
    return "—" if value is None else format(value, spec)


def _echoes(sm, args) -> bool:
    """Whether the prompt is printed before the reply: where the reply continues it as
    text (--no-chat, or a model without a chat template), not where it answers it."""
    from engine.chat import has_chat_template

    return not args.json and not (args.chat is not False and has_chat_template(sm.tokenizer))


def _generate(args) -> int:
    import mlx.core as mx

    from engine.chat import has_chat_template
    from engine.generate import prompt_tokens

    _check_generate_flags(args)
    if args.pipeline:
        if args.record_trace:
            raise ValueError("--record-trace records one process's layers: not with --pipeline")
        return _generate_pipeline(args)
    _read_prompt(args)
    sm = _load(args.model, stream_config(args))
    asked = args.chat or args.system is not None
    if asked and sm.tokenizer is not None and not has_chat_template(sm.tokenizer):
        dropped = " (without --system)" if args.system is not None else ""
        print(
            f"note: the model has no chat template: the prompt is continued as plain text{dropped}",
            file=sys.stderr,
        )
    prompt = prompt_tokens(sm, args.prompt, args.chat is not False, args.system)
    _check_context(sm, len(prompt), args.max_tokens)  # before the prompt is echoed
    if args.seed is not None:
        mx.random.seed(args.seed)
    if args.record_trace:
        from engine.trace import record

        with record(sm) as recorder:
            code = _generate_with(sm, prompt, args)
        path = recorder.trace(Path(args.record_trace).stem).save(args.record_trace)
        print(f"wrote routing trace {path}", file=sys.stderr)
        return code
    return _generate_with(sm, prompt, args)


def _check_context(sm, prompt_tokens: int, max_tokens: int) -> None:
    """`engine.generate.check_context` in this command's terms: a ValueError naming
    --max-tokens and the most that fits, or that the prompt alone is too long."""
    from engine.generate import ContextError, check_context

    try:
        check_context(sm, prompt_tokens, max_tokens)
    except ContextError as e:
        room = e.limit - e.prompt_tokens
        fix = f"give --max-tokens {room} or less" if room >= 1 else "shorten the prompt"
        raise ValueError(
            f"the prompt ({e.prompt_tokens} tokens) + --max-tokens ({e.max_tokens}) exceeds "
            f"the model's context of {e.limit} tokens: {fix}"
        ) from None


def _reply(sm, prompt: list[int], args, show: bool, stop=None):
    """`engine.generate.generate` of `prompt` under the flags; with `show`, the reply's
    text goes to stdout as it comes and its line is ended, Ctrl+C included (the shell's
    prompt then starts on a line of its own). `stop`: the reply's stop hook."""
    from engine.generate import generate

    on_response = (lambda r: print(r.text, end="", flush=True)) if show else None
    try:
        return generate(
            sm, prompt, args.max_tokens, args.temp, args.top_p, on_response=on_response, stop=stop
        )
    finally:
        if show:
            print(flush=True)


@contextlib.contextmanager
def _ctrl_c_stops():
    """Within: the first Ctrl+C (SIGINT) sets the event it yields, which the reply polls
    as its stop hook (it ends at the next MoE layer, its figures whole); a second one
    interrupts as Ctrl+C does anywhere else."""
    stopped = threading.Event()

    def on_sigint(signum, frame) -> None:
        if stopped.is_set():
            raise KeyboardInterrupt
        stopped.set()

    previous = signal.signal(signal.SIGINT, on_sigint)
    try:
        yield stopped
    finally:
        signal.signal(signal.SIGINT, previous)


def _pool(sm) -> dict:
    """What the budget bought, for --json and the --expert-memory line: the real slots
    per MoE layer, the bytes they hold, and the bytes of every pool (with side and
    scratch rows), from the load's memory plan (a pipeline stage's: its layers only)."""
    from engine.cache import pool_bytes

    plan = sm.plan
    memory = sm.config.expert_memory
    return {
        "expert_memory": None if memory is None else str(memory),
        "experts": sm.store.manifest.num_experts,
        "slots_per_layer": list(plan.real_slots),
        "slot_bytes": sum(n * r for n, r in zip(plan.real_slots, plan.record_bytes, strict=True)),
        "pool_bytes": pool_bytes(sm.cache),
    }


def _pool_line(sm) -> str:
    """One line on what --expert-memory bought, with the unit its size was read in."""
    from engine.config import AUTO_MEMORY_FRACTION, size_words

    pool = _pool(sm)
    memory = sm.config.expert_memory
    asked = (
        f"auto ({AUTO_MEMORY_FRACTION:.0%} of the memory available)"
        if memory == "auto"
        else size_words(memory)
    )
    lo, hi = min(pool["slots_per_layer"]), max(pool["slots_per_layer"])
    slots = str(lo) if lo == hi else f"{lo}-{hi}"
    return (
        f"--expert-memory {asked}: {slots} slots per MoE layer of {pool['experts']} experts, "
        f"{human_bytes(pool['slot_bytes'])} of expert slots ({human_bytes(pool['pool_bytes'])} "
        "of pools with the side and scratch rows)"
    )


def _everything_fits(sm) -> bool:
    """Whether every MoE layer's real region holds every expert (read whole at load:
    nothing streams)."""
    return min(sm.plan.real_slots) >= sm.store.manifest.num_experts


def _generate_with(sm, prompt, args) -> int:
    if args.json:
        with _ctrl_c_stops() as interrupted:
            result = _reply(sm, prompt, args, show=False, stop=interrupted.is_set)
        print(
            json.dumps(
                {
                    "text": result.text,
                    "tokens": result.tokens,
                    "finish_reason": "interrupted" if result.stopped else result.finish_reason,
                    "stats": result.stats(),
                    "pool": _pool(sm),
                }
            )
        )
        return 130 if result.stopped else 0  # 128 + SIGINT, as a shell reports Ctrl+C
    if _echoes(sm, args):
        print(args.prompt, end="", flush=True)
    result = _reply(sm, prompt, args, show=True)  # its line ends before the figures
    s = result.stats()
    print(
        f"--\nhits {s['hits']}  misses {s['misses']}  hit rate {_figure(s['hit_rate'], '.1%')}  "
        f"read {human_bytes(s['bytes_read'])}  side hits {s['side_hits']}  "
        f"prefetch used/issued {s['prefetch_used']}/{s['prefetch_issued']}\n"
        f"prefill {_figure(s['prefill_tps'])} tok/s ({s['prompt_tokens']} tokens)  "
        f"decode {_figure(s['decode_tps'])} tok/s ({s['generated_tokens']} tokens)  "
        f"peak memory {human_bytes(s['peak_memory_bytes'])}",
        file=sys.stderr,
    )
    if _everything_fits(sm):
        print(
            f"every expert is in memory ({sm.store.manifest.num_experts} slots per MoE layer, "
            "read at load): nothing streams from disk; --expert-slots or --expert-memory "
            "gives them less",
            file=sys.stderr,
        )
    return 0


def _generate_pipeline(args) -> int:
    """`generate --pipeline`: this process runs one stage (engine.pipeline); every rank
    generates the same tokens, rank 0 prints them and every rank's cache figures."""
    import mlx.core as mx

    from engine import pipeline
    from engine.generate import prompt_tokens
    from engine.model import load_stage
    from engine.store import layer_range

    group = pipeline.init_group()
    rank = group.rank()
    config = stream_config(args)
    sm = load_stage(args.model, config, group, strict=True)  # each rank's plan refuses its own
    prompt, error = None, None
    if rank == 0:  # rank 0 tokenizes; the others take its ids
        try:
            _read_prompt(args)
            prompt = prompt_tokens(sm, args.prompt, args.chat is not False, args.system)
            _check_context(sm, len(prompt), args.max_tokens)
        except ValueError as e:
            error = str(e)
    pipeline.agree(error, group)
    # One seed for every rank: each samples from the same logits, and the first stage
    # embeds the token it sampled itself.
    chosen = int.from_bytes(os.urandom(4)) if args.seed is None else args.seed
    prompt, chosen = pipeline.gather_json([prompt, chosen], group)[0]
    mx.random.seed(chosen)
    if rank == 0 and _echoes(sm, args):
        print(args.prompt, end="", flush=True)
    show = rank == 0 and not args.json
    try:
        result = _reply(sm, prompt, args, show)
    except RuntimeError as e:  # MLX's distributed backends raise RuntimeError
        raise pipeline.lost(rank, e) from None
    ranks = pipeline.gather_json(
        {"layers": [sm.stage.start, sm.stage.end], **result.stats()}, group
    )
    if rank != 0:
        return 0
    stats = pipeline.combine_stats(ranks)
    if args.json:
        print(json.dumps({"text": result.text, "tokens": result.tokens, "stats": stats}))
        return 0
    print("--", file=sys.stderr)
    for r, s in enumerate(ranks):
        print(
            f"rank {r} ({layer_range(range(*s['layers']))}): hits {s['hits']}  "
            f"misses {s['misses']}  read {human_bytes(s['bytes_read'])}  "
            f"peak memory {human_bytes(s['peak_memory_bytes'])}",
            file=sys.stderr,
        )
    print(
        f"all ranks: hit rate {_figure(stats['hit_rate'], '.1%')}  "
        f"read {human_bytes(stats['bytes_read'])}  prefill {_figure(stats['prefill_tps'])} tok/s  "
        f"decode {_figure(stats['decode_tps'])} tok/s "
        f"({stats['generated_tokens']} tokens)",
        file=sys.stderr,
    )
    return 0


def _serve(args) -> int:
    try:
        import uvicorn  # noqa: F401  (the serve extra: refused here in one line)

        from engine.serve.server import GenerationThread, bind, build_app, url, uvicorn_server
    except ImportError as e:
        raise ValueError(
            f"serve needs the 'serve' extra ({e.name} is missing): "
            "pip install 'expertstream[serve]'"
        ) from None
    from engine.hub import is_hub_id
    from engine.resources import default_model_path

    if args.record_trace < 0:
        raise ValueError(f"--record-trace {args.record_trace}: must be >= 0 tokens")
    config = stream_config(args)
    model = Path(args.model) if args.model else default_model_path()
    if args.pipeline:
        if args.record_trace:
            raise ValueError("--record-trace records one process's layers: not with --pipeline")
        from engine import pipeline
        from engine.serve.pipeline import PipelineGenerationThread, follow

        group = pipeline.init_group()
        model = Path(str(model).replace("{rank}", str(group.rank())))
        if group.rank() != 0:
            print(f"loading {model}", file=sys.stderr)
            return follow(model, config, group)
    # The address is taken before the model loads: a host or port that cannot work is
    # refused at once, and nothing else can take the port while the model loads.
    with bind(args.host, args.port) as sock:
        print(f"loading {model}", file=sys.stderr)
        if args.pipeline:
            engine = PipelineGenerationThread(model, config, group, args.max_queue)
        else:
            # The acquire kernels' requests are sized for a step of the whole batch.
            config = dataclasses.replace(config, max_batch=args.max_batch)
            engine = GenerationThread(
                lambda: _load(model, config),
                args.max_queue,
                args.record_trace,
                args.prompt_cache,
                args.max_batch,
                args.prefill_step_size,
            )
        engine.start()
        if args.host not in ("127.0.0.1", "localhost", "::1"):
            print(
                f"note: serving on {args.host}: anyone who can reach port "
                f"{sock.getsockname()[1]} can use the model (no authentication)",
                file=sys.stderr,
            )
        # a Hub id names the model as clients of mlx-lm's server ask for it
        name = args.model if args.model and is_hub_id(args.model) else model.name
        app = build_app(engine, name, args.max_tokens)
        server = uvicorn_server(
            app,
            engine,
            args.log_level,
            # said once uvicorn listens and handles Ctrl+C (a Ctrl+C before could hang it)
            on_start=lambda: print(f"serving on {url(sock)} (Ctrl+C stops)", file=sys.stderr),
        )
        if args.pipeline:  # a failed rank stops the server; the command fails with its error
            engine.on_failure = lambda: setattr(server, "should_exit", True)
            server.should_exit = engine.failure is not None
        code = 0
        try:
            server.run(sockets=[sock])
        except KeyboardInterrupt:  # uvicorn raises the Ctrl+C it handled once it stopped
            code = 130  # 128 + SIGINT, as a shell reports it
    if getattr(engine, "failure", None) is not None:
        pipeline.exit_now(engine.failure)
    # The generation thread has ended (the app's lifespan closed the engine), but MLX
    # frees its thread-local state as the OS thread exits, which can be after Python's
    # join returned: an interpreter teardown racing it ends in std::terminate. Nothing is
    # left to tear down but the standard streams.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _cache(args) -> int:
    from engine.store_cache import age, list_stores, remove_store, store_cache_dir

    if args.action == "rm":
        for name in args.stores:
            store, snapshot = remove_store(name, download=args.download)
            print(f"removed {store}")
            if snapshot is not None and args.download:
                print(f"removed {snapshot} (the download, from the Hugging Face cache)")
            elif snapshot is not None:
                print(
                    f"kept its download {snapshot}: `expertstream cache rm --download "
                    f"{name}` would have removed it too (`hf cache` manages that cache)"
                )
        return 0
    stores = list_stores()
    if not stores:
        print(f"no stores in {store_cache_dir()}")
        return 0
    rows = [
        (
            st.path.name,
            st.model,
            st.kind,
            human_bytes(st.size_bytes),
            human_bytes(st.download_bytes) if st.download is not None else "-",
            age(st.last_used),
        )
        for st in stores
    ]
    head = ("store", "model", "kind", "store size", "download", "last use")
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(3)]
    for r in [head, *rows]:
        print(
            f"{r[0]:<{widths[0]}}  {r[1]:<{widths[1]}}  {r[2]:<{widths[2]}}  "
            f"{r[3]:>10}  {r[4]:>10}  {r[5]}"
        )
    print(
        f"in {store_cache_dir()}; `expertstream cache rm STORE` deletes a store, with "
        "--download its model's download too"
    )
    return 0


def _bench(argv: list[str]) -> int:
    """Runs `python -m bench ARGV` from the source checkout this engine belongs to: the
    benchmarks are its top-level `bench` package, never shipped (nor imported by the
    engine); an installed wheel or the bundle has none, and says so."""
    root = Path(__file__).resolve().parents[1]
    if not ((root / "pyproject.toml").is_file() and (root / "bench" / "__main__.py").is_file()):
        print(
            "expertstream bench: error: the benchmarks are not installed with the package; run "
            "`expertstream bench` from a source checkout (git clone, then "
            "pip install -e '.[bench]')",
            file=sys.stderr,
        )
        return 2
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), env.get("PYTHONPATH")]))
    return subprocess.call([sys.executable, "-m", "bench", *argv], env=env)


def _advise(args) -> int:
    from engine.advisor import Budget, advice_for, check_png, policy_of, save_png, table
    from engine.memory_plan import check_real_slots, plan_memory
    from engine.model import resolve_store
    from engine.trace import load_trace

    _check_output("--save-trace", args.save_trace)
    _check_output("--png", args.png)
    if args.png:
        check_png()  # before the replay, not after the table is printed
    if args.trace is None and args.prompt_file is None:
        raise ValueError("give --trace FILE.npz, or --prompt-file FILE to record a fresh trace")
    if args.trace is not None and args.prompt_file is not None:
        raise ValueError("--trace and --prompt-file exclude each other: replay one trace")
    config = stream_config(args)
    measured, plan = None, None
    if args.prompt_file is not None:
        trace, measured, store, plan = _record_for_advice(args, config)
    else:
        trace = load_trace(args.trace)
        store = resolve_store(args.model) if args.model else None
    if store is not None:
        m = store.manifest
        if (len(m.layers), m.num_experts, m.top_k) != trace.shape:
            raise ValueError(
                f"--model {store.path}: {len(m.layers)} MoE layers x {m.num_experts} experts "
                f"(top-{m.top_k}), but the trace is {trace.num_layers} x "
                f"{trace.num_experts} (top-{trace.top_k})"
            )
    records = [spec.record_bytes for spec in store.manifest.layers] if store else []
    check_real_slots(config, trace.top_k, records)  # as a load's plan refuses them
    # The budget the advice starts from: the flags', else the one the trace was recorded
    # at (the real slots per layer it carries), else every expert.
    if config.expert_slots is not None:
        current, source = config.expert_slots, "--expert-slots"
    elif trace.real_slots is not None and config.expert_memory is None:
        current, source = round(float(trace.real_slots.mean())), "as recorded"
    else:
        current, source = trace.num_experts, "every expert"
    if store is not None:  # the plan of a budget estimated, not loaded: nothing refused
        plan = plan or plan_memory(store, config, check=False)
    if config.expert_memory is not None and plan is not None:
        current, source = plan.mean_slots, "--expert-memory"  # slots by record size
    if not trace.top_k <= current <= trace.num_experts:
        raise ValueError(
            f"--expert-slots {current}: must be in [{trace.top_k}, {trace.num_experts}]"
        )
    policy = policy_of(config.policy, config.decay_every, config.autopin_frac)
    print(
        f"replaying {trace.num_tokens} tokens ({trace.name}) under {policy}, LRU and Belady's "
        f"MIN; now: {current} slots per layer ({source})",
        file=sys.stderr,
    )
    budget = Budget.of(plan) if plan is not None else None
    curve, advice = advice_for(trace, config, current, budget, measured)
    if args.json:
        print(
            json.dumps(
                {"curve": curve.to_dict(), "advice": {"slots": advice.slots, "line": advice.line}}
            )
        )
    else:
        print(table(curve))
        print(
            f"hit rates replayed: the trace's {trace.num_tokens} tokens one at a time, the "
            "prompt's included, from an empty cache, its first reads counted as misses (1 - "
            "expert reads / lookups; Belady's: hits / lookups); generate counts from the "
            "first token, after the load: 100% at every expert, which the load reads whole"
        )
        if measured is not None:
            m = measured
            print(
                f"measured at {current} slots: decode {m.decode_tps:.1f} tok/s over "
                f"{m.decode_tokens} tokens, reads {human_bytes(m.read_Bps)}/s; hit rate "
                f"{_figure(m.decode_hit_rate, '.1%')} over the decode, {m.hit_rate:.1%} with "
                "the prefill (a forward of many prompt tokens looks up each of their "
                "distinct experts once, into a cold cache); side hits count as hits; tok/s at "
                "other budgets: estimated"
            )
        print(advice.line)
    if args.png:
        save_png(curve, advice, args.png)
        print(f"wrote {args.png}", file=sys.stderr)
    return 0


def _record_for_advice(args, config):
    """Generates from --prompt-file with the cache flags, recording the routing; returns
    the trace, the measured figures (the hit rate over the reply and over its decode),
    the store and the load's memory plan (`StreamedModel.plan`: the real slots per MoE
    layer its config gives, without the side rows a layer no layer prefetches for holds
    as slots)."""
    from engine.advisor import Measured
    from engine.generate import cache_delta, generate, prompt_tokens
    from engine.trace import record

    try:
        text = Path(args.prompt_file).read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"--prompt-file {args.prompt_file}: cannot read it ({e})") from None
    if not text.strip():
        raise ValueError(f"--prompt-file {args.prompt_file} is empty")
    sm = _load(args.model, config)
    first = {}  # the counters at the first token: the decode's start

    def on_response(_response) -> None:
        first or first.update(sm.snapshot().totals())

    with record(sm) as recorder:
        result = generate(
            sm, prompt_tokens(sm, text, False), args.max_tokens, on_response=on_response
        )
    decode = cache_delta(first, sm.snapshot().totals())
    trace = recorder.trace(Path(args.prompt_file).stem)
    if args.save_trace:
        print(f"wrote routing trace {trace.save(args.save_trace)}", file=sys.stderr)
    measured = Measured.of(
        result.decode_tps, len(result.tokens), result.cache, decode_hit_rate=decode["hit_rate"]
    )
    return trace, measured, sm.store, sm.plan


def _add_pipeline_flag(p: argparse.ArgumentParser, rank0: str) -> None:
    p.add_argument(
        "--pipeline",
        action="store_true",
        help=f"run one pipeline stage per process (start every rank with mlx.launch; {rank0}); "
        "{rank} in --model becomes the rank, for a store per rank on one disk",
    )


def _add_model_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help=f"{MODEL_HELP} (default: the embedded model)")


def _version() -> str:
    """The installed package's version ("unknown" when run from a tree not installed)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("expertstream")
    except PackageNotFoundError:
        return "unknown"


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="expertstream",
        description="Run Mixture-of-Experts models with experts streamed from disk.",
    )
    parser.add_argument("--version", action="version", version=f"expertstream {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser(
        "convert",
        help="write the blob store of an mlx-lm MoE model (every expert copied into blob files)",
        formatter_class=_HelpFormatter,
    )
    p.add_argument(
        "model_dir",
        help="mlx-lm MoE model directory (config.json, *.safetensors), or a Hugging Face "
        "Hub id org/name[@revision] (downloaded into the Hugging Face cache)",
    )
    p.add_argument("store_dir", help="where to write the expert store (a new directory)")
    p.add_argument("--force", action="store_true", help="replace an existing store")
    p.set_defaults(func=_convert, command_parser=p)

    p = sub.add_parser(
        "copy-stage",
        help="write the part of a store that one pipeline stage's host needs",
        formatter_class=_HelpFormatter,
    )
    p.add_argument("store_dir", help="a whole expert store")
    p.add_argument("dest", help="the stage's store to create (a new directory)")
    p.add_argument(
        "--stage",
        required=True,
        metavar="RANK/RANKS",
        help="the stage, e.g. 1/2: rank 1 of a 2-rank pipeline (mlx.launch's rank order)",
    )
    p.add_argument("--force", action="store_true", help="replace an existing store")
    p.set_defaults(func=_copy_stage, command_parser=p)

    p = sub.add_parser(
        "generate", help="generate text with streamed experts", formatter_class=_HelpFormatter
    )
    _add_model_flag(p)
    p.add_argument(
        "--prompt",
        "-p",
        type=prompt_text,
        default="Once upon a time",
        help="the message (the text to continue, without a chat template); '-' reads it "
        "from stdin, without its last newline",
    )
    p.add_argument(
        "--max-tokens", "-m", type=positive_int, default=64, help="longest reply, tokens (>= 1)"
    )
    p.add_argument(
        "--temp", type=temperature, default=0.0, help="sampling temperature (>= 0; 0: greedy)"
    )
    p.add_argument(
        "--top-p",
        type=top_p,
        default=1.0,
        help="nucleus sampling: keep the most likely tokens up to this probability (1: all)",
    )
    p.add_argument(
        "--seed",
        type=seed,
        help="random seed of the sampling (with --temp > 0: the same seed, the same reply; "
        "default: a new one each run)",
    )
    p.add_argument(
        "--chat",
        action=argparse.BooleanOptionalAction,
        help="apply the model's chat template, as mlx-lm does by default: the reply answers "
        "the prompt, which is not printed before it (default: where the tokenizer has a "
        "template; without one the prompt is continued as text and printed, said on stderr "
        "when --chat or --system is given); --no-chat continues the raw prompt",
    )
    p.add_argument(
        "--ignore-chat-template",
        dest="chat",
        action="store_false",
        default=None,  # --chat's: where the tokenizer has a template
        help="mlx-lm's spelling of --no-chat",
    )
    p.add_argument(
        "--system", help="system prompt of the chat template (models with one; not with --no-chat)"
    )
    p.add_argument(
        "--json",
        action="store_true",
        help="print one JSON object: text, tokens and this reply's stats (its own cache "
        "counts, not totals since load as the server's /v1/stats; decode_tps null for "
        "one token)",
    )
    _add_pipeline_flag(p, "rank 0 prints")
    p.add_argument(
        "--record-trace",
        metavar="FILE.npz",
        help="write the routed expert ids of every MoE layer call (engine.trace)",
    )
    add_cache_flags(p)
    p.set_defaults(func=_generate, command_parser=p)

    p = sub.add_parser(
        "serve",
        help="serve the model over an OpenAI-compatible HTTP API",
        formatter_class=_HelpFormatter,
    )
    _add_model_flag(p)
    add_serve_flags(p)
    _add_pipeline_flag(p, "rank 0 serves, the other ranks follow it")
    add_cache_flags(p)
    p.set_defaults(func=_serve, command_parser=p)

    p = sub.add_parser(
        "advise",
        help="what more (or less) expert memory would buy: replay a routing trace at a "
        "sweep of budgets",
        formatter_class=_HelpFormatter,
    )
    p.add_argument("--trace", metavar="FILE.npz", help="a recorded routing trace (or .json)")
    p.add_argument(
        "--model",
        help=f"{MODEL_HELP}: gives the budgets in bytes; with --prompt-file, the model to "
        "record (default: the embedded model)",
    )
    p.add_argument(
        "--prompt-file",
        metavar="FILE",
        help="record a fresh trace: generate from this text with the cache flags, and "
        "estimate tokens/s from what it measures",
    )
    p.add_argument(
        "--max-tokens", type=positive_int, default=256, help="tokens --prompt-file generates"
    )
    p.add_argument("--save-trace", metavar="FILE.npz", help="write the trace --prompt-file records")
    p.add_argument(
        "--png", metavar="FILE.png", help="save the plot (needs matplotlib, the 'bench' extra)"
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    add_cache_flags(p)
    p.set_defaults(func=_advise, command_parser=p)

    p = sub.add_parser(
        "cache",
        help="list or remove the stores written on the first use of model directories",
    )
    actions = p.add_subparsers(
        dest="action", required=True, metavar="{list,rm}", help="list the stores, or rm some"
    )
    listing = actions.add_parser("list", help="list the stores, their models, sizes and last use")
    listing.set_defaults(command_parser=listing)
    rm = actions.add_parser("rm", help="remove stores")
    rm.add_argument("stores", nargs="+", metavar="STORE", help="stores to remove (names as listed)")
    rm.add_argument(
        "--download",
        action="store_true",
        help="also remove the model's download from the Hugging Face cache (that revision)",
    )
    rm.set_defaults(command_parser=rm)
    p.set_defaults(func=_cache, command_parser=p)

    # Listed for --help only: main() hands `bench ...` to `python -m bench` unparsed.
    sub.add_parser(
        "bench",
        add_help=False,
        help="benchmarks: figures and ratios against resident mlx-lm, from a source checkout "
        "(expertstream bench --help)",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `expertstream` console script; returns the exit code. Every
    refusal is one line on stderr, "expertstream SUBCOMMAND: error: ...", argparse's
    ending with where that subcommand's help is."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"]:
        return _bench(argv[1:])
    args, unknown = build_parser().parse_known_args(argv)
    if unknown:  # argparse would blame the top-level parser and point to its help
        args.command_parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    prog = args.command_parser.prog
    try:
        code = args.func(args)
        sys.stdout.flush()  # a closed pipe raises here, not at the interpreter's exit
        return code
    except BrokenPipeError:
        # Python's "Note on SIGPIPE": the reader went away (`| head`); stdout goes to
        # devnull so that the flush at exit raises nothing more.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except KeyboardInterrupt:  # Ctrl+C: how a server is stopped, and a reply cut short
        return 130  # 128 + SIGINT, as a shell reports it
    except (ValueError, OSError, KeyError) as e:
        print(f"{prog}: error: {_error_text(e, args)}", file=sys.stderr)
        return 2
    except RuntimeError as e:
        from engine.pipeline import PipelineError  # imports MLX: only when one is raised

        if not isinstance(e, PipelineError):
            raise
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2


def _error_text(e: Exception, args: argparse.Namespace) -> str:
    """The one line of a refused command: a ConfigError or PoolMemoryError in flag
    names, an OSError without its "[Errno N]" (the file and the reason), anything else
    as it is."""
    if isinstance(e, ConfigError):
        return config_error_message(e, args)
    if isinstance(e, PoolMemoryError):
        return e.in_words(flag_names())
    if isinstance(e, OSError):
        return os_error_text(e)
    return str(e)


if __name__ == "__main__":
    sys.exit(main())
