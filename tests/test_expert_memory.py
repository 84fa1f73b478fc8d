"""--expert-memory: a byte budget for the real regions, split into slots per layer by
each layer's record size."""

import argparse

import pytest

from engine.cache import open_cache, snapshot
from engine.config import StreamConfig, parse_memory, size_words
from engine.flags import add_cache_flags, stream_config
from engine.memory_plan import layer_slots


def test_sizes_parse_as_users_write_them():
    assert parse_memory("6GiB") == 6 * 2**30
    assert parse_memory(" 512 MiB ") == 512 * 2**20
    assert parse_memory("8GB") == 8 * 10**9
    assert parse_memory("1.5gib") == int(1.5 * 2**30)
    assert parse_memory("4096") == 4096
    assert parse_memory("auto") == "auto"
    assert str(parse_memory(" 50MiB")) == "50MiB"  # messages quote it as typed
    # a bare K, M, G, T is binary, as dd and docker read it, and the report says so
    assert parse_memory("10G") == 10 * 2**30 and parse_memory("512m") == 512 * 2**20
    assert parse_memory("1.5 T") == int(1.5 * 2**40) and parse_memory("64k") == 64 * 2**10
    assert size_words(parse_memory("10G")) == "10G (read as 10 GiB: 10.7 GB)"
    assert size_words(parse_memory("8GB")) == "8GB (8.0 GB)"
    for bad in ("", "6 parsecs", "GiB", "inf GiB"):
        with pytest.raises(ValueError, match="is not a memory size"):
            parse_memory(bad)
    for bad in ("0", "-5MiB", "0.1"):
        with pytest.raises(ValueError, match=f"must be > 0, got '{bad}'"):
            parse_memory(bad)


def test_slots_follow_the_record_size_of_each_layer():
    # Equal records: equal slots, at most one apart.
    assert layer_slots([100] * 4, 8, 2, 4 * 100 * 5) == [5, 5, 5, 5]
    assert layer_slots([100] * 4, 8, 2, 4 * 100 * 5 + 250) == [6, 6, 5, 5]
    # Mixed quantization: the same share of each layer's experts (a slot saves a read
    # of its own record size, so a byte buys as much in every layer); what is left over
    # goes to the layers of smaller records.
    slots = layer_slots([200, 100, 200], 16, 2, 2 * 500 + 1500 + 150)
    assert slots == [5, 6, 5]
    assert sum(n * s for n, s in zip(slots, [200, 100, 200], strict=True)) <= 2650
    assert layer_slots([100] * 2, 8, 2, 10**9) == [8, 8]  # never above every expert
    with pytest.raises(ValueError, match="below the 400 B|below the 0.0 MiB"):
        layer_slots([100] * 2, 8, 2, 399)


def test_open_cache_sizes_each_layer_from_the_budget(qwen_store):
    m = qwen_store.manifest
    records = [s.record_bytes for s in m.layers]
    budget = sum(records) * (m.top_k + 1)
    cache = open_cache(qwen_store, StreamConfig(expert_memory=budget))
    assert cache.layer_slots == layer_slots(records, m.num_experts, m.top_k, budget)
    assert sum(n * s for n, s in zip(cache.layer_slots, records, strict=True)) <= budget
    assert snapshot(cache).slot_expert.shape == (len(records), max(cache.layer_slots))
    auto = open_cache(qwen_store, StreamConfig(expert_memory="auto"))
    assert all(n == m.num_experts for n in auto.layer_slots)  # a tiny store fits


def test_flags_and_environment(qwen_store):
    p = argparse.ArgumentParser()
    add_cache_flags(p)
    args = p.parse_args(["--expert-memory", "6GiB"])
    cfg = stream_config(args, environ={"EXPERT_SLOTS": "3"})  # the flag beats the variable
    assert cfg.expert_memory == 6 * 2**30 and cfg.expert_slots is None
    cfg = stream_config(p.parse_args([]), environ={}, defaults={"expert_slots": 4})
    assert cfg.expert_slots == 4
    args = p.parse_args(["--expert-memory", "auto"])
    cfg = stream_config(args, environ={}, defaults={"expert_slots": 4})  # beats a default
    assert cfg.expert_memory == "auto" and cfg.expert_slots is None
    args = p.parse_args(["--expert-memory", "1GiB", "--expert-slots", "3"])
    with pytest.raises(ValueError, match="--expert-slots and --expert-memory are both given"):
        stream_config(args, environ={})
    with pytest.raises(SystemExit):
        p.parse_args(["--expert-memory", "lots"])
