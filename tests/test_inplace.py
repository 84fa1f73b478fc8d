"""The in-place store: experts streamed from the checkpoint's own safetensors files
through an index (each segment's file and offset, a crc32 per expert), bit for bit equal
to mlx-lm resident for every family and quantization mode; the blob store's faults
(EIO, short reads, checksum mismatches, truncation) handled and named as for a blob; a
file changed or gone since indexing named; the bytes a first use writes a small part of
the experts'."""

import json
import os
import re
import shutil
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.utils import load_model

from engine import store_cache
from engine.cache import ChecksumError, ExpertReadError, open_cache
from engine.cli import main
from engine.config import StreamConfig
from engine.convert import NotInPlaceError, convert, index_in_place
from engine.model import load, resolve_store
from engine.store import IN_PLACE, ExpertStore, StaleStoreError

from factories import (
    make_family_model,
    make_mixed_quant_model,
    make_random_model,
    write_tokenizer,
)
from moe_families import FAMILIES
from rowcheck import RowChecker
from test_equality import assert_same, greedy_logits

PROMPT = [int(t) for t in np.random.default_rng(0).integers(1, 64, 32)]
STEPS = 3
Q4 = {"group_size": 32, "bits": 4}
# Decoder layer 1 dense: a message naming the MoE index instead of the layer is caught.
OPTIONS = {"mlp_only_layers": (1,)}


def greedy(model):
    return greedy_logits(model, PROMPT, STEPS)


def in_place(model_dir: Path, dest: Path) -> ExpertStore:
    store = ExpertStore(index_in_place(model_dir, dest))
    assert store.in_place and store.manifest.kind == IN_PLACE
    assert sorted(p.name for p in store.path.iterdir()) == ["manifest.json"]
    return store


def shard(model_dir: Path) -> Path:
    """Splits `model.safetensors` of `model_dir` in two files as large checkpoints are
    (decoder layers 0-1 and the embeddings in the first, the rest in the second), with
    their index; returns `model_dir`."""
    weights = mx.load(str(model_dir / "model.safetensors"))
    first = {k: v for k, v in weights.items() if not re.search(r"layers\.[2-9]\.", k)}
    names = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    parts = [first, {k: v for k, v in weights.items() if k not in first}]
    for name, part in zip(names, parts, strict=True):
        mx.save_safetensors(str(model_dir / name), part, metadata={"format": "mlx"})
    (model_dir / "model.safetensors").unlink()
    index = {"weight_map": {k: names[k not in first] for k in sorted(weights)}}
    (model_dir / "model.safetensors.index.json").write_text(json.dumps(index))
    return model_dir


@pytest.fixture(scope="module")
def sharded(model_dirs, tmp_path_factory):
    """A 4-layer qwen3_moe (decoder layer 1 dense) in two shard files, its in-place store
    and mlx-lm's resident logits."""
    model_dir = tmp_path_factory.mktemp("sharded") / "model"
    shutil.copytree(model_dirs("qwen3_moe", **OPTIONS), model_dir)
    shard(model_dir)
    store = in_place(model_dir, model_dir.parent / "store")
    return model_dir, store, greedy(load_model(model_dir)[0])


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_every_family_streams_in_place_bit_exact(tmp_path, model_type):
    config = FAMILIES[model_type]
    for name, quantization in (("q4", Q4), ("f32", None)):
        model_dir = make_family_model(tmp_path / name, config, quantization=quantization)
        store = in_place(model_dir, tmp_path / f"{name}-store")
        resident = greedy(load_model(model_dir)[0])
        for slots in (1, store.manifest.num_experts):
            sm = load(store.path, StreamConfig(expert_slots=slots))
            assert_same(resident, greedy(sm.model))
            assert sm.cache.check() == ""
        del sm


@pytest.mark.parametrize(
    "quantization",
    [
        {"mode": "mxfp4", "group_size": None, "bits": None},
        {"mode": "mxfp8", "group_size": None, "bits": None},
        {"mode": "nvfp4", "group_size": None, "bits": None},
        {"group_size": 64, "bits": 8},
        {"group_size": 32, "bits": 2},
    ],
    ids=["mxfp4", "mxfp8", "nvfp4", "affine8", "affine2"],
)
def test_every_quant_mode_streams_in_place_bit_exact(tmp_path, quantization):
    config = FAMILIES["qwen3_moe"] | {"moe_intermediate_size": 64}
    model_dir = make_family_model(tmp_path / "m", config, quantization=quantization)
    store = in_place(model_dir, tmp_path / "s")
    blob = ExpertStore(convert(model_dir, tmp_path / "blob"))
    assert store.manifest.layers[0].segments == blob.manifest.layers[0].segments
    assert [s.checksums for s in store.manifest.layers] == [
        s.checksums for s in blob.manifest.layers
    ]
    resident = greedy(load_model(model_dir)[0])
    for slots in (1, 2, 8):
        assert_same(resident, greedy(load(store.path, StreamConfig(expert_slots=slots)).model))


def test_mixed_quantization_streams_in_place_bit_exact(tmp_path):
    model_dir = make_mixed_quant_model(tmp_path / "mixed")
    store = in_place(model_dir, tmp_path / "s")
    resident = greedy(load_model(model_dir)[0])
    assert_same(resident, greedy(load(store.path, StreamConfig(expert_slots=2)).model))


@pytest.mark.parametrize("prefetch", [False, True], ids=["demand", "prefetch"])
def test_shards_stream_bit_exact_and_records_are_the_blobs(sharded, tmp_path, prefetch, io_uring):
    model_dir, store, resident = sharded
    assert {src.file for spec in store.manifest.layers for src in spec.sources} == {0, 1}
    blob = ExpertStore(convert(model_dir, tmp_path / "blob"))
    for spec, blob_spec in zip(store.manifest.layers, blob.manifest.layers, strict=True):
        for e in range(store.manifest.num_experts):
            assert store.read_record(spec, e) == blob.read_record(blob_spec, e)
    assert store.verify() == len(store.manifest.layers) * store.manifest.num_experts
    weights = sum(f.stat().st_size for f in model_dir.glob("*.safetensors"))
    assert store.size_bytes == weights  # what the server's model lists say it takes
    extra = {"side_slots": 3, "prefetch": True, "ahead_lo": 1, "ahead_hi": 1} if prefetch else {}
    sm = load(store.path, StreamConfig(expert_slots=2, io_uring=io_uring, **extra))
    assert_same(resident, greedy(sm.model))
    sm.cache.drain()
    assert RowChecker(sm.store, sm.cache).assert_all_published() > 0


MESSAGES = {
    "eio": r"read failed: Input/output error",
    "short_read": r"short read: \d+ of \d+ bytes",
    "corrupt": r"checksum mismatch: crc32 \d+, the manifest says \d+",
}


@pytest.mark.parametrize("kind", ["eio", "short_read", "corrupt", "delay"])
def test_a_transient_fault_is_retried(sharded, kind, io_uring):
    _, store, resident = sharded
    sm = load(store.path, StreamConfig(expert_slots=2, io_uring=io_uring, read_timeout_s=5.0))

    def arm():
        for li in range(sm.cache.num_layers):
            sm.cache.inject_fault(li, kind, count=1, delay_ms=20)

    arm()
    assert_same(resident, greedy(sm.model))
    assert RowChecker(sm.store, sm.cache).assert_all_published() > 0


@pytest.mark.parametrize("kind", ["eio", "short_read", "corrupt"])
def test_a_persistent_fault_names_the_file_layer_and_expert(sharded, kind, io_uring):
    model_dir, store, resident = sharded
    cache = open_cache(store, StreamConfig(expert_slots=4, io_uring=io_uring))
    checker = RowChecker(store, cache)
    cache.inject_fault(1, kind, expert=5, count=10**6)  # MoE index 1: decoder layer 2
    with pytest.raises(ExpertReadError) as info:
        cache.acquire(1, np.array([[1, 5, 3]], dtype=np.int32))
    assert isinstance(info.value, ChecksumError) == (kind == "corrupt")
    # a failed read names the shard it read; the other faults the model's directory
    where = re.escape(
        str(model_dir / "model-00002-of-00002.safetensors" if kind == "eio" else model_dir)
    )
    assert re.fullmatch(rf"{where} \(layer 2, expert 5\): {MESSAGES[kind]}", str(info.value))
    assert sorted(e for e in cache.snapshot(1)["slot_expert"].tolist() if e >= 0) == [1, 3]
    checker.assert_all_published()
    cache.inject_fault(1, "none", count=0)
    rows, missing = cache.acquire(1, np.array([[1, 5, 3]], dtype=np.int32))
    assert missing == []
    for e, r in zip([1, 5, 3], rows.reshape(-1).tolist(), strict=True):
        checker.assert_row(1, r, e)


def scratch_bytes(cache, li, row):
    """The record in layer-scratch row `row` of MoE layer `li`, as bytes."""
    return b"".join(np.array(a[row]).tobytes() for a in cache.layer_scratch(li))


def test_a_layer_read_in_runs_lands_every_record(sharded):
    """A whole layer's reads go in runs of adjacent experts (BlobFile::read_run): in place,
    one read per segment of a run; every record lands whole, and a record whose attempt
    in the run is corrupt is read again alone."""
    _, store, _ = sharded
    config = StreamConfig(expert_slots=2, reader_threads=2, io_uring=False)
    cache = open_cache(store, config)
    checker = RowChecker(store, cache)
    cache.inject_fault(1, "corrupt", expert=5, count=1)
    assert cache.read_layer(1, 0) == 8
    cache.load_whole(1, 0)
    for e in range(8):
        assert scratch_bytes(cache, 1, e) == checker.records[(1, e)]
    cache.inject_fault(2, "eio", expert=3, count=2)  # its attempt in the run and alone
    with pytest.raises(ExpertReadError, match=r"\(layer 3, expert 3\): read failed"):
        cache.load_whole(2, 0)
    assert cache.check() == ""


@pytest.fixture
def own(sharded, tmp_path):
    """A copy of the sharded model, its in-place store, and the shard of decoder layers
    2-3, for tests that damage them."""
    model_dir = shutil.copytree(sharded[0], tmp_path / "model")
    store = in_place(model_dir, tmp_path / "store")
    return model_dir, store, model_dir / "model-00002-of-00002.safetensors"


def test_a_flipped_expert_byte_is_a_checksum_failure_naming_it(own, io_uring):
    model_dir, store, second = own
    spec = store.layer(3)
    src = spec.sources[0]
    assert store.manifest.source.files[src.file].name == second.name
    st = os.stat(second)
    with open(second, "r+b") as f:  # expert 6's first byte of its first segment
        f.seek(src.offset + 6 * spec.segments[0].nbytes)
        byte = f.read(1)[0]
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte ^ 0xFF]))
    os.utime(second, ns=(st.st_atime_ns, st.st_mtime_ns))  # the same size, time and header
    cache = open_cache(ExpertStore(store.path), StreamConfig(expert_slots=2, io_uring=io_uring))
    with pytest.raises(
        ChecksumError,
        match=rf"^{re.escape(str(model_dir))} \(layer 3, expert 6\): checksum mismatch",
    ):
        cache.acquire(2, np.array([[6]], dtype=np.int32))
    with pytest.raises(Exception, match=r"layer 3 expert 6: crc32"):
        store.verify([3])


def test_a_source_truncated_under_a_running_model_is_a_short_read(own):
    model_dir, store, second = own
    sm = load(store.path, StreamConfig(expert_slots=2))
    mx.eval(sm.model(mx.array([PROMPT[:5]])))
    checker = RowChecker(sm.store, sm.cache)  # reads the records before the damage
    os.truncate(second, os.path.getsize(second) // 2)
    sm.cache.reset()
    with pytest.raises(ExpertReadError, match=r"\(layer [23], expert \d+\): short read"):
        sm.model(mx.array([PROMPT[:5]]))
    sm.cache.drain()
    assert sm.cache.check() == "" and sm.cache.inflight == 0
    checker.assert_all_published()
    with pytest.raises(
        StaleStoreError, match=rf"{re.escape(str(second))}: changed since it was indexed: its size"
    ):
        load(store.path)


@pytest.mark.parametrize("change", ["missing", "size", "mtime", "header"])
def test_a_source_changed_since_indexing_is_named(own, change):
    model_dir, store, second = own
    data = second.read_bytes()
    if change == "missing":
        second.unlink()
    elif change == "size":
        second.write_bytes(data + b"\0")
    elif change == "mtime":
        os.utime(second, ns=(0, os.stat(second).st_mtime_ns + 10**9))
    else:  # a header of the same length and a file of the same size and time
        st = os.stat(second)
        n = int.from_bytes(data[:8], "little")
        header = data[8 : 8 + n].replace(b'"F32"', b'"I32"', 1)
        assert header != data[8 : 8 + n]
        second.write_bytes(data[:8] + header + data[8 + n :])
        os.utime(second, ns=(st.st_atime_ns, st.st_mtime_ns))
    said = {
        "missing": "missing",
        "size": "changed since it was indexed: its size",
        "mtime": "changed since it was indexed: its modification time",
        "header": "changed since it was indexed: its safetensors header",
    }[change]
    with pytest.raises(StaleStoreError) as info:
        ExpertStore(store.path)
    assert str(info.value).startswith(f"{second}: {said}")
    assert str(info.value).endswith(f"(the in-place store {store.path} must index the model again)")


def test_a_stale_index_of_the_store_cache_is_made_again(own, monkeypatch):
    model_dir, _, second = own
    monkeypatch.setattr(store_cache, "FIRST_USE", IN_PLACE)
    store = resolve_store(model_dir)
    assert store.in_place and store.path.parent == store_cache.store_cache_dir()
    os.utime(second, ns=(0, os.stat(second).st_mtime_ns + 10**9))
    again = resolve_store(model_dir)
    assert again.path == store.path and again.in_place  # indexed again, same key
    assert again.manifest.source.files[1].mtime_ns == os.stat(second).st_mtime_ns


def test_experts_that_sanitize_builds_are_copied(tmp_path, monkeypatch):
    """Per-expert tensors (a Hugging Face checkpoint) are stacked by the family's
    sanitize: nothing of them is stored as read, so the first use writes blobs."""
    model_dir = make_random_model(
        tmp_path / "m", "qwen3_moe", quantized=False, unstacked_experts=True
    )
    with pytest.raises(NotInPlaceError, match=r"is not a tensor of the checkpoint as stored"):
        index_in_place(model_dir, tmp_path / "s")
    assert not (tmp_path / "s").exists()
    monkeypatch.setattr(store_cache, "FIRST_USE", IN_PLACE)
    store = resolve_store(model_dir)
    assert not store.in_place and (store.path / "layer00.blob").is_file()


def test_first_use_writes_under_a_percent_of_the_expert_bytes(tmp_path, monkeypatch, capfd):
    model_dir = make_random_model(
        tmp_path / "m", "qwen3_moe", num_layers=4, num_experts=16, hidden=256, moe_intermediate=512
    )
    write_tokenizer(model_dir)
    monkeypatch.setattr(store_cache, "FIRST_USE", IN_PLACE)
    monkeypatch.setenv("EXPERTSTREAM_CACHE", str(tmp_path / "cache"))
    code = main(["generate", "--model", str(model_dir), "--prompt", "The cat", "--max-tokens", "2"])
    _, err = capfd.readouterr()
    assert code == 0, err
    written = sum(f.stat().st_size for f in (tmp_path / "cache").rglob("*") if f.is_file())
    store = ExpertStore(next((tmp_path / "cache").iterdir()))
    experts = sum(s.record_bytes for s in store.manifest.layers) * store.manifest.num_experts
    assert store.in_place and 0 < written < experts / 100, (written, experts)
    index = (store.path / "manifest.json").stat().st_size
    line = err.splitlines()[0]
    assert line.startswith(f"indexing {model_dir} in place, once per model: reading its ")
    assert f"{experts / 1e6:.1f} MB of experts once for their checksums" in line, line
    said = re.search(r"writing an index of at most ([\d.]+) kB", line)
    assert said and index <= float(said[1]) * 1e3 + 50, (line, index)
