"""The command line as a first try meets it: what it prints, what it refuses (naming the
flag), its help, and the store cache (`expertstream cache`)."""

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import zipfile
from pathlib import Path

import pytest

from engine.cli import build_parser, main
from engine.memory import human_bytes
from engine.model import resolve_store
from engine.resources import default_model_path
from engine.store import IN_PLACE
from engine.store_cache import FIRST_USE, store_cache_dir
from engine.trace import load_trace, local_trace

from factories import CHAT_TEMPLATE, write_tokenizer


@pytest.fixture(scope="module", autouse=True)
def _embedded_store():
    """The embedded model converted before any test: a test run on its own (a fresh store
    cache) met the first use's "converting ..." line first on stderr, and failed."""
    resolve_store(default_model_path())


def run(capfd, *argv) -> tuple[int, str, str]:
    """Exit code, stdout and stderr of `expertstream ARGV` (argparse's refusals too)."""
    try:
        code = main(list(argv))
    except SystemExit as e:
        code = e.code
    out, err = capfd.readouterr()
    return code, out, err


def assert_refused(code: int, out: str, err: str, message: str) -> None:
    """Refused with exit code 2 and one line on stderr that says `message`."""
    assert code == 2 and out == "", (code, out)
    assert err.startswith("expertstream") and ": error: " in err, err
    assert message in err and err.count("\n") == 1, err  # one line: no usage, no dump


def test_echoed_prompt_and_reply_keep_their_space(capfd):
    code, out, _ = run(capfd, "generate", "--prompt", "Once upon a", "--max-tokens", "6")
    assert code == 0 and out.startswith("Once upon a time,"), out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--max-tokens", "-1"], "argument --max-tokens: must be an integer >= 1, got '-1'"),
        (["--max-tokens", "-5"], "argument --max-tokens: must be an integer >= 1, got '-5'"),
        (["--max-tokens", "0"], "argument --max-tokens: must be an integer >= 1, got '0'"),
        (["--prompt", ""], "argument --prompt: is empty"),
        (["--prompt", "  "], "argument --prompt: is empty"),
        (["--top-p", "0"], "argument --top-p: must be in (0, 1], got '0'"),
        (["--top-p", "nan"], "argument --top-p: must be in (0, 1], got 'nan'"),
        (["--temp", "-1"], "argument --temp: must be a finite number >= 0 (0: greedy), got '-1'"),
        (["--temp", "nan"], "argument --temp: must be a finite number >= 0 (0: greedy), got 'nan'"),
        (["--temp", "inf"], "argument --temp: must be a finite number >= 0 (0: greedy), got 'inf'"),
        (["--expert-slots", "0"], "--expert-slots 0: must be >= 1"),
        (["--reader-threads", "0"], "--reader-threads 0: must be in [1, 256]"),
        (["--reader-threads", "100000"], "--reader-threads 100000: must be in [1, 256]"),
        (["--prefetch"], "--prefetch needs side-region slots to fill: add --side-slots N"),
        (["--side-slots", "4", "--no-prefetch"], "--side-slots 4 with --no-prefetch: only"),
        (["--prompt", "cat " * 5000], "the prompt (5003 tokens) + --max-tokens (64) exceeds"),
        (
            ["--expert-slots", "8", "--expert-memory", "50MiB"],
            "error: --expert-slots and --expert-memory are both given: give one of them",
        ),
        (["--expert-memory", "0"], "argument --expert-memory: must be > 0, got '0'"),
        (["--expert-memory=-5MiB"], "argument --expert-memory: must be > 0, got '-5MiB'"),
        (
            ["--expert-memory", "1KiB"],
            "error: --expert-memory 1KiB: 1.0 kB is below the 2.0 MB that top-k = 4 experts",
        ),
        # one rule for both ways of sizing the real regions: at least top-k experts
        (["--expert-slots", "3"], "--expert-slots 3: must be >= 4, the experts each token is"),
        (["--seed", "-1"], "argument --seed: must be an integer in [0, 2**64 - 1], got '-1'"),
        # the embedded model has 32 experts per MoE layer
        (["--expert-slots", "33"], "--expert-slots 33: must be <= 32, the model's experts"),
        (["--side-slots", "1000"], "--side-slots 1000: must be <= 32, the model's experts"),
        (["--scratch-slots", "1000"], "--scratch-slots 1000: must be <= 32, the model's experts"),
        (
            ["--no-chat", "--system", "Be brief."],
            "--system is the system prompt of the chat template: not with --no-chat",
        ),
        # a negative size is a value refused by its flag, not argparse's "expected one
        # argument"
        (["--expert-memory", "-5GiB"], "argument --expert-memory: must be > 0, got '-5GiB'"),
        (
            ["--record-trace", "/nonexistent/x.npz"],
            "--record-trace /nonexistent/x.npz: the folder /nonexistent does not exist",
        ),
        (["--record-trace", "/tmp"], "--record-trace /tmp: is a folder; give a file name"),
    ],
)
def test_refused_before_anything_is_printed(capfd, argv, message):
    assert_refused(*run(capfd, "generate", *argv), message)


def test_a_model_larger_than_memory_streams_by_default(capfd, monkeypatch):
    # the embedded model: 20 MB of expert pools (every expert, read buffers included: a
    # record's read each, larger in place) and 1.7 MB of dense weights
    from engine import memory_plan
    from engine.config import StreamConfig

    monkeypatch.setattr(memory_plan, "available_bytes", lambda: 15_000_000)
    store = resolve_store(default_model_path())
    plan = memory_plan.plan_memory(store, StreamConfig(), fit_default=True)
    asked = plan.asked
    assert 19_500_000 < asked.expert_bytes < 21_000_000 and plan.fell_back
    assert 1_650_000 < asked.dense_bytes < 1_750_000 and 14 <= min(plan.real_slots) <= 16
    code, out, err = run(capfd, "generate", "--max-tokens", "4", "--json")
    assert code == 0, err
    note = (
        f"\nnote: every expert ({human_bytes(asked.expert_bytes)}) and the dense weights "
        f"({human_bytes(asked.dense_bytes)}) exceed the 15.0 MB"
    )
    assert note in "\n" + err, err
    bought = f"{plan.slots_text()} slots per MoE layer, pools {human_bytes(plan.pool_bytes)}"
    assert f"streaming with --expert-memory auto: {bought}" in err, err
    stats = json.loads(out)["stats"]
    assert stats["misses"] > 0  # streamed: 7.5 MB of real slots
    assert stats["prefetch_issued"] == 0 and stats["prefetch_accuracy"] is None  # not 0.0
    # every expert asked for is refused, not streamed
    code, out, err = run(capfd, "generate", "--expert-slots", "32")
    assert_refused(code, out, err, f"the expert pools need {human_bytes(asked.pool_bytes)}")


def test_a_store_setting_from_the_environment_names_the_variable(capfd, monkeypatch):
    monkeypatch.setenv("PREFILL_CHUNK", "1000")
    code, out, err = run(capfd, "generate")
    assert_refused(code, out, err, "environment variable PREFILL_CHUNK=1000: must be <= 32")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["cache"], "the following arguments are required: {list,rm}"),
        (["cache", "rm"], "the following arguments are required: STORE"),
        (["cache", "list", "foo"], "unrecognized arguments: foo"),
        (["serve", "--port", "70000"], "argument --port: must be a TCP port in [0, 65535]"),
        (["serve", "--port", "-1"], "argument --port: must be a TCP port in [0, 65535]"),
        (["serve", "--max-queue", "0"], "argument --max-queue: must be an integer >= 1"),
        (
            ["serve", "--prompt-cache", "-5"],
            "argument --prompt-cache: must be a size (e.g. 1GiB) or 0 (off), got '-5'",
        ),
        (["advise", "--max-tokens", "0"], "argument --max-tokens: must be an integer >= 1"),
        (
            ["advise", "--trace", "t.npz", "--save-trace", "/nonexistent/t.npz"],
            "--save-trace /nonexistent/t.npz: the folder /nonexistent does not exist",
        ),
    ],
)
def test_other_commands_refuse_in_one_line(capfd, argv, message):
    assert_refused(*run(capfd, *argv), message)


def test_serve_refuses_a_host_or_port_before_loading(capfd):
    code, out, err = run(capfd, "serve", "--host", "999.1.1.1")
    assert_refused(code, out, err, "--host 999.1.1.1: not an address of this machine")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        code, out, err = run(capfd, "serve", "--port", port)
    assert_refused(code, out, err, f"--port {port}: already in use on 127.0.0.1")
    assert "loading" not in err  # refused before the model loads


def test_ctrl_c_stops_the_server_without_a_traceback():
    p = subprocess.Popen(
        [sys.executable, "-m", "engine.cli", "serve", "--port", "0", "--log-level", "warning"],
        stderr=subprocess.PIPE,
        text=True,
    )
    lines = [p.stderr.readline(), p.stderr.readline()]
    assert lines[0].startswith("loading ") and lines[1].startswith("serving on http://127.0.0.1:")
    p.send_signal(signal.SIGINT)
    # 130 as a shell reports Ctrl+C; 0 when uvicorn's graceful stop swallows it (seen once
    # in a full-suite run, cause not found): either way stopped, without a traceback
    assert p.wait(60) in (130, 0) and "Traceback" not in p.stderr.read()


def test_ctrl_c_cuts_the_reply_in_progress():
    """uvicorn waits for open replies before it stops: without a cancel at the Ctrl+C,
    the server stopped only once a long reply had run to its max_tokens."""
    p = subprocess.Popen(
        [sys.executable, "-m", "engine.cli", "serve", "--port", "0", "--log-level", "warning"],
        stderr=subprocess.PIPE,
        text=True,
    )
    p.stderr.readline()
    address = p.stderr.readline().split()[2]  # "serving on http://127.0.0.1:PORT ..."
    request = urllib.request.Request(
        f"{address}/v1/completions",
        json.dumps({"prompt": "Once upon a time", "max_tokens": 400, "stream": True}).encode(),
        {"Content-Type": "application/json"},
    )
    chunks, errors = [], []
    with urllib.request.urlopen(request, timeout=60) as reply:
        for line in reply:
            if line.startswith(b"data: {"):
                event = json.loads(line[6:])
                if "error" in event:
                    errors.append(event["error"]["message"])
                    continue
                chunks.append(event["choices"][0])
                if len(chunks) == 2:
                    p.send_signal(signal.SIGINT)
    rc, err = p.wait(60), p.stderr.read()
    assert rc in (130, 0) and "Traceback" not in err, (rc, err[-3000:])  # the server's words
    assert len(chunks) < 100, len(chunks)  # ended at the next MoE layer, not after 400
    # cut short: no finish reason, and the stream's last event says why
    assert all(c["finish_reason"] is None for c in chunks)
    [message] = errors
    assert message.startswith("the server is shutting down: the reply was cut after "), message


def test_a_cut_trace_file_is_named(capfd, tmp_path):
    whole = tmp_path / "whole.npz"
    local_trace(20, 4, 8, 2, 0.5).save(whole)
    cut = tmp_path / "cut.npz"
    cut.write_bytes(whole.read_bytes()[:-100])
    code, out, err = run(capfd, "advise", "--trace", str(cut))
    assert_refused(code, out, err, f"{cut}: not a routing trace (.npz written by --record-trace")
    assert "cut short" in err
    with zipfile.ZipFile(cut := tmp_path / "foreign.npz", "w") as z:
        z.writestr("other.npy", b"")
    with pytest.raises(ValueError, match=r"foreign\.npz: not a routing trace .*: ids is not"):
        load_trace(cut)
    with pytest.raises(ValueError, match=r"missing\.npz: cannot read it \(No such file"):
        load_trace(tmp_path / "missing.npz")
    (bad := tmp_path / "bad.json").write_text("{")
    with pytest.raises(ValueError, match=r"bad\.json: not an HD-MoE trace \(JSON"):
        load_trace(bad)


def test_error_from_the_environment_names_the_variable(capfd, monkeypatch):
    monkeypatch.setenv("EXPERT_SLOTS", "0")
    code, _, err = run(capfd, "generate")
    assert code == 2 and "environment variable EXPERT_SLOTS=0: must be >= 1" in err


def test_the_prompt_is_printed_where_the_reply_continues_it(capfd, model_dirs, tmp_path):
    # the embedded model has no chat template: the text is continued, --chat or not,
    # without a note unless --chat is asked for
    for chat in ([], ["--chat"], ["--no-chat"]):
        code, out, err = run(
            capfd, "generate", *chat, "--prompt", "Once upon a", "--max-tokens", "2"
        )
        assert code == 0 and out.startswith("Once upon a time"), (chat, out)
        assert ("no chat template" in err) == (chat == ["--chat"]), (chat, err)
    # a chat template is applied by default, as mlx-lm does: the reply answers the
    # prompt, which is not printed; --no-chat (mlx-lm: --ignore-chat-template) continues
    # the raw prompt
    model = Path(shutil.copytree(model_dirs("qwen3_moe"), tmp_path / "chat"))
    write_tokenizer(model, CHAT_TEMPLATE)
    argv = ["generate", "--model", str(model), "-p", "The cat", "-m", "2"]
    replies = {}
    for chat in ([], ["--chat"], ["--no-chat"], ["--ignore-chat-template"]):
        code, out, err = run(capfd, *argv, *chat, "--json")
        assert code == 0 and "no chat template" not in err, err
        replies[" ".join(chat)] = json.loads(out)["tokens"]
        code, out, err = run(capfd, *argv, *chat)
        assert out.startswith("The cat") == (chat in (["--no-chat"], ["--ignore-chat-template"]))
    from engine.generate import generate, prompt_tokens
    from engine.model import load

    sm = load(model)
    templated = generate(sm, prompt_tokens(sm, "The cat", True), 2).tokens
    raw = generate(sm, prompt_tokens(sm, "The cat", False), 2).tokens
    assert replies == {"": templated, "--chat": templated, "--no-chat": raw,
                       "--ignore-chat-template": raw}  # fmt: skip


def test_chat_without_a_template_says_it_drops_the_system_prompt(capfd):
    argv = ["generate", "--chat", "--max-tokens", "1", "--system", "Be brief."]
    note = "note: the model has no chat template: the prompt is continued as plain text"
    code, _, err = run(capfd, *argv)
    assert code == 0 and f"{note} (without --system)\n" in err, err
    code, _, err = run(capfd, *argv[:-2])
    assert code == 0 and f"{note}\n" in err, err
    # --system alone asks for the template as --chat does
    code, _, err = run(capfd, "generate", "--max-tokens", "1", "--system", "Be brief.")
    assert code == 0 and f"{note} (without --system)\n" in err, err


def test_the_prompt_comes_from_stdin_with_dash_and_short_flags(capfd, monkeypatch):
    """`-p -` reads the prompt from stdin (its last newline dropped), `-m` is
    --max-tokens: as mlx-lm's generate takes them."""
    import io

    code, out, _ = run(capfd, "generate", "--prompt", "Once upon a time", "--max-tokens", "6",
                       "--json")  # fmt: skip
    want = json.loads(out)["tokens"]
    monkeypatch.setattr(sys, "stdin", io.StringIO("Once upon a time\n"))
    code, out, _ = run(capfd, "generate", "-p", "-", "-m", "6", "--json")
    assert code == 0 and json.loads(out)["tokens"] == want and len(want) == 6
    monkeypatch.setattr(sys, "stdin", io.StringIO(" \n"))
    assert_refused(*run(capfd, "generate", "-p", "-"), "--prompt -: stdin held no text")


def test_expert_memory_says_what_it_bought(capfd):
    """--expert-memory says the slots per layer and the bytes it bought, with the unit
    it read a bare G or M in (binary, as dd and docker); --json holds the same."""
    from engine.memory_plan import layer_slots
    from engine.store import ExpertStore

    m = ExpertStore(resolve_store(default_model_path()).path).manifest
    records = [spec.record_bytes for spec in m.layers]
    want = layer_slots(records, m.num_experts, m.top_k, 10 * 2**20)
    assert (min(want), max(want)) == (21, 22)
    code, out, err = run(capfd, "generate", "--expert-memory", "10M", "-m", "2", "--json")
    pool = json.loads(out)["pool"]
    slot_bytes = sum(n * r for n, r in zip(want, records, strict=True))
    assert code == 0 and pool["slots_per_layer"] == want and pool["slot_bytes"] == slot_bytes
    assert pool["expert_memory"] == "10M" and pool["pool_bytes"] > slot_bytes
    assert err.startswith(
        "--expert-memory 10M (read as 10 MiB: 10.5 MB): 21-22 slots per MoE layer of 32 "
        "experts, 10.4 MB of expert slots ("
    ), err
    code, out, err = run(capfd, "generate", "--expert-memory", "10GB", "-m", "2", "--json")
    assert err.startswith("--expert-memory 10GB (10.0 GB): 32 slots per MoE layer"), err
    assert json.loads(out)["pool"]["slots_per_layer"] == [32] * 8


def test_a_model_that_fits_says_nothing_streams(capfd):
    """Every expert in memory (the default): the figures say why the hit rate is 100%
    and nothing was read; with fewer slots they do not."""
    code, _, err = run(capfd, "generate", "-m", "4")
    note = "every expert is in memory (32 slots per MoE layer, read at load): nothing streams"
    assert code == 0 and "read 0 B" in err and note in err, err
    code, _, err = run(capfd, "generate", "-m", "4", "--expert-slots", "8")
    assert code == 0 and "every expert is in memory" not in err


def test_ctrl_c_in_generate_json_prints_the_partial_reply(capfd, monkeypatch):
    """Ctrl+C during `generate --json`: the reply ends at the next MoE layer and its
    object is printed, finish_reason "interrupted", with its figures; exit 130."""
    import engine.generate

    real = engine.generate.stream_generate

    def interrupted_after_three(*args, **kwargs):
        for i, response in enumerate(real(*args, **kwargs)):
            if i == 3:
                os.kill(os.getpid(), signal.SIGINT)  # as Ctrl+C in the terminal
            yield response

    monkeypatch.setattr(engine.generate, "stream_generate", interrupted_after_three)
    handler = signal.getsignal(signal.SIGINT)  # the default, or SIG_IGN in a background job
    code, out, err = run(capfd, "generate", "--json", "-m", "40", "--expert-slots", "8")
    reply = json.loads(out)
    assert code == 130 and reply["finish_reason"] == "interrupted", (code, err)
    assert 4 <= len(reply["tokens"]) <= 5 and reply["stats"]["generated_tokens"] == len(
        reply["tokens"]
    )
    monkeypatch.undo()
    code, out, _ = run(capfd, "generate", "--json", "-m", "4", "--expert-slots", "8")
    full = json.loads(out)
    assert code == 0 and full["finish_reason"] == "length"
    assert full["tokens"] == reply["tokens"][:4]
    assert signal.getsignal(signal.SIGINT) is handler  # put back


def test_a_seed_repeats_a_sampled_reply(capfd):
    def reply(*seed):
        argv = ["generate", "--temp", "1.5", "--max-tokens", "12", "--json", *seed]
        code, out, _ = run(capfd, *argv)
        assert code == 0
        return json.loads(out)["tokens"]

    assert reply("--seed", "7") == reply("--seed", "7") != reply("--seed", "8")


def test_refusals_name_the_subcommand_and_its_help(capfd):
    code, out, err = run(capfd, "generate", "--foo")
    assert code == 2 and err == (
        "expertstream generate: error: unrecognized arguments: --foo "
        "(see expertstream generate --help)\n"
    )
    code, out, err = run(capfd, "cache", "rm", "../etc")
    assert code == 2 and err.startswith("expertstream cache rm: error: '../etc' is not a store")
    code, out, err = run(capfd, "generate", "--expert-slots", "33")
    assert code == 2 and err.startswith("expertstream generate: error: --expert-slots 33: "), err


@pytest.mark.parametrize("terminal", [False, True])
def test_first_use_conversion_says_so(capfd, monkeypatch, model_dirs, tmp_path, terminal):
    model = Path(shutil.copytree(model_dirs("qwen3_moe"), tmp_path / "model"))
    # content of its own: a store of its own
    write_tokenizer(model, f"{{# {tmp_path} #}}{CHAT_TEMPLATE}")
    monkeypatch.setattr(sys.stderr, "isatty", lambda: terminal)
    code, _, err = run(capfd, "generate", "--model", str(model), "--max-tokens", "1")
    if FIRST_USE == IN_PLACE:
        line = f"indexing {model} in place, once per model: reading its 147.5 kB of experts "
        said = " kB (the experts stay in its files)\n"
    else:
        line = f"converting {model} to an expert store, once per model: writing its 147.5 kB"
        said = " kB of blob files\n"
    assert code == 0 and err.startswith(line) and said in err, err
    # on a terminal a bar follows, redrawn; else that line is all
    assert ("experts: 100%" in err and "\r" in err) == terminal, err
    code, _, err = run(capfd, "generate", "--model", str(model), "--max-tokens", "1")
    assert code == 0 and "converting" not in err and "indexing" not in err  # written once


@pytest.mark.parametrize(
    ("script", "module"), [("expertstream", "engine.cli"), ("expertstream-gui", "app.main")]
)
def test_without_an_mlx_backend_every_command_says_what_to_install(tmp_path, script, module):
    """`pip install -e '.[app]'` on Linux leaves MLX without its backend library: its
    import fails. Each console script, --help included, says so in one line with the
    extra to install, not a traceback through the imports first."""
    fake = tmp_path / "site" / "mlx"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    (fake / "core.py").write_text(
        'raise ImportError("libmlx.so: cannot open shared object file: No such file or '
        'directory")\n'
    )
    root = Path(__file__).resolve().parents[1]
    env = os.environ | {"PYTHONPATH": os.pathsep.join([str(fake.parent), str(root)])}
    for argv in (["--help"], ["generate"] if script == "expertstream" else []):
        # what the console script pip writes runs
        code = (
            f"import sys; from {module} import main; sys.argv = {[script, *argv]!r}; "
            "sys.exit(main())"
        )
        out = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
        )
        assert out.returncode == 1 and out.stdout == "", out
        assert out.stderr == (
            "expertstream: error: MLX cannot load (libmlx.so: cannot open shared object file: "
            "No such file or directory). On Linux MLX's backend is an extra: install "
            "expertstream[cpu] (CPU) or expertstream[cuda] (NVIDIA GPU, CUDA 13), e.g. pip "
            "install -e '.[cpu,app]'\n"
        ), out.stderr


def test_help_shows_defaults_and_explains_every_argument():
    parser = build_parser()
    sub = parser._subparsers._group_actions[0].choices
    generate = sub["generate"].format_help()
    for text in (
        "without its last newline (default: Once upon a time)",
        "--prompt PROMPT, -p PROMPT",
        "--max-tokens MAX_TOKENS, -m MAX_TOKENS",
        "longest reply, tokens (>= 1) (default: 64)",
        "(1: all) (default: 1.0)",
        "real-region slots per MoE layer (default: all experts)",
        "background reader threads (default: min(8, 2 x CPUs), at least top-k - 1)",
        "instead of --expert-slots (default: not given: --expert-slots sizes them)",
    ):
        assert text in " ".join(generate.split()), text
    for name, p in sub.items():
        for action in p._actions:
            assert action.help, f"{name} {action.dest} has no help"


def test_convert_errors_are_one_line_naming_the_flag(capfd, tmp_path, qwen_store, model_dirs):
    a_file = tmp_path / "file"
    a_file.write_text("x")
    code, _, err = run(capfd, "convert", str(a_file), str(tmp_path / "store"))
    assert code == 2 and err.count("\n") == 1 and "experts:" not in err
    assert err == (
        f"expertstream convert: error: {a_file}: is a file, not an mlx-lm model directory\n"
    )

    dest = tmp_path / "exists"
    dest.mkdir()
    code, _, err = run(capfd, "convert", str(model_dirs("qwen3_moe")), str(dest))
    want = f"{dest} already exists: --force replaces it"
    assert code == 2 and err == f"expertstream convert: error: {want}\n"
    # A folder holding a file: what --force cannot replace is said first, not "--force
    # replaces it" and then, with --force, a refusal.
    (dest / "notes.txt").write_text("mine")
    want = (
        f"{dest} exists and is not an expert store: convert never replaces it, --force or "
        "not; give a new directory"
    )
    for force in ([], ["--force"]):
        code, _, err = run(capfd, "convert", str(model_dirs("qwen3_moe")), str(dest), *force)
        assert code == 2 and err == f"expertstream convert: error: {want}\n", force
    assert [p.name for p in dest.iterdir()] == ["notes.txt"]

    # A store is no model directory, though it has a config.json: said before the rest.
    code, _, err = run(capfd, "convert", str(qwen_store.path), str(dest))
    assert err == (
        f"expertstream convert: error: {qwen_store.path} is already an expert store; use it "
        "directly with --model\n"
    )
    # OS errors without their "[Errno N]": the path and what is wrong with it.
    code, _, err = run(capfd, "convert", str(tmp_path / "none"), str(tmp_path / "out"))
    want = f"{tmp_path / 'none'}: model directory does not exist"
    assert err == f"expertstream convert: error: {want}\n"
    (empty := tmp_path / "empty").mkdir()
    code, _, err = run(capfd, "convert", str(empty), str(tmp_path / "out"))
    want = f"{empty / 'config.json'}: missing; not an mlx-lm model directory"
    assert code == 2 and err == f"expertstream convert: error: {want}\n"


def test_copies_of_a_model_share_a_store_and_cache_lists_it(capfd, model_dirs, tmp_path):
    original = model_dirs("qwen3_moe", num_layers=2)
    # Copies with new modification times and other folder names: the same content.
    one = Path(shutil.copytree(original, tmp_path / "one", copy_function=shutil.copyfile))
    two = Path(shutil.copytree(original, tmp_path / "two", copy_function=shutil.copyfile))
    store = resolve_store(one).path
    assert resolve_store(two).path == store and store.parent == store_cache_dir()
    write_tokenizer(two)  # changed content: its own store
    other = resolve_store(two).path
    assert other != store

    code, out, _ = run(capfd, "cache", "list")
    assert code == 0 and store.name in out and other.name in out
    rows = {line.split()[0]: line.split()[1:3] for line in out.splitlines()[1:-1]}
    # each with the directory it was last loaded from, and what kind of store it is
    assert rows[store.name] == rows[other.name] == [str(two), FIRST_USE]
    code, out, _ = run(capfd, "cache", "rm", other.name)
    assert code == 0 and not other.exists() and store.exists()
    code, _, err = run(capfd, "cache", "rm", "../etc")
    assert code == 2 and "is not a store name" in err


def test_embedded_model_json_reply_is_what_the_tokenizer_decodes(capfd):
    code, out, _ = run(capfd, "generate", "--prompt", "Once upon a", "--max-tokens", "4", "--json")
    result = json.loads(out)
    assert code == 0 and result["text"].startswith(" time")
    assert default_model_path().is_dir()


def test_one_token_has_no_decode_rate_and_the_count_is_mlx_lms(capfd):
    code, out, _ = run(capfd, "generate", "--max-tokens", "1", "--json")
    stats = json.loads(out)["stats"]
    assert code == 0 and stats["generated_tokens"] == 1 and stats["decode_tps"] is None
    code, out, err = run(capfd, "generate", "--max-tokens", "1")
    assert code == 0 and "decode — tok/s (1 tokens)" in err, err

    from engine.generate import generate, prompt_tokens
    from engine.model import load

    sm = load(None)
    last = []
    t0 = time.monotonic()
    result = generate(sm, prompt_tokens(sm, "Once upon a", False), 5, on_response=last.append)
    elapsed = time.monotonic() - t0
    # mlx-lm's rate is over generation_tokens: every token of the reply, as counted
    assert result.decode_tps == last[-1].generation_tps > 0
    assert len(result.tokens) == last[-1].generation_tokens == 5
    # the reply's wall time: at least the four decode steps mlx-lm timed, within the call
    assert 4 / result.decode_tps <= result.seconds <= elapsed


def test_plain_output_ends_its_line_and_a_closed_pipe_is_quiet(capfd):
    code, out, err = run(capfd, "generate", "--max-tokens", "3")
    assert code == 0 and out.startswith("Once upon a time") and out.endswith("\n")
    assert err.startswith("--\nhits "), err
    # bytes as every figure shows them (engine.memory.human_bytes): every expert was read
    # at load, none during the reply
    assert "  read 0 B  " in err and re.search(r"peak memory \d+\.\d MB\n", err), err
    # `expertstream generate --json | head -c 1`: the reader is gone before the reply.
    p = subprocess.Popen(
        [sys.executable, "-m", "engine.cli", "generate", "--json", "--max-tokens", "2"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    p.stdout.close()
    err = p.stderr.read().decode()
    assert p.wait(120) == 1 and err == "", err  # Python's "Note on SIGPIPE"


def test_stderr_has_no_transformers_advice():
    """transformers 5 without PyTorch warns "[transformers] PyTorch was not found.
    Models won't be available ..." as mlx-lm loads the tokenizer through it: alarming,
    and wrong here, where MLX runs the model, so no command's stderr carries it."""
    env = {k: v for k, v in os.environ.items() if k != "TRANSFORMERS_NO_ADVISORY_WARNINGS"}
    out = subprocess.run(
        [sys.executable, "-m", "engine.cli", "generate", "--max-tokens", "2"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    assert "[transformers]" not in out.stderr and "PyTorch" not in out.stderr, out.stderr


def test_version(capfd):
    """`expertstream --version`, a newcomer's first try, prints the installed version
    (not argparse's "the following arguments are required: command")."""
    from importlib.metadata import version

    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert capfd.readouterr().out == f"expertstream {version('expertstream')}\n"


def test_ctrl_c_in_generate_ends_the_reply_line(capfd, monkeypatch):
    """Ctrl+C while `generate` prints: exit 130, and the reply printed so far ends with a
    newline, so that the shell's prompt starts on a line of its own."""
    import engine.generate

    def cut(sm, prompt, max_tokens, temp, top_p, on_response, stop=None):
        on_response(type("Response", (), {"text": " there was"}))
        raise KeyboardInterrupt

    monkeypatch.setattr(engine.generate, "generate", cut)
    code, out, err = run(capfd, "generate", "--prompt", "Once upon a time,")
    assert code == 130 and out == "Once upon a time, there was\n", out


def test_a_note_says_mlx_compiles_its_cuda_kernels_while_its_cache_is_empty(monkeypatch, tmp_path):
    from engine import kernel_cache, memory_plan

    cache = tmp_path / "ptx"
    monkeypatch.setenv("MLX_PTX_CACHE_DIR", str(cache))
    monkeypatch.setattr(memory_plan, "cuda_pools", lambda: False)
    assert kernel_cache.compile_note() == ""  # not MLX CUDA
    monkeypatch.setattr(memory_plan, "cuda_pools", lambda: True)
    assert kernel_cache.compile_note().endswith(f"it keeps them in {cache}")
    cache.mkdir()
    assert kernel_cache.compile_note() != ""  # made, still empty
    (cache / "gather_float32_int32_1.ptx").write_text("//")
    assert kernel_cache.compile_note() == ""
    # Without MLX_PTX_CACHE_DIR, under the temporary directory std::filesystem names
    monkeypatch.delenv("MLX_PTX_CACHE_DIR")
    for name in ("TMPDIR", "TMP", "TEMP", "TEMPDIR"):
        monkeypatch.delenv(name, raising=False)
    assert kernel_cache.ptx_cache_dir().parents[2] == Path("/tmp")
    monkeypatch.setenv("TEMP", str(tmp_path / "b"))
    monkeypatch.setenv("TMP", str(tmp_path / "a"))
    assert kernel_cache.ptx_cache_dir().parents[2] == tmp_path / "a"


def test_the_commands_give_the_kernel_compile_note(capfd, monkeypatch):
    from engine import kernel_cache

    monkeypatch.setattr(kernel_cache, "compile_note", lambda: "MLX compiles its CUDA kernels")
    code, _, err = run(capfd, "generate", "-m", "2")
    assert code == 0 and "\nnote: MLX compiles its CUDA kernels\n" in "\n" + err, err
