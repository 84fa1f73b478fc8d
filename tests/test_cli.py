"""The command line as a first try meets it: what it prints, what it refuses (naming the
flag), its help, and the store cache (`expertstream cache`)."""

import json
import shutil
from pathlib import Path

import pytest

from engine.cli import build_parser, main
from engine.model import resolve_store
from engine.resources import default_model_path
from engine.store_cache import store_cache_dir

from factories import write_tokenizer


def run(capfd, *argv) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capfd.readouterr()
    return code, out, err


def test_echoed_prompt_and_reply_keep_their_space(capfd):
    code, out, _ = run(capfd, "generate", "--prompt", "Once upon a", "--max-tokens", "6")
    assert code == 0 and out.startswith("Once upon a time,"), out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--max-tokens", "-1"], "--max-tokens -1: must be >= 1"),
        (["--max-tokens", "-5"], "--max-tokens -5: must be >= 1"),
        (["--max-tokens", "0"], "--max-tokens 0: must be >= 1"),
        (["--prompt", ""], "--prompt is empty"),
        (["--prompt", "  "], "--prompt is empty"),
        (["--top-p", "0"], "--top-p 0.0: must be in (0, 1]"),
        (["--temp", "-1"], "--temp -1.0: must be >= 0"),
        (["--expert-slots", "0"], "--expert-slots 0: must be >= 1"),
        (["--reader-threads", "0"], "--reader-threads 0: must be >= 1"),
        (["--prefetch"], "--prefetch needs side-region slots to fill: add --side-slots N"),
        (["--prompt", "cat " * 5000], "prompt (5003 tokens) + max_tokens (64) exceeds"),
    ],
)
def test_refused_before_anything_is_printed(capfd, argv, message):
    code, out, err = run(capfd, "generate", *argv)
    assert code == 2 and out == ""
    assert err == f"expertstream: error: {err.removeprefix('expertstream: error: ')}"
    assert message in err and err.count("\n") == 1, err  # one line: no warning dump


def test_error_from_the_environment_names_the_variable(capfd, monkeypatch):
    monkeypatch.setenv("EXPERT_SLOTS", "0")
    code, _, err = run(capfd, "generate")
    assert code == 2 and "environment variable EXPERT_SLOTS=0: must be >= 1" in err


def test_chat_prints_no_prompt_echo(capfd):
    code, out, err = run(
        capfd, "generate", "--chat", "--prompt", "Once upon a", "--max-tokens", "2"
    )
    assert code == 0 and not out.startswith("Once upon a")


def test_help_shows_defaults_and_explains_every_argument():
    parser = build_parser()
    sub = parser._subparsers._group_actions[0].choices
    generate = sub["generate"].format_help()
    for text in (
        "the text to continue (default: Once upon a time)",
        "longest reply, tokens (>= 1) (default: 64)",
        "(1: all) (default: 1.0)",
        "real-region slots per MoE layer (default: all experts)",
        "background reader threads (default: min(8, 2 x CPUs), at least top-k - 1)",
    ):
        assert text in " ".join(generate.split()), text
    for name, p in sub.items():
        for action in p._actions:
            assert action.help, f"{name} {action.dest} has no help"


def test_convert_errors_are_one_line_naming_the_flag(capfd, tmp_path, qwen_store):
    a_file = tmp_path / "file"
    a_file.write_text("x")
    code, _, err = run(capfd, "convert", str(a_file), str(tmp_path / "store"))
    assert code == 2 and err.count("\n") == 1 and "experts:" not in err
    assert "is a file, not an mlx-lm model directory" in err and "does not exist" not in err

    model = qwen_store.path  # a store has a config.json: an existing destination is refused
    dest = tmp_path / "exists"
    dest.mkdir()
    code, _, err = run(capfd, "convert", str(model), str(dest))
    assert code == 2 and err == f"expertstream: error: {dest} already exists: --force replaces it\n"


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
    assert code == 0 and store.name in out and other.name in out and "qwen3_moe" in out
    code, out, _ = run(capfd, "cache", "rm", other.name)
    assert code == 0 and not other.exists() and store.exists()
    code, _, err = run(capfd, "cache", "rm", "../etc")
    assert code == 2 and "is not a store name" in err


def test_embedded_model_json_reply_is_what_the_tokenizer_decodes(capfd):
    code, out, _ = run(capfd, "generate", "--prompt", "Once upon a", "--max-tokens", "4", "--json")
    result = json.loads(out)
    assert code == 0 and result["text"].startswith(" time")
    assert default_model_path().is_dir()
