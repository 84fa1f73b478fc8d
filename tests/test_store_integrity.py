"""Consistent but impossible stores, and bytes changed on disk.

A store whose config and manifest agree on absurd sizes is refused before anything is
allocated, with the size asked for and why; a failed native allocation is an error, not a
crash. The dense weights are covered by a crc32 checked at load, and safetensors headers
whose offsets overlap, leave gaps or disagree with a tensor's dtype and shape are refused
(stores and model directories), so changed bytes never generate different tokens silently.
"""

import json
import os
import re
import shutil
import struct
import subprocess
import sys
import textwrap
import zlib
from pathlib import Path

import pytest

from engine import cache as cache_mod
from engine import memory_plan
from engine.cli import main
from engine.config import ConfigError, StreamConfig
from engine.convert import convert
from engine.experts import expected_segments, find_experts, instantiate
from engine.flags import flag_names
from engine.model import load
from engine.safe_io import ModelFileError
from engine.store import VERSION, ExpertStore, StoreError, layout_segments, stride_for
from engine.store_cache import store_cache_dir


@pytest.fixture
def store_dir(qwen_store, tmp_path):
    return Path(shutil.copytree(qwen_store.path, tmp_path / "store"))


def make_wide_store(store_dir: Path, moe_intermediate: int) -> Path:
    """Makes the store's config and manifest agree on `moe_intermediate_size`, with
    sparse all-zero blobs of the matching size and their true checksums."""
    config = json.loads((store_dir / "config.json").read_text())
    config["moe_intermediate_size"] = moe_intermediate
    (store_dir / "config.json").write_text(json.dumps(config))
    manifest = json.loads((store_dir / "manifest.json").read_text())
    experts = find_experts(instantiate(config, "config.json"))
    for raw, expert in zip(manifest["layers"], experts, strict=True):
        keys = {s["key"] for s in raw["segments"]}
        want = expected_segments(expert, raw["quantization"], keys)
        segments = layout_segments(
            (s["key"], s["dtype"], want[s["key"]][1]) for s in raw["segments"]
        )
        record = sum(s.nbytes for s in segments)
        raw |= {
            "segments": [s.to_json() for s in segments],
            "record_bytes": record,
            "stride": stride_for(record),
            "checksums": [zlib.crc32(bytes(record))] * manifest["num_experts"],
        }
        os.truncate(store_dir / raw["file"], 0)
        os.truncate(store_dir / raw["file"], manifest["num_experts"] * stride_for(record))
    (store_dir / "manifest.json").write_text(json.dumps(manifest))
    return store_dir


# ---- pools sized against the memory available --------------------------------


def test_huge_consistent_store_is_refused_before_allocating(store_dir, monkeypatch, capsys):
    """moe_intermediate_size 2**18 in config and manifest: 37.7 MB records, 1.5 GB of
    pools, two 37.7 MB read buffers for the reader threads and three for io_uring's demand
    reads. With 1 GB available the load is refused, naming the size and its parts."""
    make_wide_store(store_dir, 2**18)
    assert ExpertStore(store_dir).manifest.layers[0].record_bytes == 37748736
    monkeypatch.setattr(memory_plan, "available_bytes", lambda: 1_000_000_000)
    message = (
        r"the expert pools need 1\.7 GB \(4 MoE layers x 10 rows \(expert_slots \+ 2 x "
        r"side_slots \+ scratch_slots\) x records of up to 37\.7 MB\) "
        r"and the dense weights 62\.4 kB, 1\.7 GB together, but 1\.0 GB of memory is "
        r"available: every expert is cached by default: use expert_memory auto, or give "
        r"expert_slots$"
    )
    with pytest.raises(cache_mod.PoolMemoryError, match=message):
        load(store_dir, StreamConfig(reader_threads=2))  # the default depends on the CPUs
    # the CLI streams a default that does not fit (expert memory auto), not a size given
    argv = ["generate", "--model", str(store_dir), "--reader-threads", "2", "--expert-slots", "8"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "the expert pools need 1.7 GB" in err[0]
    assert err[0].endswith("lower --expert-slots, or use --expert-memory auto"), err[0]


def test_the_dense_weights_count_and_the_flag_given_is_named(store_dir, monkeypatch):
    """Pools that fit only without the dense weights (loaded beside them) are refused; the
    message names the sizing flag given (or its absence) and suggests auto."""
    store = ExpertStore(store_dir)
    dense = store.manifest.dense_bytes
    assert dense == 62418  # the fixture's dense.safetensors
    cases = [
        (
            StreamConfig(expert_slots=4, reader_threads=2),
            "lower --expert-slots, or use --expert-memory auto",
        ),
        (
            StreamConfig(expert_memory=2**20, reader_threads=2),
            "lower --expert-memory, or use --expert-memory auto",
        ),
        (
            StreamConfig(expert_memory=2**20, side_slots=2, reader_threads=2),
            "lower --expert-memory, or use --expert-memory auto (or lower --side-slots)",
        ),
        (
            StreamConfig(reader_threads=2),
            "every expert is cached by default: use --expert-memory auto, or give --expert-slots",
        ),
    ]
    for config, remedy in cases:
        pools = memory_plan.plan_memory(store, config, check=False).pool_bytes
        monkeypatch.setattr(memory_plan, "available_bytes", lambda n=pools + dense - 1: n)
        with pytest.raises(cache_mod.PoolMemoryError) as e:
            cache_mod.open_cache(store, config)
        words = e.value.in_words(flag_names())
        assert words.endswith(f" of memory is available: {remedy}"), words
        assert "the dense weights 62.4 kB" in str(e.value)
        names = {"expert_slots": "expert slots", "expert_memory": "expert memory"}
        assert "--" not in e.value.in_words(names | {"side_slots": "side rows"})
        monkeypatch.setattr(memory_plan, "available_bytes", lambda n=pools + dense: n)
        assert cache_mod.open_cache(store, config).num_layers == len(store.manifest.layers)
    # auto: half of 200 kB for 4.6 kB records, plus side and scratch rows, plus dense
    monkeypatch.setattr(memory_plan, "available_bytes", lambda: 200_000)
    with pytest.raises(cache_mod.PoolMemoryError) as e:
        cache_mod.open_cache(store, StreamConfig(expert_memory="auto", reader_threads=2))
    assert str(e.value).endswith("give expert_memory a size below auto's (50% of that)")
    assert e.value.in_words(flag_names()).endswith(
        "give --expert-memory a size below auto's (50% of that)"
    )


def test_pools_beyond_any_memory_are_refused(store_dir, monkeypatch):
    """A billion side slots are refused by the bound of the expert count (8); past it
    (switched off), they ask for petabytes, refused by the real memory check."""
    config = StreamConfig(expert_slots=2, side_slots=10**9)
    with pytest.raises(ConfigError, match=r"side_slots = 1000000000: must be <= 8, the model's"):
        load(store_dir, config)
    monkeypatch.setattr(memory_plan, "check_counts", lambda config, num_experts: None)
    with pytest.raises(cache_mod.PoolMemoryError, match=r"the expert pools need \d+\.\d [kMG]?B"):
        load(store_dir, config)


def test_planned_bytes_are_what_the_native_cache_allocates():
    """Pools and expert tables, a read buffer per reader thread and the io_uring region,
    each rounded as the native cache allocates it."""
    from engine import _ext

    kib, mib = 1 << 10, 1 << 20
    # 2 layers x 3 rows of 60 KiB records, 8-id tables, 2 read buffers, a ring of 3 buffers
    # within its 2 MiB floor
    planned = _ext.planned_bytes([3, 3], [60 * kib] * 2, 8, 2, 60 * kib, 3)
    assert planned == 2 * (3 * 60 * kib + 32) + 2 * 60 * kib + 2 * mib
    # 1.5 MiB records: each read buffer takes 2 MiB (huge pages), the ring's 4.5 MiB 6 MiB
    planned = _ext.planned_bytes([1], [3 * mib // 2], 8, 2, 3 * mib // 2, 3)
    assert planned == 3 * mib // 2 + 32 + 2 * 2 * mib + 6 * mib
    assert _ext.planned_bytes([1], [60 * kib], 8, 2, 60 * kib, 0) == 60 * kib + 32 + 120 * kib
    assert _ext.planned_bytes([], [], 8, 2, 0, 3) == 0
    with pytest.raises(ValueError, match="2 rows for 1 record sizes"):
        _ext.planned_bytes([1, 1], [60 * kib], 8, 2, 60 * kib, 0)


NATIVE_ALLOCATION = textwrap.dedent(
    """
    import sys
    from engine import cache as cache_mod, memory_plan
    from engine.config import StreamConfig
    from engine.store import ExpertStore

    memory_plan.available_bytes = lambda: None
    memory_plan.check_counts = lambda config, num_experts: None
    try:
        cache_mod.open_cache(ExpertStore(sys.argv[1]), StreamConfig(side_slots=2**24))
    except cache_mod.PoolMemoryError as e:
        print("PoolMemoryError:", e)
    """
)


def test_failed_native_allocation_is_an_error(store_dir):
    """Past the Python checks (here: switched off), the native cache checks every
    allocation: 2**48 bytes cannot be mapped on any machine. In a fresh interpreter: MLX's
    allocator counts an allocation that failed as in use for the rest of the process (its
    active and peak memory)."""
    make_wide_store(store_dir, 2**18)
    out = subprocess.run(
        [sys.executable, "-c", NATIVE_ALLOCATION, str(store_dir)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    message = r"PoolMemoryError: .*cannot allocate \d+ bytes for .*layer00\.blob segment gate_proj"
    assert re.search(message, out.stdout), out.stdout


# ---- dense weights: checksum and header ----------------------------------------


def refresh_manifest(store_dir: Path, crc: bool = True) -> None:
    """Records the dense file's current size (and crc32), as if the store had been written
    with it (so that only the header check, or only the checksum, can notice a change)."""
    data = (store_dir / "dense.safetensors").read_bytes()
    manifest = json.loads((store_dir / "manifest.json").read_text())
    manifest["dense_bytes"] = len(data)
    if crc:
        manifest["dense_crc32"] = zlib.crc32(data)
    (store_dir / "manifest.json").write_text(json.dumps(manifest))


def rewrite_header(path: Path, mutate) -> None:
    """Applies `mutate(header)` to the safetensors header of `path`, data unchanged."""
    data = path.read_bytes()
    n = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8 : 8 + n])
    mutate(header)
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + n :])


def tensor(header: dict, index: int) -> dict:
    """The `index`-th tensor of the header in data order."""
    entries = sorted(
        (v for k, v in header.items() if k != "__metadata__"), key=lambda v: v["data_offsets"]
    )
    return entries[index]


def shift(by: int, ends: bool):
    def mutate(header):
        t = tensor(header, 3)
        t["data_offsets"][0] += by
        if ends:
            t["data_offsets"][1] += by

    return mutate


def set_dtype(header):
    tensor(header, 2)["dtype"] = "F16"


def set_shape(header):
    t = tensor(header, 2)
    t["shape"] = t["shape"][::-1] + [1]
    t["shape"][0] *= 2


def swap_offsets(header):
    a, b = tensor(header, 1), tensor(header, 2)
    a["data_offsets"], b["data_offsets"] = b["data_offsets"], a["data_offsets"]


def drop_last(header):
    last = tensor(header, -1)
    del header[next(k for k, v in header.items() if v is last)]


HEADERS = [
    (shift(1, ends=False), r"tensor '[^']+': data_offsets \[\d+, \d+\] span \d+ bytes but"),
    (shift(2, ends=True), r"tensor '[^']+' at byte \d+ leaves a gap before it"),
    (shift(-2, ends=True), r"tensor '[^']+' at byte \d+ overlaps the tensor before it"),
    (set_dtype, r"tensor '[^']+': data_offsets \[\d+, \d+\] span \d+ bytes but F16\[.*\] has \d+"),
    (set_shape, r"tensor '[^']+': data_offsets \[\d+, \d+\] span \d+ bytes but F32\[.*\] has \d+"),
    (drop_last, r"the tensors cover \d+ bytes of a data buffer of \d+ bytes"),
]
HEADER_IDS = ["shift-begin-1", "shift-2", "shift-back-2", "dtype", "shape", "drop-last"]


@pytest.mark.parametrize(("mutate", "message"), HEADERS, ids=HEADER_IDS)
def test_dense_header_that_does_not_match_its_data(store_dir, mutate, message):
    rewrite_header(store_dir / "dense.safetensors", mutate)
    refresh_manifest(store_dir)
    with pytest.raises(
        StoreError, match=r"dense\.safetensors: not a valid safetensors file: " + message
    ):
        load(store_dir, StreamConfig(expert_slots=2))


@pytest.mark.parametrize(("mutate", "message"), HEADERS, ids=HEADER_IDS)
def test_model_header_that_does_not_match_its_data(model_dirs, tmp_path, mutate, message):
    model_dir = Path(shutil.copytree(model_dirs("qwen3_moe"), tmp_path / "model"))
    rewrite_header(model_dir / "model.safetensors", mutate)
    with pytest.raises(
        ModelFileError, match=r"model\.safetensors: not a valid safetensors file: " + message
    ):
        convert(model_dir, tmp_path / "store")
    assert not (tmp_path / "store").exists()


def test_swapped_offsets_of_equal_tensors_are_caught_by_the_checksum(store_dir):
    """Two tensors of one size trading places keep a valid header: the crc32 over the
    whole file catches the change."""
    path = store_dir / "dense.safetensors"
    n = struct.unpack("<Q", path.read_bytes()[:8])[0]
    header = json.loads(path.read_bytes()[8 : 8 + n])
    sizes = {}
    for name, t in header.items():
        if name != "__metadata__":
            sizes.setdefault((t["dtype"], tuple(t["shape"])), []).append(name)
    a, b = next(names for names in sizes.values() if len(names) >= 2)[:2]

    def mutate(h):
        h[a]["data_offsets"], h[b]["data_offsets"] = h[b]["data_offsets"], h[a]["data_offsets"]

    rewrite_header(path, mutate)
    refresh_manifest(store_dir, crc=False)
    with pytest.raises(StoreError, match=r"dense\.safetensors: crc32 0x[0-9a-f]{8} does not match"):
        load(store_dir, StreamConfig(expert_slots=2))


@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_flipped_dense_byte_is_caught(store_dir, where):
    path = store_dir / "dense.safetensors"
    data = bytearray(path.read_bytes())
    at = {"first": 8 + struct.unpack("<Q", data[:8])[0], "middle": len(data) // 2, "last": -1}[
        where
    ]
    data[at] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(
        StoreError,
        match=r"dense\.safetensors: crc32 0x[0-9a-f]{8} does not match the manifest's dense_crc32",
    ):
        load(store_dir, StreamConfig(expert_slots=2))


def nan_scales(store_dir: Path, layer_index: int, expert: int) -> tuple[Path, str]:
    """Writes NaN into one record's first float segment (a scales of the quantized
    store) and its crc32 into the manifest, as a forger would; returns the blob and the
    segment's key."""
    manifest = json.loads((store_dir / "manifest.json").read_text())
    raw = manifest["layers"][layer_index]
    seg = next(s for s in raw["segments"] if s["dtype"] in ("bfloat16", "float16", "float32"))
    path = store_dir / raw["file"]
    data = bytearray(path.read_bytes())
    at = expert * raw["stride"] + seg["offset"]
    nan = {"bfloat16": b"\xc0\x7f", "float16": b"\x00\x7e", "float32": b"\x00\x00\xc0\x7f"}
    data[at : at + len(nan[seg["dtype"]])] = nan[seg["dtype"]]
    path.write_bytes(bytes(data))
    record = data[expert * raw["stride"] : expert * raw["stride"] + raw["record_bytes"]]
    raw["checksums"][expert] = zlib.crc32(record)
    (store_dir / "manifest.json").write_text(json.dumps(manifest))
    return path, seg["key"]


def test_nan_scales_with_a_matching_checksum_are_refused(store_dir, capsys):
    """NaN in an expert's scales, its crc32 written to match: the reader refuses the
    record naming the blob, layer, expert and segment (it gave empty replies, exit 0),
    and so does `ExpertStore.verify`."""
    path, key = nan_scales(store_dir, 1, 5)
    layer = ExpertStore(store_dir).manifest.layers[1].layer
    with pytest.raises(StoreError, match=rf"layer {layer} expert 5: {key} holds NaN or infinity"):
        ExpertStore(store_dir).verify()
    # every expert resident: read at load
    code = main(["generate", "--model", str(store_dir), "--prompt", "The", "--max-tokens", "2"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert f"{path} (layer {layer}, expert 5): {key} holds NaN or infinity (a damaged store)" in err


def test_the_writer_refuses_a_record_holding_nan(tmp_path):
    """The one writer refuses NaN or infinity in a float segment of a record (synthetic
    stores and copies go through it as converted ones do)."""
    from engine.store_writer import StoreWriter

    segments = layout_segments([("fc1.weight", "uint32", (4,)), ("fc1.scales", "float16", (2,))])
    good = [bytes(16) + bytes(4)] * 2
    bad = [bytes(16) + bytes.fromhex("0000007c")]  # 0, +inf
    with StoreWriter(tmp_path / "s", 2) as writer:
        writer.write_layer(0, "m.layers.0.experts", segments, {}, [[r] for r in good])
        with pytest.raises(ValueError, match=r"s: layer 1 expert 1: fc1\.scales holds NaN"):
            writer.write_layer(1, "m.layers.1.experts", segments, {}, [[good[0]], bad])


def test_store_of_the_old_format_is_converted_again(model_dirs, tmp_path, monkeypatch):
    """A version-1 store in the store cache (no dense checksum) is replaced by a new
    conversion at the next load; given by path it is refused with what to do."""
    monkeypatch.setenv("EXPERTSTREAM_CACHE", str(tmp_path / "cache"))
    model_dir = Path(shutil.copytree(model_dirs("qwen3_moe"), tmp_path / "model"))
    cached = load(model_dir, StreamConfig(expert_slots=2)).store.path
    manifest = json.loads((cached / "manifest.json").read_text())
    for key in ("dense_bytes", "dense_crc32"):
        del manifest[key]
    (cached / "manifest.json").write_text(json.dumps(manifest | {"version": 1}))
    with pytest.raises(StoreError, match=r"version 1 is not supported .* convert the model again"):
        load(cached)
    assert load(model_dir, StreamConfig(expert_slots=2)).store.path == cached
    assert json.loads((cached / "manifest.json").read_text())["version"] == VERSION
    assert [p.name for p in store_cache_dir().iterdir()] == [cached.name]
