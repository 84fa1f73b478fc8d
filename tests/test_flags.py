"""The cache flags: one definition for the CLI and the app, defaults shown, old names kept."""

import argparse
import os

import pytest

from engine.config import StreamConfig
from engine.flags import FLAGS, add_cache_flags, config_overrides, stream_config
from engine.memory_plan import default_reader_threads


def parser(defaults=None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="t")
    add_cache_flags(p, defaults)
    return p


def test_renamed_flags_still_parse_and_warn(capsys):
    args = parser().parse_args(["--spec-slots", "3", "--prefill-chunk", "5"])
    assert (args.side_slots, args.scratch_slots) == (3, 5)
    err = capsys.readouterr().err
    assert "--spec-slots is deprecated, use --side-slots" in err
    assert "--prefill-chunk is deprecated, use --scratch-slots" in err
    help_text = parser().format_help()
    assert "--spec-slots" not in help_text and "--side-slots" in help_text


def test_help_shows_streamconfig_defaults_or_the_front_ends():
    text = " ".join(parser().format_help().split())
    assert "real-region slots per MoE layer (default: all experts)" in text
    assert "real-region eviction (default: predictive)" in text
    assert "background reader threads (default: min(8, 2 x CPUs), at least top-k - 1)" in text
    text = " ".join(parser({"expert_slots": "half"}).format_help().split())
    assert "real-region slots per MoE layer (default: half)" in text


def test_default_reader_threads_scale_with_cpus_and_top_k(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    assert [default_reader_threads(k) for k in (2, 4, 8, 32)] == [4, 4, 7, 16]
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(64)), raising=False)
    assert [default_reader_threads(k) for k in (2, 8, 10)] == [8, 8, 9]
    assert StreamConfig().reader_threads is None
    with pytest.raises(ValueError, match="reader_threads = 0"):
        StreamConfig(reader_threads=0)


def test_environment_then_flags_then_prefetch_follows_side_slots():
    args = parser().parse_args(["--side-slots", "2", "--policy", "lru"])
    cfg = stream_config(args, {"PREFILL_CHUNK": "4", "EXPERT_SLOTS": "6"})
    assert (cfg.side_slots, cfg.prefetch, cfg.policy) == (2, True, "lru")
    assert (cfg.scratch_slots, cfg.expert_slots) == (4, 6)
    args = parser().parse_args(["--side-slots", "2", "--no-prefetch", "--expert-slots", "3"])
    # the app's start state: side rows ready for its live Prefetch box
    assert config_overrides(args, {"EXPERT_SLOTS": "6"}) == {
        "side_slots": 2,
        "prefetch": False,
        "expert_slots": 3,
    }
    # a command line has no such box: its side rows would hold memory and nothing else
    with pytest.raises(ValueError) as e:
        stream_config(args, {})
    assert str(e.value).startswith("--side-slots 2 with --no-prefetch: only prefetch fills")
    # --side-slots 0 turns prefetch off even over a front end whose default is on (the app)
    args = parser().parse_args(["--side-slots", "0"])
    assert config_overrides(args, {}) == {"side_slots": 0, "prefetch": False}
    assert stream_config(args, {}, {"side_slots": 4, "prefetch": True}).prefetch is False
    with pytest.raises(ValueError, match="SIDEREGION_LFU"):
        stream_config(parser().parse_args([]), {"SIDEREGION_LFU": "maybe"})


def test_sync_flag_needs_prefetch_on():
    # The command line's default is prefetch off: --sync alone would do nothing.
    with pytest.raises(ValueError, match="--sync makes prefetch fills synchronous"):
        stream_config(parser().parse_args(["--sync"]), {})
    for flags in (["--sync", "--no-prefetch"], ["--sync", "--side-slots", "0"]):
        with pytest.raises(ValueError, match="--sync"):
            config_overrides(parser().parse_args(flags), {})
    # Over a front end whose default is prefetch on (the app), --sync alone is fine.
    args = parser().parse_args(["--sync"])
    assert config_overrides(args, {}) == {"sync": True}
    assert stream_config(args, {}, {"side_slots": 4, "prefetch": True}).sync is True
    cfg = stream_config(parser().parse_args(["--sync", "--side-slots", "2"]), {})
    assert (cfg.sync, cfg.prefetch, cfg.side_slots) == (True, True, 2)
    # SIDEREGION_SYNC alone is a preference, not a request: no refusal.
    assert stream_config(parser().parse_args([]), {"SIDEREGION_SYNC": "1"}).sync is True


def test_io_uring_is_on_by_default_and_can_be_turned_off():
    assert stream_config(parser().parse_args([]), {}).io_uring is True
    assert stream_config(parser().parse_args(["--no-io-uring"]), {}).io_uring is False
    text = " ".join(parser().format_help().split())
    assert "(--no-io-uring: the reader threads) (default: on)" in text


def test_cli_and_app_take_the_same_flags():
    from app.main import build_parser as app_parser
    from engine.cli import build_parser as cli_parser

    def flags(p):
        sub = [a for a in p._actions if isinstance(a, argparse._SubParsersAction)]
        p = sub[0].choices["generate"] if sub else p
        return {s for a in p._actions for s in a.option_strings}

    names = {f.name for f in FLAGS}
    assert names <= flags(cli_parser()) and names <= flags(app_parser())


def test_host_memory_takes_a_size_auto_or_off(capsys):
    def host(*argv):
        return stream_config(parser().parse_args(list(argv))).host_memory

    assert host() == "auto" and host("--host-memory", "off") == 0
    assert [host("--host-memory", zero) for zero in ("0", "0B", "0GiB")] == [0, 0, 0]
    assert host("--host-memory", "2GiB") == 2 * 2**30
    with pytest.raises(SystemExit):
        parser().parse_args(["--host-memory", "lots"])
    assert "'lots' is not a memory size" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parser().parse_args(["--host-memory=-1GiB"])
    assert "argument --host-memory: must be >= 0 (0: off), got '-1GiB'" in capsys.readouterr().err
    assert stream_config(parser().parse_args(["--no-device-acquire"])).device_acquire is False
