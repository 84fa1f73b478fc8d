"""Bad input: each case gives a clear error (naming the file at fault) and leaves nothing
half-written.

Already covered elsewhere, not repeated here: a truncated, longer or missing blob and
every inconsistent manifest field, strides included (test_store.py); an unsupported
model type, configs without experts, `model_file`, invalid config JSON and missing
weights, and ENOSPC injected into a blob write, fresh and forced (test_convert.py).
"""

import gc
import json
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.utils import load_model

from engine.cache import ExpertReadError, open_cache
from engine.cli import main
from engine.config import StreamConfig
from engine.convert import convert
from engine.experts import NotMoEError, UnsupportedModelError
from engine.generate import generate, stream_generate
from engine.model import load, store_cache_dir
from engine.store import ExpertStore, StoreError

from factories import make_mixed_quant_model, make_random_model, write_tokenizer
from rowcheck import RowChecker

NOBODY = 65534


@pytest.fixture
def store_dir(qwen_store, tmp_path):
    """A copy of the session's qwen3_moe store (4 MoE layers, 8 experts, top-2)."""
    return Path(shutil.copytree(qwen_store.path, tmp_path / "store"))


def cli(capsys, *argv) -> tuple[int, str]:
    code = main(list(argv))
    return code, capsys.readouterr().err


# ---- blobs that change under a loaded model ------------------------------------------


def test_blob_truncated_after_validation(store_dir):
    store = ExpertStore(store_dir)
    os.truncate(store_dir / "layer01.blob", 4096)
    with pytest.raises(ExpertReadError, match=r"layer01\.blob: truncated: 4096 bytes"):
        open_cache(store, StreamConfig(expert_slots=2))


def test_blob_truncated_under_a_running_model(store_dir):
    """An interrupted copy over a loaded store: every read of the file fails as a short
    read naming file, layer and expert, never zeros; rows already mapped stay intact."""
    sm = load(store_dir, StreamConfig(expert_slots=2))
    prompt = mx.array([[3, 17, 42, 5, 99]])
    mx.eval(sm.model(prompt))
    checker = RowChecker(sm.store, sm.cache)  # reads the records before the damage
    os.truncate(store_dir / "layer02.blob", 0)
    sm.cache.reset()
    with pytest.raises(ExpertReadError, match=r"layer02\.blob \(layer 2, expert \d+\): short read"):
        sm.model(prompt)
    sm.cache.drain()
    assert sm.cache.check() == "" and sm.cache.inflight == 0
    checker.assert_all_published()
    assert (sm.cache.snapshot(2)["slot_expert"] == -1).all()
    with pytest.raises(StoreError, match=r"layer02\.blob: truncated"):
        load(store_dir)


def test_truncated_dense_weights(store_dir):
    path = store_dir / "dense.safetensors"
    os.truncate(path, path.stat().st_size - 1)
    size = r"dense\.safetensors: \d+ bytes, but the manifest's dense_bytes is \d+"
    with pytest.raises(StoreError, match=size):
        load(store_dir)
    path.write_bytes(b"\x80\x04not safetensors")  # e.g. a pickle under the expected name
    with pytest.raises(StoreError, match=size):
        load(store_dir)


# ---- a store that is not the model's --------------------------------------------------

DIFFERENT = [
    ({"moe_intermediate": 64}, r"segment gate_proj\.weight is uint32 \[32, 8\] but the model"),
    ({"hidden": 128}, r"hidden_size is 128 but model\.norm\.weight in .*has shape \[64\]"),
    ({"num_experts": 16}, r"num_experts is 8 but config\.json says 16"),
    ({"top_k": 3}, r"top_k is 2 but config\.json says 3"),
    ({"num_layers": 6}, r"num_hidden_layers is 6 but .*dense\.safetensors holds layers 0-3"),
    ({"mlp_only_layers": (2,)}, r"MoE layers \[0, 1, 2, 3\] do not match the model's \[0, 1, 3\]"),
]


@pytest.mark.parametrize(("options", "message"), DIFFERENT, ids=[str(o) for o, _ in DIFFERENT])
def test_store_of_a_different_model(store_dir, model_dirs, options, message):
    """Another model's config.json in the store: refused before any expert is read."""
    shutil.copyfile(model_dirs("qwen3_moe", **options) / "config.json", store_dir / "config.json")
    with pytest.raises(StoreError, match=message) as info:
        load(store_dir, StreamConfig(expert_slots=2))
    assert "of a different model?" in str(info.value)
    assert str(store_dir) in str(info.value)


def test_segment_shape_that_fits_the_blob_but_not_the_model(store_dir):
    """A transposed per-expert shape keeps every size, stride and offset consistent with
    the blob (the store validates) but is not the model's parameter: refused at load."""
    manifest = json.loads((store_dir / "manifest.json").read_text())
    seg = manifest["layers"][1]["segments"][0]
    assert seg["key"] == "gate_proj.weight" and seg["shape"] == [32, 8]
    seg["shape"] = [8, 32]
    (store_dir / "manifest.json").write_text(json.dumps(manifest))
    ExpertStore(store_dir)
    with pytest.raises(
        StoreError,
        match=r"manifest\.json: layers\[1\] \(layer01\.blob\): segment gate_proj\.weight is "
        r"uint32 \[8, 32\] but the model of config\.json needs uint32 \[32, 8\]",
    ):
        load(store_dir)


def test_mixed_quantization_store_matches_its_model(tmp_path):
    """The shape check follows each projection's own quantization (8-bit up_proj in one
    layer, 4-bit elsewhere): such a store loads and computes like mlx-lm."""
    mixed = make_mixed_quant_model(tmp_path)
    sm = load(convert(mixed, tmp_path / "s"), StreamConfig(expert_slots=3))
    tokens = mx.array([[1, 2, 3, 4, 5, 6]])
    resident, _ = load_model(mixed)
    assert np.array_equal(np.array(resident(tokens)), np.array(sm.model(tokens)))


# ---- models that are not supported MoE models -----------------------------------------


def write_config_dir(directory: Path, config: dict) -> Path:
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def test_unknown_model_type_through_load(tmp_path):
    config = {"model_type": "nope", "hidden_size": 64, "num_hidden_layers": 2}
    with pytest.raises(UnsupportedModelError, match=r"'nope' is not a model mlx-lm implements"):
        load(write_config_dir(tmp_path / "m", config))
    with pytest.raises(UnsupportedModelError, match=r"'dbrx' is not supported: its experts are"):
        load(write_config_dir(tmp_path / "d", {"model_type": "dbrx"}))


def test_unknown_model_type_in_a_store(store_dir):
    for name in ("manifest.json", "config.json"):
        data = json.loads((store_dir / name).read_text())
        (store_dir / name).write_text(json.dumps(data | {"model_type": "nope"}))
    with pytest.raises(UnsupportedModelError, match="'nope' is not a model mlx-lm implements"):
        load(store_dir)


def test_config_without_experts_through_load(tmp_path):
    """A real checkpoint whose config.json says 0 experts: refused as not MoE (a config
    without any weights is refused earlier, for its missing weights)."""
    model_dir = make_random_model(tmp_path / "m", "qwen3_moe")
    config = json.loads((model_dir / "config.json").read_text()) | {"num_experts": 0}
    (model_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(NotMoEError, match="no layer of this qwen3_moe model has routed experts"):
        load(model_dir)


def test_moe_type_whose_layers_are_all_dense(tmp_path):
    """qwen3_moe with every layer in mlp_only_layers has no routed experts: refused, and
    no (empty, invalid) store is written, neither by convert nor into load's cache."""
    model_dir = make_random_model(tmp_path / "m", "qwen3_moe", mlp_only_layers=(0, 1, 2, 3))
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(NotMoEError, match=r"config\.json: no layer of this qwen3_moe model"):
        convert(model_dir, out / "store")
    assert list(out.iterdir()) == []
    before = set(store_cache_dir().iterdir()) if store_cache_dir().exists() else set()
    with pytest.raises(NotMoEError):
        load(model_dir)
    assert set(store_cache_dir().iterdir()) == before


def test_model_dir_config_is_not_json(tmp_path):
    model_dir = write_config_dir(tmp_path / "m", {})
    (model_dir / "config.json").write_text("{oops")
    with pytest.raises(ValueError, match=r"m/config\.json: invalid JSON"):
        load(model_dir)


# ---- tokenizer -----------------------------------------------------------------------


def test_missing_tokenizer_cli(capsys, store_dir):
    code, err = cli(capsys, "generate", "--model", str(store_dir), "--prompt", "The cat")
    assert code == 2
    assert f"expertstream generate: error: {store_dir} has no tokenizer files" in err
    assert "Traceback" not in err


def test_tokenizer_config_without_vocabulary(capsys, store_dir):
    (store_dir / "tokenizer_config.json").write_text("{}")
    with pytest.raises(StoreError, match=r"the tokenizer has no vocabulary"):
        load(store_dir)
    code, err = cli(capsys, "generate", "--model", str(store_dir))
    assert code == 2 and "the tokenizer has no vocabulary" in err


def test_corrupt_tokenizer_json(store_dir):
    write_tokenizer(store_dir)
    (store_dir / "tokenizer.json").write_text('{"version": ')
    with pytest.raises(StoreError, match=r"cannot load the tokenizer \(JSONDecodeError"):
        load(store_dir)


def test_a_tokenizer_past_the_models_vocabulary_is_refused_by_convert(capsys, model_dirs, tmp_path):
    """A tokenizer whose ids run past vocab_size (here 128) would fail every generate:
    convert refuses it naming tokenizer.json and writes nothing; a store holding one
    (copied in after the convert) is refused at load the same way."""
    model_dir = Path(shutil.copytree(model_dirs("qwen3_moe"), tmp_path / "model"))
    write_tokenizer(model_dir)
    good = json.loads((model_dir / "tokenizer.json").read_text())
    wide = json.loads(json.dumps(good))
    wide["model"]["vocab"]["The"] = 500
    (model_dir / "tokenizer.json").write_text(json.dumps(wide))
    message = (
        f"{model_dir / 'tokenizer.json'}: token ids run to 500, past the model's vocabulary "
        "of 128 (vocab_size in config.json): this tokenizer is not the model's"
    )
    code, err = cli(capsys, "convert", str(model_dir), str(tmp_path / "store"))
    assert code == 2 and err.count("\n") == 1 and err.endswith(f"nothing was written: {message}\n")
    assert not (tmp_path / "store").exists()
    (model_dir / "tokenizer.json").write_text(json.dumps(good))
    convert(model_dir, tmp_path / "store")
    (tmp_path / "store" / "tokenizer.json").write_text(json.dumps(wide))
    with pytest.raises(StoreError, match=r"store/tokenizer\.json: token ids run to 500"):
        load(tmp_path / "store")


def test_working_tokenizer_cli(capsys, store_dir):
    write_tokenizer(store_dir)
    argv = ["generate", "--model", str(store_dir), "--prompt", "The cat sat"]
    code = main([*argv, "--max-tokens", "3", "--json", "--expert-slots", "2"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and len(out["tokens"]) == 3 and out["stats"]["prompt_tokens"] == 3


# ---- context --------------------------------------------------------------------------


def test_prompt_longer_than_the_context(store_dir, capsys):
    write_tokenizer(store_dir)
    sm = load(store_dir, StreamConfig(expert_slots=2))
    message = r"prompt \(510 tokens\) \+ max_tokens \(10\) exceeds the model's context of 512"
    with pytest.raises(ValueError, match=message):
        generate(sm, [1] * 510, max_tokens=10)
    with pytest.raises(ValueError, match=r"prompt \(513 tokens\)"):
        next(stream_generate(sm, [1] * 513, max_tokens=1))
    assert sm.snapshot().totals()["loads"] == 0  # refused before any forward
    assert len(generate(sm, [1] * 500, max_tokens=12).tokens) == 12  # exactly fits

    prompt = " ".join(["cat"] * 600)
    code, err = cli(capsys, "generate", "--model", str(store_dir), "--prompt", prompt)
    assert code == 2
    assert (
        "the prompt (600 tokens) + --max-tokens (64) exceeds the model's context of 512 "
        "tokens: shorten the prompt"
    ) in err
    prompt = " ".join(["cat"] * 500)
    argv = ["generate", "--model", str(store_dir), "--prompt", prompt, "--max-tokens", "20"]
    code, err = cli(capsys, *argv)
    assert code == 2 and "context of 512 tokens: give --max-tokens 12 or less" in err


# ---- permissions ------------------------------------------------------------------------


def run_unprivileged(fn, timeout=60.0) -> str | None:
    """Runs fn() where file permissions apply and returns what it raised as
    "TypeName: message" (None if nothing). Root ignores permissions, so as root fn runs in
    a forked child that has dropped to `nobody` (it only touches files: no MLX evaluation
    happens before the errors expected here)."""
    if os.geteuid() != 0:
        try:
            fn()
        except Exception as e:
            return f"{type(e).__name__}: {e}"
        return None
    r, w = os.pipe()
    # The child's collector must not walk objects other threads (the app's engine thread,
    # Qt's) were changing at the fork: once, under load, it crashed the child.
    gc.freeze()
    pid = os.fork()
    if pid:
        gc.unfreeze()
    if pid == 0:
        try:
            os.close(r)
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            try:
                fn()
                msg = ""
            except BaseException as e:
                msg = f"{type(e).__name__}: {e}"
            os.write(w, msg.encode()[:60000])
        finally:
            os._exit(0)
    os.close(w)
    deadline = time.monotonic() + timeout
    while os.waitpid(pid, os.WNOHANG) == (0, 0):
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            pytest.fail("the unprivileged child did not finish")
        time.sleep(0.02)
    with os.fdopen(r, "rb") as f:
        return f.read().decode() or None


@pytest.fixture
def shared_dir(qwen_store, model_dirs):
    """A world-readable directory with a copy of a store and of a model directory (pytest's
    tmp_path is private to root, so `nobody` could not reach anything in it)."""
    base = Path(tempfile.mkdtemp(prefix="es-perm-"))
    shutil.copytree(qwen_store.path, base / "store")
    shutil.copytree(model_dirs("qwen3_moe"), base / "model")
    for d in (base, base / "store", base / "model"):
        d.chmod(0o755)
        for f in d.iterdir():
            if f.is_file():
                f.chmod(0o644)
    yield base
    for d, _, files in os.walk(base):
        os.chmod(d, 0o755)
        for f in files:
            os.chmod(os.path.join(d, f), 0o644)
    shutil.rmtree(base)


DENIED = r"PermissionError: \[Errno 13\] cannot read the directory \(permission denied\)"
UNREADABLE = [
    ("store", "", DENIED + r": '{store}'"),
    ("store", "manifest.json", r"StoreError: {store}/manifest\.json: cannot read \(Permission"),
    ("store", "config.json", r"StoreError: {store}/config\.json: cannot read \(Permission"),
    ("store", "layer01.blob", r"ExpertReadError: {store}/layer01\.blob: cannot open: Permission"),
    ("store", "dense.safetensors", r"StoreError: {store}/dense\.safetensors: cannot load"),
    ("model", "", DENIED + r": '{model}'"),
]


@pytest.mark.parametrize(
    ("which", "name", "message"), UNREADABLE, ids=[f"{w}/{n}" for w, n, _ in UNREADABLE]
)
def test_unreadable_path_through_load(shared_dir, monkeypatch, which, name, message):
    target = shared_dir / which / name if name else shared_dir / which
    target.chmod(0)
    cache = shared_dir / "cache"
    monkeypatch.setenv("EXPERTSTREAM_CACHE", str(cache))
    got = run_unprivileged(lambda: load(shared_dir / which, StreamConfig(expert_slots=2)))
    paths = {w: re.escape(str(shared_dir / w)) for w in ("store", "model")}
    want = message.format(**paths)
    assert got and re.match(want, got), got
    assert not cache.exists()  # nothing converted or written


def test_unreadable_model_dir_and_unwritable_destination_for_convert(shared_dir):
    (shared_dir / "model" / "config.json").chmod(0)
    got = run_unprivileged(lambda: convert(shared_dir / "model", shared_dir / "out"))
    config = shared_dir / "model" / "config.json"
    assert got == f"PermissionError: [Errno 13] Permission denied: '{config}'"
    (shared_dir / "model" / "config.json").chmod(0o644)
    readonly = shared_dir / "ro"
    readonly.mkdir(mode=0o555)
    readonly.chmod(0o555)
    got = run_unprivileged(lambda: convert(shared_dir / "model", readonly / "store"))
    assert got.startswith(
        f"PermissionError: [Errno 13] converting {shared_dir / 'model'} into {readonly / 'store'} "
        "failed, nothing was written: Permission denied"
    ), got
    assert list(readonly.iterdir()) == [] and not (shared_dir / "out").exists()


# ---- full disk during convert ------------------------------------------------------------


@pytest.fixture
def small_tmpfs(tmp_path):
    """mount(size) -> a fresh tmpfs of `size` at a temporary mount point (root only)."""
    mounted = []

    def mount(size: str) -> Path:
        point = tmp_path / f"tmpfs{len(mounted)}"
        point.mkdir()
        command = ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(point)]
        r = subprocess.run(command, capture_output=True, text=True)
        if r.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
        mounted.append(point)
        return point

    yield mount
    for point in mounted:
        subprocess.run(["umount", str(point)], check=True)


# The store needs ~330 KB: 32 KB fill up in dense.safetensors (written by MLX), 200 KB in a
# blob (written by convert).
DISK_FULL = [
    ("32k", r"cannot write dense\.safetensors \(\[write\] Unable to write \d+ bytes to file"),
    ("200k", r"\[Errno 28\] .*No space left on device"),
]


@pytest.mark.skipif(sys.platform != "linux", reason="tmpfs is Linux")
@pytest.mark.parametrize(("size", "message"), DISK_FULL)
def test_disk_full_during_convert(small_tmpfs, model_dirs, capsys, size, message):
    disk = small_tmpfs(size)
    with pytest.raises(OSError, match=message) as info:
        convert(model_dirs("qwen3_moe"), disk / "store")
    assert f"into {disk / 'store'} failed, nothing was written" in str(info.value)
    assert list(disk.iterdir()) == []
    assert shutil.disk_usage(disk).used == 0
    code, err = cli(capsys, "convert", str(model_dirs("qwen3_moe")), str(disk / "store"))
    assert code == 2 and "nothing was written" in err and "Traceback" not in err
    assert list(disk.iterdir()) == []


@pytest.mark.parametrize(
    ("limit", "message"),
    [(20_000, r"cannot write dense\.safetensors"), (64_000, r"\[Errno 27\] .*File too large")],
)
def test_file_size_limit_during_convert(tmp_path, model_dirs, limit, message):
    """RLIMIT_FSIZE: a kernel-enforced size limit on every file written (works unprivileged;
    dense.safetensors is ~62 KB, each blob 64 KB)."""
    old_limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, old_limit[1]))
    try:
        with pytest.raises(OSError, match=message):
            convert(model_dirs("qwen3_moe"), tmp_path / "store")
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, old_limit)
        signal.signal(signal.SIGXFSZ, old_handler)
    assert sorted(p.name for p in tmp_path.iterdir()) == []
