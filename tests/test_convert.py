"""convert(): a store holds exactly the checkpoint's weights, for every model type."""

import errno
import gc
import json
import os
import shutil
from dataclasses import replace
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.utils import _get_classes, load_model

import engine.store_writer as store_writer
from engine.convert import convert
from engine.experts import NotMoEError, UnsupportedModelError, find_experts
from engine.store import DTYPES, ExpertStore, Manifest

from factories import (
    MODEL_TYPES,
    make_config,
    make_mixed_quant_model,
    make_random_model,
    write_tokenizer,
)

CASES = [(t, q) for t in MODEL_TYPES for q in (True, False)]
IDS = [f"{t}-{'q4' if q else 'f32'}" for t, q in CASES]
TOKENS = mx.array([[3, 17, 42, 5, 99, 8, 64, 1]])


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    """(model_dir, ExpertStore) per (model_type, quantized); olmoe with expert bias."""
    root = tmp_path_factory.mktemp("convert")
    out = {}
    for seed, (model_type, quantized) in enumerate(CASES):
        name = f"{model_type}-{quantized}"
        model_dir = make_random_model(
            root / name,
            model_type,
            quantized=quantized,
            seed=seed,
            expert_bias=model_type == "olmoe",
        )
        out[model_type, quantized] = (
            model_dir,
            ExpertStore(convert(model_dir, root / f"{name}.store")),
        )
    return out


def sanitized_weights(model_dir) -> dict[str, mx.array]:
    """The checkpoint's weights under mlx-lm's sanitized names."""
    config = json.loads((model_dir / "config.json").read_text())
    model_class, args_class = _get_classes(config)
    weights = {}
    for f in sorted(model_dir.glob("model*.safetensors")):
        weights.update(mx.load(str(f)))
    return model_class(args_class.from_dict(config)).sanitize(weights)


def segment_array(record: bytes, seg) -> mx.array:
    """Reinterpret one segment of a record as an MLX array of its dtype and shape."""
    raw = np.frombuffer(record, dtype=np.uint8, count=seg.nbytes, offset=seg.offset)
    return mx.array(raw).view(DTYPES[seg.dtype]).reshape(seg.shape)


def rebuild_weights(store: ExpertStore) -> dict[str, mx.array]:
    """Dense weights plus expert arrays stacked back from the blob records."""
    weights = dict(store.dense_weights())
    for spec in store.manifest.layers:
        records = [store.read_record(spec, e) for e in range(store.manifest.num_experts)]
        for seg in spec.segments:
            weights[f"{spec.module}.{seg.key}"] = mx.stack([segment_array(r, seg) for r in records])
    return weights


def load_rebuilt(store: ExpertStore, out_dir):
    """mlx-lm model (strictly loaded) from weights read back out of the store."""
    out_dir.mkdir()
    shutil.copy(store.path / "config.json", out_dir / "config.json")
    mx.save_safetensors(str(out_dir / "model.safetensors"), rebuild_weights(store))
    model, _ = load_model(out_dir)
    return model


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_records_hold_the_expert_slices(stores, case):
    model_dir, store = stores[case]
    original = sanitized_weights(model_dir)
    n = store.manifest.num_experts
    for spec in store.manifest.layers:
        blob = store.blob_path(spec).read_bytes()
        assert len(blob) == n * spec.stride
        assert spec.stride % 4096 == 0 and spec.stride >= spec.record_bytes
        for e in range(n):
            record = store.read_record(spec, e)
            assert record == blob[e * spec.stride : e * spec.stride + spec.record_bytes]
            assert blob[e * spec.stride + spec.record_bytes : (e + 1) * spec.stride].count(0) == (
                spec.stride - spec.record_bytes
            )
            for seg in spec.segments:
                expert = original[f"{spec.module}.{seg.key}"][e]
                assert seg.shape == tuple(expert.shape)
                assert DTYPES[seg.dtype] == expert.dtype
                want = np.asarray(expert).tobytes()
                assert record[seg.offset : seg.offset + seg.nbytes] == want


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_dense_and_experts_partition_the_checkpoint(stores, case):
    model_dir, store = stores[case]
    original = sanitized_weights(model_dir)
    dense = store.dense_weights()
    experts = {f"{s.module}.{seg.key}" for s in store.manifest.layers for seg in s.segments}
    assert not dense.keys() & experts
    assert dense.keys() | experts == original.keys()
    assert all(".switch_mlp." in k for k in experts)
    for key, value in dense.items():
        assert value.dtype == original[key].dtype, key
        assert mx.array_equal(value, original[key]).item(), key
    if case[0] == "qwen2_moe":
        assert "model.layers.0.mlp.shared_expert.gate_proj.weight" in dense
    if case[0] == "olmoe":
        assert [s.key for s in store.manifest.layers[0].segments if s.key.endswith(".bias")] == [
            "gate_proj.bias",
            "up_proj.bias",
            "down_proj.bias",
        ]


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_checksums_verify_and_manifest_round_trips(stores, case):
    _, store = stores[case]
    assert store.verify() == len(store.manifest.layers) * store.manifest.num_experts
    data = json.loads((store.path / "manifest.json").read_text())
    assert data == store.manifest.to_json()
    again = Manifest.from_json(json.loads(json.dumps(store.manifest.to_json())), store.path)
    assert again == store.manifest
    assert store.manifest.model_type == case[0]
    assert store.manifest.top_k == 2 and store.manifest.num_experts == 8
    assert [s.layer for s in store.manifest.layers] == [0, 1, 2, 3]
    assert [s.moe_index for s in store.manifest.layers] == [0, 1, 2, 3]
    attr = "block_sparse_moe" if case[0] == "mixtral" else "mlp"
    assert store.layer(2).module == f"model.layers.2.{attr}.switch_mlp"
    assert store.layer(2).file == "layer02.blob"


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_model_rebuilt_from_store_matches_resident(stores, case, tmp_path):
    model_dir, store = stores[case]
    resident, _ = load_model(model_dir)
    rebuilt = load_rebuilt(store, tmp_path / "rebuilt")
    assert mx.array_equal(rebuilt(TOKENS), resident(TOKENS)).item()
    modules = {e.path: e.module for e in find_experts(resident)}
    for spec in store.manifest.layers:
        for proj, q in spec.quantization.items():
            linear = modules[spec.module][proj]
            if q is None:
                assert "scales" not in linear
            else:
                assert q == {
                    "group_size": linear.group_size,
                    "bits": linear.bits,
                    "mode": linear.mode,
                }


def test_mixed_quantization_per_projection(tmp_path):
    out = make_mixed_quant_model(tmp_path)
    config = json.loads((out / "config.json").read_text())
    store = ExpertStore(convert(out, tmp_path / "s"))
    assert config["quantization"]["model.layers.1.block_sparse_moe.switch_mlp.up_proj"]
    assert store.layer(1).quantization["up_proj"] == {"group_size": 64, "bits": 8, "mode": "affine"}
    assert store.layer(1).quantization["down_proj"] == {
        "group_size": 32,
        "bits": 4,
        "mode": "affine",
    }
    assert store.layer(0).quantization["up_proj"] == {"group_size": 32, "bits": 4, "mode": "affine"}
    resident, _ = load_model(out)
    assert mx.array_equal(load_rebuilt(store, tmp_path / "r")(TOKENS), resident(TOKENS)).item()


@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral"])
def test_per_expert_checkpoint_is_stacked(tmp_path, model_type):
    stacked = make_random_model(tmp_path / "a", model_type, quantized=False, seed=7)
    unstacked = make_random_model(
        tmp_path / "b", model_type, quantized=False, seed=7, unstacked_experts=True
    )
    assert any(".experts.3." in k for k in mx.load(str(unstacked / "model.safetensors")))
    a = ExpertStore(convert(stacked, tmp_path / "sa"))
    b = ExpertStore(convert(unstacked, tmp_path / "sb"))
    # dense.safetensors holds the same tensors, in another order: its size and crc32 differ
    no_dense = {"dense_bytes": 0, "dense_crc32": 0}
    assert replace(a.manifest, **no_dense) == replace(b.manifest, **no_dense)
    dense_a, dense_b = a.dense_weights(), b.dense_weights()
    assert dense_a.keys() == dense_b.keys()
    assert all(np.array_equal(np.array(dense_a[k]), np.array(dense_b[k])) for k in dense_a)
    for spec in a.manifest.layers:
        assert a.blob_path(spec).read_bytes() == b.blob_path(spec).read_bytes()


@pytest.mark.parametrize(("model_type", "quantized"), [("qwen3_moe", True), ("mixtral", False)])
def test_bfloat16_bytes_are_reinterpreted_not_converted(tmp_path, model_type, quantized):
    model_dir = make_random_model(tmp_path / "m", model_type, quantized=quantized)
    path = model_dir / "model.safetensors"
    weights = {
        k: v.astype(mx.bfloat16) if mx.issubdtype(v.dtype, mx.floating) else v
        for k, v in mx.load(str(path)).items()
    }
    mx.save_safetensors(str(path), weights, metadata={"format": "mlx"})
    store = ExpertStore(convert(model_dir, tmp_path / "s"))
    dtypes = {seg.key: seg.dtype for seg in store.manifest.layers[0].segments}
    assert dtypes["up_proj.weight"] == ("uint32" if quantized else "bfloat16")
    if quantized:
        assert dtypes["up_proj.scales"] == "bfloat16"
    for spec in store.manifest.layers:
        for e in (0, 5):
            record = store.read_record(spec, e)
            for seg in spec.segments:
                want = weights[f"{spec.module}.{seg.key}"][e]
                got = segment_array(record, seg)
                assert got.dtype == want.dtype
                assert mx.array_equal(got, want).item()
    if quantized:  # MLX's CPU gather_mm is float32-only.
        resident, _ = load_model(model_dir)
        rebuilt = load_rebuilt(store, tmp_path / "r")
        assert mx.array_equal(rebuilt(TOKENS), resident(TOKENS)).item()


def test_dense_layers_keep_decoder_numbering(tmp_path):
    model_dir = make_random_model(
        tmp_path / "m", "qwen3_moe", num_layers=5, mlp_only_layers=(0, 2, 3)
    )
    store = ExpertStore(convert(model_dir, tmp_path / "s"))
    assert [(s.layer, s.moe_index, s.file) for s in store.manifest.layers] == [
        (1, 0, "layer01.blob"),
        (4, 1, "layer04.blob"),
    ]
    assert sorted(p.name for p in store.path.glob("*.blob")) == ["layer01.blob", "layer04.blob"]
    assert store.layer(4).module == "model.layers.4.mlp.switch_mlp"
    with pytest.raises(KeyError, match="decoder layer 2 is not an MoE layer"):
        store.layer(2)
    dense = store.dense_weights()
    assert "model.layers.2.mlp.gate_proj.weight" in dense
    assert "model.layers.4.mlp.gate.weight" in dense
    original = sanitized_weights(model_dir)
    record = store.read_record(store.layer(4), 6)
    seg = store.layer(4).segments[0]
    assert (
        record[: seg.nbytes]
        == np.asarray(original["model.layers.4.mlp.switch_mlp.gate_proj.weight"][6]).tobytes()
    )
    resident, _ = load_model(model_dir)
    assert mx.array_equal(load_rebuilt(store, tmp_path / "r")(TOKENS), resident(TOKENS)).item()


@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral", "olmoe"])
def test_tied_embeddings_drop_stray_lm_head(tmp_path, model_type):
    model_dir = make_random_model(
        tmp_path / "m", model_type, tie_word_embeddings=True, stray_lm_head=True
    )
    assert "lm_head.scales" in mx.load(str(model_dir / "model.safetensors"))
    store = ExpertStore(convert(model_dir, tmp_path / "s"))
    assert not [k for k in store.dense_weights() if k.startswith("lm_head")]
    resident, _ = load_model(model_dir, strict=False)
    assert mx.array_equal(load_rebuilt(store, tmp_path / "r")(TOKENS), resident(TOKENS)).item()


def test_lm_head_kept_when_the_model_uses_it(tmp_path):
    # qwen2_moe ignores tie_word_embeddings: its lm_head is always used.
    model_dir = make_random_model(tmp_path / "m", "qwen2_moe", tie_word_embeddings=True)
    store = ExpertStore(convert(model_dir, tmp_path / "s"))
    assert {"lm_head.weight", "lm_head.scales"} <= store.dense_weights().keys()


def test_find_experts_walks_the_model():
    for model_type in MODEL_TYPES:
        config = make_config(model_type, num_layers=3, num_experts=6, top_k=3)
        model_class, args_class = _get_classes(config)
        experts = find_experts(model_class(args_class.from_dict(config)))
        assert [e.layer for e in experts] == [0, 1, 2]
        attr = "block_sparse_moe" if model_type == "mixtral" else "mlp"
        assert [e.path for e in experts] == [
            f"model.layers.{i}.{attr}.switch_mlp" for i in range(3)
        ]
        assert {e.num_experts for e in experts} == {6} and {e.kind for e in experts} == {
            "SwitchGLU"
        }
    config = make_config("qwen3_moe", num_layers=6) | {"decoder_sparse_step": 2}
    model_class, args_class = _get_classes(config)
    assert [e.layer for e in find_experts(model_class(args_class.from_dict(config)))] == [1, 3, 5]


def write_config(model_dir, config):
    """`config` beside the weights of a tiny qwen3_moe: convert refuses a directory
    without weights before it builds any model, so a config's own faults need weights."""
    make_random_model(model_dir, "qwen3_moe")
    (model_dir / "config.json").write_text(json.dumps(config))
    return model_dir


@pytest.mark.parametrize(
    ("config", "error", "message"),
    [
        ({"model_type": "nope"}, UnsupportedModelError, "'nope' is not a model mlx-lm implements"),
        ({"hidden_size": 64}, UnsupportedModelError, "model_type is None"),
        ({"model_type": "dbrx"}, UnsupportedModelError, "'dbrx' is not supported: its experts"),
        (
            {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 4},
            ValueError,
            "not a valid llama config.*intermediate_size",
        ),
        (
            make_config("qwen3_moe") | {"num_experts": 0},
            NotMoEError,
            "no layer of this qwen3_moe model has routed experts",
        ),
        (
            {k: v for k, v in make_config("olmoe").items() if k != "num_experts"},
            ValueError,
            "not a valid olmoe config.*num_experts",
        ),
        (
            {k: v for k, v in make_config("qwen3_moe").items() if k != "num_experts_per_tok"},
            ValueError,
            "not a valid qwen3_moe config.*num_experts_per_tok",  # mlx-lm has no default
        ),
        (make_config("mixtral") | {"num_experts_per_tok": 9}, NotMoEError, "expected an int in"),
    ],
)
def test_unsupported_or_not_moe(tmp_path, config, error, message):
    with pytest.raises(error, match=message):
        convert(write_config(tmp_path / "m", config), tmp_path / "s")


def test_a_field_mlx_lm_defaults_may_be_left_out(model_dirs, tmp_path):
    """mixtral's ModelArgs has num_experts_per_tok = 2: a config without it is the model
    mlx-lm runs with 2 experts per token, and so is its store."""
    from engine.model import load

    from test_equality import assert_same, greedy_logits

    model = shutil.copytree(model_dirs("mixtral"), tmp_path / "m")
    config = json.loads((model / "config.json").read_text())
    assert config.pop("num_experts_per_tok") == 2
    (model / "config.json").write_text(json.dumps(config))
    sm = load(model)
    assert sm.store.manifest.top_k == 2
    reference, _ = load_model(model)
    assert_same(greedy_logits(reference), greedy_logits(sm.model))
    assert not (tmp_path / "s").exists()


def test_refuses_model_file_and_bad_config(tmp_path):
    with pytest.raises(ValueError, match="model_file"):
        convert(
            write_config(tmp_path / "a", make_config("olmoe") | {"model_file": "evil.py"}),
            tmp_path / "s",
        )
    (tmp_path / "b").mkdir()
    with pytest.raises(FileNotFoundError, match="config.json"):
        convert(tmp_path / "b", tmp_path / "s")
    (tmp_path / "b" / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"config\.json: invalid JSON"):
        convert(tmp_path / "b", tmp_path / "s")
    (tmp_path / "c").mkdir()  # a config without weights
    (tmp_path / "c" / "config.json").write_text(json.dumps(make_config("olmoe")))
    with pytest.raises(FileNotFoundError, match="safetensors"):
        convert(tmp_path / "c", tmp_path / "s")
    assert not (tmp_path / "s").exists()


def test_existing_store_needs_force(tmp_path):
    first = make_random_model(tmp_path / "a", "olmoe", seed=1)
    second = make_random_model(tmp_path / "b", "olmoe", seed=2)
    dest = convert(first, tmp_path / "s")
    before = ExpertStore(dest).manifest
    with pytest.raises(FileExistsError, match="force"):
        convert(second, dest)
    assert ExpertStore(dest).manifest == before
    convert(second, dest, force=True)
    after = ExpertStore(dest).manifest
    assert after.layers[0].checksums != before.layers[0].checksums
    assert after == ExpertStore(convert(second, tmp_path / "fresh")).manifest
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "notes.txt").write_text("keep me")
    for force in (False, True):
        with pytest.raises(ValueError, match="not an expert store: convert never replaces it"):
            convert(second, precious, force=force)
    assert (precious / "notes.txt").read_text() == "keep me"
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []


def enospc_on(layer_file):
    real = store_writer.write_blob

    def write_blob(path, records, record_bytes, stride, *args):
        if path.name == layer_file:
            path.write_bytes(b"partial")
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return real(path, records, record_bytes, stride, *args)

    return write_blob


def test_interrupted_convert_leaves_nothing(tmp_path, monkeypatch):
    model_dir = make_random_model(tmp_path / "m", "qwen3_moe")
    monkeypatch.setattr(store_writer, "write_blob", enospc_on("layer02.blob"))
    parent = tmp_path / "out"
    parent.mkdir()
    with pytest.raises(OSError) as info:
        convert(model_dir, parent / "store")
    assert info.value.errno == errno.ENOSPC
    assert "No space left on device" in str(info.value)
    assert str(parent / "store") in str(info.value)
    assert list(parent.iterdir()) == []


def test_interrupted_forced_convert_keeps_old_store(tmp_path, monkeypatch):
    old = convert(make_random_model(tmp_path / "a", "mixtral", seed=1), tmp_path / "s")
    manifest = ExpertStore(old).manifest
    monkeypatch.setattr(store_writer, "write_blob", enospc_on("layer02.blob"))
    with pytest.raises(OSError, match="No space left"):
        convert(make_random_model(tmp_path / "b", "mixtral", seed=2), old, force=True)
    assert ExpertStore(old).manifest == manifest
    assert ExpertStore(old).verify() == 32
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_progress_and_aux_files(tmp_path):
    model_dir = make_random_model(tmp_path / "m", "qwen2_moe")
    write_tokenizer(model_dir)
    (model_dir / "generation_config.json").write_text("{}")
    (model_dir / "modeling_custom.py").write_text("raise SystemExit")
    (model_dir / "subdir").mkdir()
    (model_dir / "subdir" / "x.txt").write_text("x")
    calls = []
    store = ExpertStore(
        convert(model_dir, tmp_path / "s", progress=lambda d, t: calls.append((d, t)))
    )
    total = sum(s.record_bytes for s in store.manifest.layers) * store.manifest.num_experts
    assert calls[0] == (0, total) and calls[-1] == (total, total)
    assert len(calls) == len(store.manifest.layers) + 1
    assert [d for d, _ in calls] == sorted(d for d, _ in calls)
    assert sorted(p.name for p in store.path.iterdir() if not p.name.endswith(".blob")) == [
        "config.json",
        "dense.safetensors",
        "generation_config.json",
        "manifest.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    assert (store.path / "config.json").read_bytes() == (model_dir / "config.json").read_bytes()
    assert store.config["model_type"] == "qwen2_moe"


def test_memory_stays_bounded_by_one_layer(tmp_path):
    model_dir = make_random_model(
        tmp_path / "m",
        "mixtral",
        quantized=False,
        num_layers=8,
        hidden=128,
        moe_intermediate=512,
        vocab=64,
    )
    gc.collect()  # models of earlier tests left in reference cycles still hold arrays
    mx.clear_cache()
    mx.reset_peak_memory()
    store = ExpertStore(convert(model_dir, tmp_path / "s"))
    expert_bytes = sum(s.record_bytes for s in store.manifest.layers) * store.manifest.num_experts
    layer_bytes = expert_bytes // len(store.manifest.layers)
    assert mx.get_peak_memory() < 3 * layer_bytes < expert_bytes / 2


@pytest.mark.parametrize("when", ["between the renames", "before the first rename"])
def test_two_forced_converts_racing_both_succeed(tmp_path, monkeypatch, when):
    """Another `convert --force` of the same store installs its own at the worst instant
    (a plain rename then fails with "Directory not empty" or "No such file"): this one
    still installs its store, whole, and leaves nothing behind."""
    model_dir = make_random_model(tmp_path / "m", "qwen3_moe")
    other = convert(model_dir, tmp_path / "other")
    out = tmp_path / "out"
    out.mkdir()
    store = convert(model_dir, out / "store")
    real_rename = os.rename
    raced = []

    def rename(src, dst):
        src, dst = Path(src), Path(dst)
        if not raced and when == "between the renames" and dst == store:
            shutil.copytree(other, store)  # the other writer's store arrives first
            raced.append(src)
        if not raced and when == "before the first rename" and src == store:
            real_rename(store, out / ".store.old-1")  # the other writer moves it aside
            shutil.rmtree(out / ".store.old-1")
            raced.append(src)
        return real_rename(src, dst)

    monkeypatch.setattr(store_writer.os, "rename", rename)
    assert convert(model_dir, store, force=True) == store
    assert raced
    assert ExpertStore(store).verify() > 0
    assert sorted(p.name for p in out.iterdir()) == ["store"]
