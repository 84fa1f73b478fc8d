"""Store validation: every inconsistency is refused with a message naming the file."""

import json
import os
import shutil
import zlib

import mlx.core as mx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.convert import convert
from engine.store import (
    ExpertStore,
    Manifest,
    StoreError,
    is_store,
    layout_segments,
    load_manifest,
    stride_for,
)
from engine.store_writer import StoreWriter

from factories import make_random_model


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    """A converted qwen3_moe store with expert bytes not a multiple of 4096."""
    root = tmp_path_factory.mktemp("store")
    model_dir = make_random_model(root / "model", "qwen3_moe", num_experts=6)
    return convert(model_dir, root / "store")


@pytest.fixture
def store_dir(pristine, tmp_path):
    """A fresh copy of the pristine store, free to damage."""
    return shutil.copytree(pristine, tmp_path / "store")


def read_manifest(store_dir) -> dict:
    return json.loads((store_dir / "manifest.json").read_text())


def write_manifest(store_dir, data) -> None:
    (store_dir / "manifest.json").write_text(json.dumps(data))


def test_pristine_store_is_valid(store_dir):
    store = ExpertStore(store_dir)
    assert is_store(store_dir)
    assert store.verify() == 4 * 6
    spec = store.layer(3)
    assert spec.record_bytes == 4608 and spec.stride == 8192 == stride_for(4608)
    assert store.blob_path(spec) == store_dir / "layer03.blob"
    blob = store.blob_path(spec).read_bytes()
    assert store.read_record(spec, 5) == blob[5 * 8192 : 5 * 8192 + 4608]
    assert zlib.crc32(store.read_record(spec, 2)) == spec.checksums[2]
    dense = store.dense_weights()
    assert isinstance(dense["model.embed_tokens.weight"], mx.array)
    assert not any(".switch_mlp." in k for k in dense)
    with pytest.raises(IndexError):
        store.read_record(spec, 6)
    with pytest.raises(IndexError):
        store.read_record(spec, -1)
    assert load_manifest(store_dir) == store.manifest


def test_truncated_blob(store_dir):
    path = store_dir / "layer02.blob"
    os.truncate(path, path.stat().st_size - 1)
    with pytest.raises(StoreError, match=r"layer02\.blob: truncated"):
        ExpertStore(store_dir)


def test_longer_blob(store_dir):
    with open(store_dir / "layer01.blob", "ab") as f:
        f.write(bytes(4096))
    with pytest.raises(StoreError, match=r"layer01\.blob: size mismatch"):
        ExpertStore(store_dir)


def test_missing_blob(store_dir):
    (store_dir / "layer00.blob").unlink()
    with pytest.raises(StoreError, match=r"layer00\.blob: blob of layer 0 is missing"):
        ExpertStore(store_dir)


@pytest.mark.parametrize("name", ["../x.blob", "/etc/passwd", "sub/layer00.blob", "a\\b", "..", ""])
def test_file_cannot_escape_the_store(store_dir, name):
    data = read_manifest(store_dir)
    data["layers"][0]["file"] = name
    write_manifest(store_dir, data)
    with pytest.raises(StoreError, match=r"manifest\.json: layers\[0\]"):
        ExpertStore(store_dir)


def test_file_must_match_its_layer(store_dir):
    data = read_manifest(store_dir)
    data["layers"][0]["file"] = "layer01.blob"
    write_manifest(store_dir, data)
    with pytest.raises(StoreError, match=r"expected 'layer00\.blob'"):
        ExpertStore(store_dir)


def set_path(data, path, value):
    *parents, last = path
    for key in parents:
        data = data[key]
    data[last] = value


MUTATIONS = [
    (("format",), "other", "format is 'other'"),
    (("version",), 3, "version 3 is not supported"),
    (
        ("version",),
        1,
        r"version 1 is not supported \(this build reads 2\): convert the model again",
    ),
    (("version",), "1", "version is '1', expected an integer"),
    (("checksum",), "md5", "checksum is 'md5'"),
    (("num_experts",), 0, "num_experts is 0, expected >= 1"),
    (("top_k",), 7, "top_k is 7, expected <= 6"),
    (("layers",), [], "layers is empty"),
    (("layers", 0, "stride"), 5000, "stride 5000 is not a multiple of 4096"),
    (("layers", 0, "stride"), 4096, "stride 4096 is smaller than record_bytes 4608"),
    (("layers", 0, "record_bytes"), 4609, "segments sum to 4608 bytes but record_bytes is 4609"),
    (("layers", 0, "segments", 1, "nbytes"), 100, r"segments\[1\]\.nbytes is 100, expected"),
    (("layers", 0, "segments", 2, "offset"), 1, r"segments\[2\]\.offset is 1, expected"),
    (("layers", 0, "segments", 0, "dtype"), "float8", "'float8' is not a storable dtype"),
    # MLX has float64, but the native pools cannot hold it: refused here, not at open.
    (("layers", 0, "segments", 0, "dtype"), "float64", "'float64' is not a storable dtype"),
    (("layers", 0, "segments", 0, "key"), "gate_proj.qweight", "is not a segment key"),
    (("layers", 0, "segments", 3, "key"), "gate_proj.weight", "out of order or repeated"),
    (
        ("layers", 0, "segments", 0, "shape"),
        [-1, 8],
        r"not a list of integers in \[0, 2147483647\]",
    ),
    (
        ("layers", 0, "segments", 0, "shape"),
        [2**31, 8],
        r"not a list of integers in \[0, 2147483647\]",
    ),
    # Sizes bounded by what the format allows: a stride is the record rounded up to 4096,
    # never more (a stride of 2**31 once allocated accordingly), counts and bits bounded.
    (("layers", 0, "stride"), 2**31, r"stride 2147483648 is not record_bytes 4608 rounded up"),
    (("layers", 0, "stride"), 8192 + 4096, r"stride 12288 is not record_bytes 4608 rounded up"),
    (("num_experts",), 2**31, r"num_experts is 2147483648, expected <= 65536"),
    (("num_hidden_layers",), 10**6, r"num_hidden_layers is 1000000, expected <= 4096"),
    (("layers", 0, "quantization", "up_proj", "bits"), 2**31, r"bits is 2147483648, expected <= 8"),
    (("layers", 0, "quantization", "up_proj", "group_size"), 0, r"group_size is 0, expected >= 1"),
    (("dense_bytes",), 5, r"dense_bytes is 5, expected >= 8"),
    (("dense_crc32",), 2**32, r"dense_crc32 is 4294967296, expected <= 4294967295"),
    (("dense_crc32",), None, r"dense_crc32 is None, expected an integer"),
    (("layers", 0, "checksums"), [0, 1], "checksums has 2 entries, expected 6"),
    (("layers", 0, "checksums", 0), -1, "not crc32 integers"),
    (("layers", 0, "moe_index"), 3, r"layers\[0\]\.moe_index is 3, expected 0"),
    (("layers", 3, "layer"), 4, "layer is 4, expected <= 3"),
    (
        ("layers", 0, "module"),
        "model.layers.1.mlp.switch_mlp",
        "is not a module of decoder layer 0",
    ),
    (
        ("layers", 0, "quantization", "up_proj"),
        None,
        "up_proj: is null but the projection has scales",
    ),
    (("layers", 0, "quantization", "up_proj", "bits"), "4", "bits is '4', expected an integer"),
    (("layers", 0, "quantization", "w9"), None, "unknown keys"),
    # a mode MLX has no kernels for is refused when the store opens, not at the first matmul
    (
        ("layers", 0, "quantization", "up_proj", "mode"),
        "fp3",
        r"quantization\.up_proj: mode 'fp3' is not one of affine, mxfp4, mxfp8, nvfp4",
    ),
]


@pytest.mark.parametrize(
    ("path", "value", "message"),
    MUTATIONS,
    ids=[".".join(map(str, path)) + f"={value!r}" for path, value, _ in MUTATIONS],
)
def test_manifest_field_errors(store_dir, path, value, message):
    data = read_manifest(store_dir)
    set_path(data, path, value)
    write_manifest(store_dir, data)
    with pytest.raises(StoreError, match=message) as info:
        ExpertStore(store_dir)
    assert str(store_dir / "manifest.json") in str(info.value)


def test_layers_must_increase(store_dir):
    data = read_manifest(store_dir)
    data["layers"][1] = data["layers"][0] | {"moe_index": 1}
    write_manifest(store_dir, data)
    with pytest.raises(StoreError, match=r"layers\[1\]\.layer 0 is not after 0"):
        ExpertStore(store_dir)


def test_missing_quantization_entry(store_dir):
    data = read_manifest(store_dir)
    del data["layers"][0]["quantization"]["down_proj"]
    write_manifest(store_dir, data)
    with pytest.raises(StoreError, match="quantization lacks 'down_proj'"):
        ExpertStore(store_dir)


@pytest.mark.parametrize("name", ["manifest.json", "dense.safetensors", "config.json"])
def test_missing_store_files(store_dir, name):
    (store_dir / name).unlink()
    assert is_store(store_dir) == (name != "manifest.json")
    with pytest.raises(StoreError, match=rf"{name}: missing"):
        ExpertStore(store_dir)


def test_config_model_type_must_match(store_dir):
    config = json.loads((store_dir / "config.json").read_text())
    (store_dir / "config.json").write_text(json.dumps(config | {"model_type": "mixtral"}))
    with pytest.raises(StoreError, match=r"config\.json: model_type 'mixtral' does not match"):
        ExpertStore(store_dir)


def test_unreadable_manifest(store_dir):
    (store_dir / "manifest.json").write_text("[1, 2")
    assert not is_store(store_dir)
    with pytest.raises(StoreError, match=r"manifest\.json: invalid JSON"):
        ExpertStore(store_dir)
    (store_dir / "manifest.json").write_text("[]")
    with pytest.raises(StoreError, match="not a JSON object"):
        ExpertStore(store_dir)


def test_is_store_on_other_paths(tmp_path):
    assert not is_store(tmp_path)
    assert not is_store(tmp_path / "absent")
    (tmp_path / "manifest.json").write_text('{"format": "something-else"}')
    assert not is_store(tmp_path)


def flip_byte(path, offset):
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x01]))


def test_verify_names_the_corrupt_record(store_dir):
    store = ExpertStore(store_dir)
    flip_byte(store_dir / "layer02.blob", 4 * 8192 + 100)
    assert store.verify(layers=[0, 1, 3]) == 18
    with pytest.raises(StoreError, match=r"layer02\.blob: layer 2 expert 4: crc32"):
        store.verify()


def test_verify_checks_padding(store_dir):
    store = ExpertStore(store_dir)
    flip_byte(store_dir / "layer01.blob", 3 * 8192 + 5000)
    with pytest.raises(StoreError, match=r"layer01\.blob: layer 1 expert 3: padding is not zero"):
        store.verify()


def test_verify_unknown_layer(store_dir):
    with pytest.raises(KeyError, match="decoder layer 9"):
        ExpertStore(store_dir).verify(layers=[9])


INT_FIELDS = [
    ("record_bytes",),
    ("stride",),
    ("moe_index",),
    ("layer",),
    ("segments", 0, "nbytes"),
    ("segments", 0, "offset"),
    ("segments", 4, "offset"),
    ("segments", 8, "nbytes"),
    ("segments", 5, "shape", 1),
]


@settings(max_examples=80, deadline=None)
@given(
    layer=st.integers(0, 3),
    field=st.sampled_from(INT_FIELDS),
    delta=st.integers(-9000, 9000).filter(lambda d: d != 0),
)
def test_any_layout_integer_change_is_refused(pristine, layer, field, delta):
    data = read_manifest(pristine)
    Manifest.from_json(data, pristine)
    *parents, last = field
    target = data["layers"][layer]
    for key in parents:
        target = target[key]
    target[last] += delta
    with pytest.raises(StoreError, match=r"manifest\.json|\.blob"):
        Manifest.from_json(data, pristine)


def write_tiny(out, records_of_layer):
    """A two-expert store with one uint8 (3,) segment per record, through StoreWriter."""
    with StoreWriter(out, num_experts=2) as writer:
        writer.write_dense({"norm.weight": mx.ones((3,))})
        (writer.path / "config.json").write_text('{"model_type": "qwen3_moe"}')
        segments = layout_segments([("gate_proj.weight", "uint8", (3,))])
        for layer in (1, 4):
            module = f"model.layers.{layer}.mlp.switch_mlp"
            quantization = {"gate_proj": None}
            writer.write_layer(layer, module, segments, quantization, records_of_layer(layer))
        return writer.finish("qwen3_moe", top_k=1, num_hidden_layers=5)


def test_store_writer_writes_a_valid_store(tmp_path):
    out = write_tiny(tmp_path / "s", lambda li: [[bytes([li, e, 7])] for e in range(2)])
    store = ExpertStore(out)
    assert [(s.layer, s.moe_index, s.stride) for s in store.manifest.layers] == [
        (1, 0, 4096),
        (4, 1, 4096),
    ]
    assert store.read_record(store.layer(4), 1) == bytes([4, 1, 7])
    assert store.verify() == 4
    assert [p.name for p in tmp_path.iterdir()] == ["s"]


def test_store_writer_leaves_nothing_on_a_bad_record(tmp_path):
    with pytest.raises(ValueError, match="record 1 has 2 bytes, expected 3"):
        write_tiny(tmp_path / "s", lambda li: [[b"abc"], [b"ab"]])
    with pytest.raises(ValueError, match="layer 1: 1 records, expected 2"):
        write_tiny(tmp_path / "s", lambda li: [[b"abc"]])
    assert list(tmp_path.iterdir()) == []
