"""Hostile files in stores and model directories: each kind
ends in one error naming the file and the field, never a hang, a flood of memory, a
traceback or a file from outside the model directory in a store.

Kinds: files that are not regular files (a FIFO blocks an open for reading forever, a
device such as /dev/zero never ends), files too large for their kind, config.json values
of the wrong type, zero, negative or absurd, configs that disagree with the weights
present, JSON nested too deeply, chat templates that do not compile or render, links out
of a model directory.
"""

import json
import os
import re
import shutil
import threading
from pathlib import Path

import mlx.core as mx
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from engine.cli import main
from engine.config import StreamConfig
from engine.convert import convert
from engine.model import load
from engine.safe_io import MAX_JSON_BYTES, ModelFileError
from engine.store import ExpertStore, StoreError
from engine.store_cache import store_cache_dir

SLOTS = StreamConfig(expert_slots=2)


def write_tokenizer(directory: Path, **config) -> None:
    vocab = {"[UNK]": 0, "The": 1, "cat": 2, "sat": 3}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(directory / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast"} | config
    (directory / "tokenizer_config.json").write_text(json.dumps(config))


@pytest.fixture
def store_dir(qwen_store, tmp_path):
    path = Path(shutil.copytree(qwen_store.path, tmp_path / "store"))
    write_tokenizer(path)
    return path


@pytest.fixture
def model_dir(model_dirs, tmp_path):
    path = Path(shutil.copytree(model_dirs("qwen3_moe"), tmp_path / "model"))
    write_tokenizer(path)
    return path


def finishes(fn, fifos=(), timeout: float = 30.0):
    """fn()'s result or exception, failing the test if it has not returned within
    `timeout` (then the FIFOs are opened for writing, which unblocks a reader)."""
    out = {}

    def run():
        try:
            out["value"] = fn()
        except BaseException as e:  # noqa: BLE001  (handed to the test)
            out["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout)
    if t.is_alive():
        for fifo in fifos:
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        t.join(timeout)
        pytest.fail(f"blocked for more than {timeout} s")
    if "error" in out:
        raise out["error"]
    return out.get("value")


def cli_error(capsys, *argv) -> str:
    """The one line `expertstream ...` prints for a refused input (exit code 2)."""
    code = main(list(argv))
    err = capsys.readouterr().err
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"expertstream {argv[0]}: error: "), err
    return lines[0]


# ---- files that are not regular files (FIFOs, devices) ------------------------------

STORE_FILES = [
    "manifest.json",
    "config.json",
    "dense.safetensors",
    "layer01.blob",
    "tokenizer.json",
    "tokenizer_config.json",
]


@pytest.mark.parametrize("name", STORE_FILES)
@pytest.mark.parametrize("kind", ["fifo", "/dev/zero"])
def test_store_file_that_is_not_regular(store_dir, name, kind):
    path = store_dir / name
    path.unlink()
    if kind == "fifo":
        os.mkfifo(path)
        what = "a FIFO"
    else:
        path.symlink_to(kind)
        what = "a character device"
    with pytest.raises(StoreError, match=rf"{name}: is {what}, not a regular file"):
        finishes(lambda: load(store_dir, SLOTS), [path] if kind == "fifo" else [])


def test_autopin_file_that_is_a_fifo(store_dir):
    """The pin file is read at load with autopin on: a FIFO there is refused, unread."""
    os.mkfifo(store_dir / "autopin.json")
    with pytest.raises(StoreError, match=r"autopin\.json: is a FIFO"):
        finishes(lambda: load(store_dir, SLOTS.replace(autopin_frac=0.5)))


@pytest.mark.parametrize("name", ["config.json", "model.safetensors"])
@pytest.mark.parametrize("kind", ["fifo", "/dev/zero"])
def test_model_dir_file_that_is_not_regular(model_dir, tmp_path, name, kind):
    """Through load (which hashes the model directory first) and through convert."""
    path = model_dir / name
    path.unlink()
    os.mkfifo(path) if kind == "fifo" else path.symlink_to(kind)
    message = rf"{name}: (is a FIFO, not a regular file|is a character device|a link to /dev/zero)"
    fifos = [path] if kind == "fifo" else []
    with pytest.raises(ModelFileError, match=message):
        finishes(lambda: load(model_dir, SLOTS), fifos)
    with pytest.raises(ModelFileError, match=message):
        finishes(lambda: convert(model_dir, tmp_path / "store"), fifos)
    assert not (tmp_path / "store").exists()


def test_extra_files_that_are_not_regular_are_not_copied(model_dir, tmp_path):
    """A FIFO or device among the tokenizer and other files is skipped, never opened."""
    os.mkfifo(model_dir / "notes.txt")
    (model_dir / "special_tokens_map.json").symlink_to("/dev/zero")
    store = finishes(lambda: ExpertStore(convert(model_dir, tmp_path / "store")))
    names = {p.name for p in store.path.iterdir()}
    assert "notes.txt" not in names and "special_tokens_map.json" not in names
    assert {"tokenizer.json", "tokenizer_config.json", "config.json"} <= names
    finishes(lambda: load(model_dir, SLOTS))  # content hashing skips them too


# ---- sizes bounded by what the file and format allow ---------------------------------


@pytest.mark.parametrize("name", ["manifest.json", "config.json"])
def test_json_larger_than_its_kind_allows(store_dir, name):
    """A (sparse) JSON file of more than 64 MiB is refused after reading at most that."""
    os.truncate(store_dir / name, MAX_JSON_BYTES + 1)
    with pytest.raises(StoreError, match=rf"{name}: more than {MAX_JSON_BYTES} bytes"):
        load(store_dir, SLOTS)


def test_safetensors_header_length_beyond_the_file(model_dir, tmp_path):
    path = model_dir / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[:8] = (2**62).to_bytes(8, "little")
    path.write_bytes(bytes(data))
    with pytest.raises(ModelFileError, match=r"header length 4611686018427387904 does not fit"):
        convert(model_dir, tmp_path / "store")


# ---- config.json values ---------------------------------------------------------------

INT_RANGE = r"expected an integer in \[{}, {}\]"
CONFIGS = [
    ({"hidden_size": "256"}, r'hidden_size is "256", ' + INT_RANGE.format(1, 65536)),
    ({"hidden_size": 0}, r"hidden_size is 0, " + INT_RANGE.format(1, 65536)),
    ({"hidden_size": None}, r"hidden_size is null, "),
    ({"hidden_size": -64}, r"hidden_size is -64, "),
    ({"hidden_size": 64.0}, r"hidden_size is 64.0, "),
    ({"hidden_size": True}, r"hidden_size is true, "),
    ({"num_attention_heads": 0}, r"num_attention_heads is 0, "),
    ({"num_key_value_heads": 3}, r"num_key_value_heads is 3, expected a divisor of"),
    ({"head_dim": 0}, r"head_dim is 0, "),
    ({"moe_intermediate_size": [32]}, r"moe_intermediate_size is \[32\], "),
    ({"vocab_size": 0}, r"vocab_size is 0, "),
    ({"vocab_size": 10**12}, r"vocab_size is 1000000000000, " + INT_RANGE.format(1, 2**24)),
    ({"vocab_size": 4096}, r"vocab_size is 4096 but model\.embed_tokens\.weight .* 128 rows"),
    ({"num_hidden_layers": 10**6}, r"num_hidden_layers is 1000000, "),
    ({"num_hidden_layers": 0}, r"num_hidden_layers is 0, "),
    ({"num_hidden_layers": 3}, r"num_hidden_layers is 3 but .* holds layers 0-3"),
    ({"num_hidden_layers": 4000}, r"num_hidden_layers is 4000 but .* holds layers 0-3"),
    ({"max_position_embeddings": -1}, r"max_position_embeddings is -1, "),
    ({"rope_theta": 0}, r"rope_theta is 0, expected a finite number > 0"),
    ({"rope_theta": -10000.0}, r"rope_theta is -10000.0, expected a finite number > 0"),
    ({"rope_theta": float("inf")}, r"rope_theta is Infinity, expected a finite number"),
    ({"rope_theta": "1e4"}, r'rope_theta is "1e4", expected a finite number'),
    ({"rms_norm_eps": -1e-6}, r"rms_norm_eps is -1e-06, expected a finite number >= 0"),
    ({"tie_word_embeddings": "no"}, r'tie_word_embeddings is "no", expected true or false'),
    ({"mlp_only_layers": [9]}, r"mlp_only_layers is \[9\], expected a list of layer indices"),
    ({"quantization": {}}, r"quantization\.group_size is missing, "),
    ({"quantization": []}, r"quantization is \[\], expected an object"),
    ({"quantization": {"group_size": 32, "bits": 2**31}}, r"quantization\.bits is 2147483648, "),
    ({"quantization": {"group_size": 0, "bits": 4}}, r"quantization\.group_size is 0, "),
    (
        {"quantization": {"group_size": 32, "bits": 4, "model.embed_tokens": 7}},
        r"quantization\['model\.embed_tokens'\] is 7, expected an object or a bool",
    ),
]


def patch_config(directory: Path, patch) -> None:
    path = directory / "config.json"
    config = json.loads(path.read_text())
    path.write_text(json.dumps(config | patch if isinstance(patch, dict) else patch))


@pytest.mark.parametrize(("patch", "message"), CONFIGS, ids=[str(p) for p, _ in CONFIGS])
def test_config_values_in_a_store(store_dir, patch, message):
    patch_config(store_dir, patch)
    with pytest.raises(StoreError, match=rf"{store_dir}/config\.json: {message}"):
        load(store_dir, SLOTS)


@pytest.mark.parametrize(("patch", "message"), CONFIGS, ids=[str(p) for p, _ in CONFIGS])
def test_config_values_in_a_model_dir(model_dir, tmp_path, patch, message):
    patch_config(model_dir, patch)
    with pytest.raises(ModelFileError, match=rf"{model_dir}/config\.json: {message}"):
        convert(model_dir, tmp_path / "store")
    before = set(store_cache_dir().iterdir()) if store_cache_dir().exists() else set()
    with pytest.raises(ModelFileError, match=rf"{model_dir}/config\.json: {message}"):
        load(model_dir, SLOTS)
    assert not (tmp_path / "store").exists()
    assert (set(store_cache_dir().iterdir()) if store_cache_dir().exists() else set()) == before


NOT_OBJECTS = [
    ("[1, 2, 3]", r"top level is list, not a JSON object"),
    ('"config"', r"top level is str, not a JSON object"),
    ("[" * 100_000 + "]" * 100_000, r"JSON nested too deeply"),
    ('{"a": ' * 100_000 + "1" + "}" * 100_000, r"JSON nested too deeply"),
    ("\xff\xfe{}", r"invalid JSON"),
]


@pytest.mark.parametrize(("text", "message"), NOT_OBJECTS, ids=lambda v: str(v)[:12])
@pytest.mark.parametrize("name", ["config.json", "manifest.json"])
def test_json_that_is_not_an_object(store_dir, model_dir, capsys, name, text, message):
    """Through load and the command line: one line naming the file."""
    (store_dir / name).write_bytes(text.encode("latin-1"))
    with pytest.raises(StoreError, match=rf"{name}: {message}"):
        load(store_dir, SLOTS)
    line = cli_error(capsys, "generate", "--model", str(store_dir))
    assert f"{store_dir / name}: " in line
    if name == "config.json":
        (model_dir / name).write_bytes(text.encode("latin-1"))
        line = cli_error(capsys, "generate", "--model", str(model_dir))
        assert f"{model_dir / name}: " in line


@pytest.mark.parametrize(
    "patch",
    [
        {"hidden_size": "256"},
        {"num_attention_heads": 0},
        {"vocab_size": 10**12},
        {"quantization": {}},
    ],
    ids=str,
)
def test_cli_prints_one_line(store_dir, model_dir, capsys, patch):
    """The issue's examples through `expertstream generate`: one line, exit code 2."""
    for directory in (store_dir, model_dir):
        patch_config(directory, patch)
        line = cli_error(capsys, "generate", "--model", str(directory), "--max-tokens", "2")
        assert f"{directory / 'config.json'}: {next(iter(patch))}" in line.replace(
            ".group_size", ""
        )


# ---- chat templates --------------------------------------------------------------------

TEMPLATES = [
    ("{% for m in messages %}{{ m.content }", "TemplateSyntaxError"),
    ("{{ 1 / 0 }}", "ZeroDivisionError"),
    ("{{ raise_exception('no chat here') }}", "no chat here"),
    ("{% for m in messages %}{{ m.content.nope() }}{% endfor %}", "UndefinedError"),
]


@pytest.mark.parametrize(("template", "message"), TEMPLATES, ids=[m for _, m in TEMPLATES])
def test_chat_template_that_fails(store_dir, capsys, template, message):
    write_tokenizer(store_dir, chat_template=template)
    line = cli_error(capsys, "generate", "--model", str(store_dir), "--chat", "--prompt", "The cat")
    assert f"{store_dir / 'tokenizer_config.json'}: the chat template refuses" in line
    assert message in line


def test_chat_template_file_is_named(store_dir, capsys):
    write_tokenizer(store_dir)
    (store_dir / "chat_template.jinja").write_text("{{ 1 / 0 }}")
    line = cli_error(capsys, "generate", "--model", str(store_dir), "--chat", "--prompt", "The cat")
    assert f"{store_dir / 'chat_template.jinja'}: the chat template refuses" in line


HUGE_TEMPLATES = [
    "{{ 'x' * 10**10 }}",
    "{{ ['x'] * 10**10 }}",
    "{{ 'x'.ljust(10**10) }}",
    "{{ 'x'|center(10**10) }}",
    "{{ messages|tojson(indent=10**10) }}",
    "{{ 7 ** (10**9) }}",
    "{% set ns = namespace(s='xxxxxxxx') %}{% for i in range(60) %}{% set ns.s = ns.s + ns.s %}"
    "{% endfor %}",
    # joined with ~, and a string within the bound output in a loop: these grew a process
    # to GBs (or ended it with SIGABRT under a memory limit) before the bound held for them
    "{% set ns = namespace(s='xxxxxxxx') %}{% for i in range(60) %}{% set ns.s = ns.s ~ ns.s %}"
    "{% endfor %}",
    "{% set big = 'x' * 16000000 %}{% for i in range(200) %}{{ big }}{% endfor %}",
    # string operations that build more than their operands hold: 2 to 4.8 GB each, the
    # second stopped only by the time bound, before their result was bounded
    "{{ ('x' * 16000000).replace('x', 'x' * 300) }}",
    "{{ '%2000000000s' % 'x' }}",
    "{{ '{:>2000000000}'.format('x') }}",
    "{{ ('x' * 16000000)|replace('x', 'x' * 300) }}",
    "{{ '%2000000000s'|format('x') }}",
    "{{ '%(a)s%(a)s' % {'a': 'x' * 16000000} }}",
    "{{ ('{0}' * 4000000).format('x' * 1000) }}",
    "{{ ('x' * 100000).join(['y'] * 1000) }}",
    "{{ ('x' * 16000)|join('x' * 16000) }}",
    "{{ ('x' * 16000000).translate({120: 'y' * 300}) }}",
    "{{ ('\t' * 16000000).expandtabs(1000) }}",
    "{{ ('x\n' * 8000000)|indent(1000) }}",
    "{{ messages|tojson(indent='x' * 16000000) }}",
]
# Templates that use the same operations within the bounds render as before.
BOUNDED_TEMPLATES = {
    "{{ '%-6s|%5.2f' % ('ab', 3.14159) }}|{{ '%(k)s' % {'k': 'v'} }}": "ab    | 3.14|v",
    "{{ '{:>6}|{:.3f}|{}'.format('ab', 2.5, messages[0].content) }}": "    ab|2.500|The cat",
    "{{ 'a-b-c'.replace('-', '+') }}|{{ 'a-b'|replace('-', '~~') }}": "a+b+c|a~~b",
    "{{ ', '.join(['x', 'y']) }}|{{ [1, 2]|join('/') }}|{{ '%s=%d'|format('k', 3) }}": (
        "x, y|1/2|k=3"
    ),
    "{{ 'ab'.translate({97: 'AA'}) }}|{{ 'a\tb'.expandtabs(4) }}|{{ 'a\nb'|indent(2) }}": (
        "AAb|a   b|a\n  b"
    ),
    "{{ messages|tojson(indent=2) }}": (
        '[\n  {\n    "role": "user",\n    "content": "The cat"\n  }\n]'
    ),
}


def test_string_operations_within_the_bounds_render_as_before(tmp_path):
    from mlx_lm.utils import load_tokenizer

    import engine.chat  # noqa: F401  (installs the bounded sandbox, as every render has it)

    write_tokenizer(tmp_path)
    tok = load_tokenizer(tmp_path, {"trust_remote_code": False})
    messages = [{"role": "user", "content": "The cat"}]
    for template, want in BOUNDED_TEMPLATES.items():
        tok._tokenizer.chat_template = template
        assert tok.apply_chat_template(messages, tokenize=False) == want, template


TEMPLATE_HEADROOM = 512 << 20  # what the child may still map past its start (RLIMIT_AS)


def test_huge_chat_templates_are_refused_within_a_bounded_memory(tmp_path):
    """Templates building a string, list or number of gigabytes (the
    first grew a process to about 10 GB) are refused by name before they compute it, in
    a process that may map no more than 512 MiB past its start."""
    import subprocess
    import sys
    import textwrap

    write_tokenizer(tmp_path)
    code = f"""
        import json, resource
        from mlx_lm.utils import load_tokenizer
        from engine.chat import chat_ids
        tok = load_tokenizer({str(tmp_path)!r}, {{"trust_remote_code": False}})
        status = open("/proc/self/status").read().split("VmSize:")[1]
        vm = int(status.split()[0]) * 1024
        resource.setrlimit(resource.RLIMIT_AS, (vm + {TEMPLATE_HEADROOM}, resource.RLIM_INFINITY))
        for template in json.loads({json.dumps(HUGE_TEMPLATES)!r}):
            tok._tokenizer.chat_template = template
            try:
                chat_ids(tok, [{{"role": "user", "content": "The cat"}}])
                print("rendered")
            except (ValueError, MemoryError) as e:
                print(type(e).__name__, str(e).replace("\\n", " "))
        """
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).resolve().parents[1],
    )
    lines = out.stdout.splitlines()
    assert len(lines) == len(HUGE_TEMPLATES), out.stdout + out.stderr[-3000:]
    for template, line in zip(HUGE_TEMPLATES, lines, strict=True):
        assert line.startswith("ValueError ") and "TemplateLimitError: " in line, (template, line)
        assert "above the chat template bound" in line and len(line) < 400


def test_endless_chat_template_is_stopped(store_dir, capsys, monkeypatch):
    """A template that loops for ever (here 10**10 rounds) is stopped at the time bound
    and refused in one line naming the file."""
    import time

    from engine import template_bounds

    monkeypatch.setattr(template_bounds, "TEMPLATE_SECONDS", 0.5)
    loop = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    write_tokenizer(store_dir, chat_template=loop)
    start = time.monotonic()
    line = cli_error(capsys, "generate", "--model", str(store_dir), "--chat", "--prompt", "The cat")
    assert time.monotonic() - start < 30
    assert f"{store_dir / 'tokenizer_config.json'}: the chat template refuses" in line
    assert "TemplateLimitError: rendering took more than 0.5 s" in line


# ---- links out of the model directory --------------------------------------------------


def test_convert_never_copies_a_link_out_of_the_model_dir(model_dir, tmp_path):
    outside = tmp_path / "secret.txt"
    outside.write_text("not part of the model")
    (model_dir / "notes.txt").symlink_to(outside)
    (model_dir / "hostname").symlink_to("/etc/hostname")
    (model_dir / "generation_config.json").symlink_to(outside)
    (model_dir / "real.txt").write_text("kept")
    (model_dir / "alias.txt").symlink_to("real.txt")  # a link inside: followed
    store = ExpertStore(convert(model_dir, tmp_path / "store"))
    names = {p.name for p in store.path.iterdir()}
    assert not {"notes.txt", "hostname", "generation_config.json"} & names
    assert (store.path / "alias.txt").read_text() == "kept"
    assert not (store.path / "alias.txt").is_symlink()
    for p in store.path.iterdir():
        assert "not part of the model" not in p.read_bytes().decode(errors="replace")


@pytest.mark.parametrize("name", ["config.json", "model.safetensors"])
def test_model_files_linked_from_outside_are_refused(model_dir, tmp_path, name):
    real = tmp_path / f"elsewhere-{name}"
    shutil.move(model_dir / name, real)
    (model_dir / name).symlink_to(real)
    with pytest.raises(ModelFileError, match=rf"{name}: a link to .*, outside the model directory"):
        convert(model_dir, tmp_path / "store")


def test_hugging_face_snapshot_links_are_followed(model_dir, tmp_path):
    """A Hugging Face cache snapshot's files are links into the repository's blobs/: read."""
    repo = tmp_path / "models--org--name"
    snapshot = repo / "snapshots" / "0123abc"
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for i, f in enumerate(sorted(model_dir.iterdir())):
        blob = repo / "blobs" / f"{i:040x}"
        shutil.copyfile(f, blob)
        (snapshot / f.name).symlink_to(Path("../../blobs") / blob.name)
    store = ExpertStore(convert(snapshot, tmp_path / "store"))
    assert (store.path / "tokenizer.json").read_bytes() == (
        model_dir / "tokenizer.json"
    ).read_bytes()


# ---- the same errors in the app and the server -----------------------------------------


def test_app_and_server_show_one_line(store_dir, capsys):
    """The app's load failure (shown in its status line and chat) and `expertstream serve`
    give the same one line naming the file and the field."""
    import threading

    from app.worker import Worker

    patch_config(store_dir, {"hidden_size": "256"})
    want = f'{store_dir / "config.json"}: hidden_size is "256", expected an integer'
    worker = Worker(threading.Event(), threading.Event())
    failed = []
    worker.loadFailed.connect(failed.append)
    worker.load(str(store_dir), {})
    assert len(failed) == 1 and "\n" not in failed[0] and want in failed[0], failed
    assert main(["serve", "--model", str(store_dir), "--port", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()  # "loading ...", then the error
    assert err[0].startswith("loading ") and len(err) == 2 and want in err[1], err
    assert err[1].startswith("expertstream serve: error: ")


# ---- convert checks what loading will ---------------------


def _patch_weights(fn):
    def patch(directory: Path) -> None:
        path = directory / "model.safetensors"
        weights = dict(mx.load(str(path)))
        fn(weights)
        mx.save_safetensors(str(path), weights, metadata={"format": "mlx"})

    return patch


def _trailing_one(key):
    def fn(weights):
        weights[key] = weights[key][..., None]

    return fn


def _set(key, value):
    def fn(weights):
        weights[key] = mx.full(weights[key].shape, value, weights[key].dtype)

    return fn


def _drop_lm_head(weights):
    for key in [k for k in weights if k.startswith("lm_head.")]:
        del weights[key]


EXPERTS = "model.layers.0.mlp.switch_mlp"
Q4 = {"group_size": 32, "bits": 4}
INCONSISTENT = {
    "expert width": (
        {"moe_intermediate_size": 64},
        rf"model\.safetensors: experts of {EXPERTS}: segment gate_proj\.weight is uint32 "
        r"\[32, 8\] but the model of config\.json needs uint32 \[64, 8\]",
    ),
    "head_dim": (
        {"head_dim": 32},
        r"model\.safetensors: model\.layers\.0\.self_attn\.k_norm\.weight is float32 \[16\] "
        r"but the model of .*config\.json needs a float \[32\]",
    ),
    "expert quantization override": (
        {"quantization": Q4 | {f"{EXPERTS}.gate_proj": {"group_size": 32, "bits": 8}}},
        r"segment gate_proj\.weight is uint32 \[32, 8\] but the model of config\.json "
        r"needs uint32 \[32, 16\]",
    ),
    "dense quantization override": (
        {"quantization": Q4 | {"model.layers.0.self_attn.q_proj": {"group_size": 64, "bits": 4}}},
        r"model\.layers\.0\.self_attn\.q_proj\.biases is float32 \[64, 2\] but the model of "
        r".*config\.json needs a float \[64, 1\]",
    ),
    "override the quantizer refuses": (
        {"quantization": Q4 | {"model.layers.0.self_attn.q_proj": {"group_size": 48, "bits": 4}}},
        r"config\.json: the quantization of model\.layers\.0\.self_attn\.q_proj does not fit "
        r"its shape \(ValueError: \[quantize\] .* group size 48",
    ),
    "untied checkpoint, no lm_head": (
        _patch_weights(_drop_lm_head),
        r"model: the weights have no lm_head\.weight that the model of .*config\.json needs "
        r"\(tie_word_embeddings is false",
    ),
    "trailing dimension of 1, dense": (
        _patch_weights(_trailing_one("model.layers.0.self_attn.q_norm.weight")),
        r"model\.safetensors: model\.layers\.0\.self_attn\.q_norm\.weight is float32 \[16, 1\] "
        r"but the model of .*config\.json needs a float \[16\]",
    ),
    "trailing dimension of 1, experts": (
        _patch_weights(_trailing_one(f"{EXPERTS}.gate_proj.scales")),
        r"segment gate_proj\.scales is float32 \[32, 2, 1\] but the model of config\.json "
        r"needs a float \[32, 1\]",
    ),
    "rope_scaling": ({"rope_scaling": 5}, r"config\.json: rope_scaling is 5, expected an object"),
    "eos_token_id": ({"eos_token_id": "x"}, r'config\.json: eos_token_id is "x", expected a token'),
    "architectures": ({"architectures": 5}, r"config\.json: architectures is 5, expected a list"),
    "NaN in expert scales": (
        _patch_weights(_set("model.layers.1.mlp.switch_mlp.up_proj.scales", float("nan"))),
        r"model\.safetensors: model\.layers\.1\.mlp\.switch_mlp\.up_proj\.scales holds NaN or "
        "infinity",
    ),
    "infinity in a dense weight": (
        _patch_weights(_set("model.norm.weight", float("inf"))),
        r"model\.safetensors: model\.norm\.weight holds NaN or infinity",
    ),
    "tokenizer.json of junk": (
        lambda d: (d / "tokenizer.json").write_text("junk " * 10_000_000),
        r"model: cannot load the tokenizer \(.*\)$",
    ),
    "tokenizer_config.json of the wrong type": (
        lambda d: (d / "tokenizer_config.json").write_text('{"tokenizer_class": 5}'),
        r"model: cannot load the tokenizer \(AttributeError: ",
    ),
    "generation_config.json eos_token_id": (
        lambda d: (d / "generation_config.json").write_text('{"eos_token_id": [1, "x"]}'),
        r'generation_config\.json: eos_token_id is \[1, "x"\], expected a token id',
    ),
}


@pytest.mark.parametrize(("patch", "message"), INCONSISTENT.values(), ids=list(INCONSISTENT))
def test_convert_refuses_what_load_would(model_dir, tmp_path, capsys, patch, message):
    """Each input that load would refuse (or that would generate empty replies) is
    refused by convert in one bounded line naming the file, and nothing is left behind;
    the command line prints that line."""
    patch_config(model_dir, patch) if isinstance(patch, dict) else patch(model_dir)
    with pytest.raises(ModelFileError, match=message) as refused:
        convert(model_dir, tmp_path / "store")
    assert "\n" not in str(refused.value) and len(str(refused.value)) < 600
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]
    assert main(["convert", str(model_dir), str(tmp_path / "store")]) == 2
    # the progress bar's lines aside (NaN is found as each layer is written)
    err = capsys.readouterr().err.splitlines()
    lines = [x for x in err if x.strip() and not x.startswith(("experts:", "converting "))]
    assert len(lines) == 1 and lines[0].startswith("expertstream convert: error: "), lines
    assert len(lines[0]) < 600 and re.search(message, lines[0])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


def test_chat_without_a_tokenizer_is_one_line(qwen_store, tmp_path, capsys):
    """--chat on a store without tokenizer files: the one error naming the store and the
    fix, without the note about a missing chat template."""
    store = Path(shutil.copytree(qwen_store.path, tmp_path / "store"))
    line = cli_error(capsys, "generate", "--model", str(store), "--chat", "--prompt", "The cat")
    assert f"{store} has no tokenizer files" in line and "copy its files into the store" in line


# ---- refused before the work: pools larger than the memory left ------

POOL_HEADROOM = 30 << 20  # what the child may still map past its start (RLIMIT_AS)


def load_under_address_limit(store, config: str, headroom: int):
    """Runs `load(store, <config>)` in a child process whose address space may grow by
    `headroom` bytes past its size before loading (RLIMIT_AS); the child prints the
    ValueError or OSError it gets as "Type message". Returns the CompletedProcess."""
    import subprocess
    import sys
    import textwrap

    code = f"""
        import resource
        from engine.config import StreamConfig
        from engine.model import load
        status = open("/proc/self/status").read().split("VmSize:")[1]
        vm = int(status.split()[0]) * 1024
        resource.setrlimit(resource.RLIMIT_AS, (vm + {headroom}, resource.RLIM_INFINITY))
        try:
            load({str(store)!r}, {config})
        except (ValueError, OSError) as e:
            print(type(e).__name__, e)
        """
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).resolve().parents[1],
    )


def test_pools_beyond_the_address_space_limit_are_refused_first(model_dirs, tmp_path):
    """A process under `ulimit -v` whose pools (78 MB here) cannot fit in what the limit
    leaves (30 MiB) is refused by the planned-bytes check, naming the sizes, before any
    pool is allocated: the process's own limits count as memory available, since no
    system figure shows them."""

    model_dir = model_dirs(
        "qwen3_moe",
        hidden=256,
        moe_intermediate=512,
        num_layers=2,
        num_experts=16,
        quantized=False,
    )
    store = convert(model_dir, tmp_path / "store")
    out = load_under_address_limit(store, "StreamConfig(reader_threads=4)", POOL_HEADROOM)
    assert out.returncode == 0, out.stderr[-2000:]
    # 4 read buffers of a 1.5 MiB record, each 2 MiB as allocated (huge pages), count too
    assert out.stdout.startswith(f"PoolMemoryError {store}: the expert pools need 77.6 MB"), out
    assert "of memory is available" in out.stdout


def test_a_quantization_mlx_refuses_is_named_at_load(store_dir, capsys):
    """A store's config.json asking for a group size MLX's quantizer refuses for a module:
    one line naming the file and the module, not MLX's own message alone."""
    patch_config(
        store_dir,
        {"quantization": Q4 | {"model.layers.0.self_attn.q_proj": {"group_size": 48, "bits": 4}}},
    )
    want = (
        rf"{store_dir}/config\.json: the quantization of model\.layers\.0\.self_attn\.q_proj "
        r"does not fit its shape \(ValueError: \[quantize\] .*group size 48"
    )
    with pytest.raises(StoreError, match=want):
        load(store_dir, SLOTS)
    line = cli_error(capsys, "generate", "--model", str(store_dir), "--prompt", "The cat")
    assert re.search(want, line)


def test_reader_threads_the_system_refuses_are_an_os_error(qwen_store):
    """A process whose address-space limit leaves room for the pools but not for the
    reader threads' stacks (17 threads of 8 MiB in 60 MiB): the cache's constructor stops
    the threads it started and raises ResourceError (an OSError) naming the count,
    instead of ending the process in std::terminate."""

    config = "StreamConfig(expert_slots=2, reader_threads=16)"
    out = load_under_address_limit(qwen_store.path, config, 60 << 20)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.startswith("ResourceError cannot start 17 reader threads ("), out
    assert "give fewer reader threads" in out.stdout
