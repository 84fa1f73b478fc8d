"""Models named by their Hugging Face Hub id (`engine.hub`): a hub cache laid out as
huggingface_hub lays it out, and a loopback server speaking the Hub's HTTP API for the
download (only the files the engine reads, progress, resume after a cut, offline
refusal); `expertstream cache` lists and removes what a hub model left on disk."""

import json
import os
import shutil
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import mlx_lm
import pytest
from huggingface_hub import constants

from engine.cli import main
from engine.hub import ALLOW_PATTERNS, HubError, model_dir, parse_id, repo_of
from engine.store_cache import FIRST_USE

from factories import CHAT_TEMPLATE, write_tokenizer
from hub_server import Hub, commit_of, lay_out_cache, point_hub, repo_files

ROOT = Path(__file__).resolve().parents[1]
REPO = "test-org/tiny-moe"
PROMPT = "The cat sat on the mat"


def run(capfd, *argv) -> tuple[int, str, str]:
    """Exit code, stdout and stderr of `expertstream ARGV`."""
    try:
        code = main(list(argv))
    except SystemExit as e:
        code = e.code
    out, err = capfd.readouterr()
    return code, out, err


@pytest.fixture
def hf(monkeypatch, tmp_path):
    """huggingface_hub pointed at an empty cache under tmp_path, online, at an endpoint
    where nothing listens (`hub_server.point_hub`). `hf.serve(repos)` starts a loopback
    Hub and points the endpoint at it; `hf.offline()` sets offline mode."""

    class Env:
        cache = tmp_path / "hf" / "hub"
        hub: Hub | None = None

        def offline(self) -> None:
            monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)

        def serve(self, repos) -> Hub:
            self.hub = Hub(repos)
            point_hub(monkeypatch, self.cache, self.hub.url)
            return self.hub

    env = Env()
    point_hub(monkeypatch, env.cache, "http://127.0.0.1:9")
    yield env
    if env.hub is not None:
        env.hub.close()


@pytest.fixture(scope="module")
def tiny(model_dirs, tmp_path_factory):
    """A tiny qwen3_moe model directory with a tokenizer and a chat template."""
    model = shutil.copytree(model_dirs("qwen3_moe"), tmp_path_factory.mktemp("tiny") / "m")
    write_tokenizer(model, CHAT_TEMPLATE)
    return Path(model)


def model_files(tiny: Path) -> dict[str, bytes]:
    """`tiny`'s files, with files a repository also holds that the engine never reads
    (never downloaded)."""
    files = repo_files(tiny)
    files["README.md"] = b"# tiny\n"
    files["pytorch_model.bin"] = b"pickle, never read"
    files["modeling_tiny.py"] = b"raise SystemExit('custom code is never run')\n"
    return files


def mlx_lm_tokens(repo: str, max_tokens: int) -> list[int]:
    """mlx-lm's greedy tokens of PROMPT, loading `repo` through its own hub resolution."""
    model, tokenizer = mlx_lm.load(repo)
    return [r.token for r in mlx_lm.stream_generate(model, tokenizer, PROMPT, max_tokens)]


@pytest.mark.parametrize(
    ("name", "parsed"),
    [
        ("mlx-community/Qwen3-30B-A3B-4bit", ("mlx-community/Qwen3-30B-A3B-4bit", None)),
        ("org/name@v1.0", ("org/name", "v1.0")),
        ("org/name@" + "a" * 40, ("org/name", "a" * 40)),
        ("./org/name", None),
        ("/abs/path", None),
        ("models/sub/dir", None),
        ("name", None),
        ("org/na--me", None),
        ("org/.name", None),
        ("org/name@", None),
    ],
)
def test_hub_ids_and_paths(name, parsed):
    assert parse_id(name) == parsed


def test_a_cached_snapshot_runs_offline_bit_exact_with_mlx_lm(capfd, hf, tiny):
    snapshot = lay_out_cache(hf.cache, REPO, repo_files(tiny))
    hf.offline()
    assert model_dir(REPO) == snapshot and repo_of(snapshot) == REPO
    code, out, err = run(
        capfd,
        "generate",
        "--model",
        REPO,
        "--no-chat",
        "--prompt",
        PROMPT,
        "--max-tokens",
        "8",
        "--json",
    )
    assert code == 0, err
    assert "downloading" not in err  # nothing was missing
    assert json.loads(out)["tokens"] == mlx_lm_tokens(REPO, 8)


def test_offline_an_absent_model_is_one_line(capfd, hf):
    hf.offline()
    code, out, err = run(capfd, "generate", "--model", "some-org/absent-model")
    assert code == 2 and out == ""
    assert err == (
        "expertstream generate: error: some-org/absent-model is not in the Hugging Face cache "
        f"({hf.cache}) and HF_HUB_OFFLINE is set: unset it to download the model, or give a "
        "model directory\n"
    )


def test_download_fetches_what_the_engine_reads_resumes_a_cut_and_reports(hf, tiny, monkeypatch):
    files = model_files(tiny)
    hub = hf.serve({REPO: files})
    weights = "model.safetensors"
    # huggingface_hub writes what it receives in chunks (10 MB): chunks of 4 KiB make a
    # cut in the tiny model's weights fall after some were written
    monkeypatch.setattr(constants, "DOWNLOAD_CHUNK_SIZE", 4096)
    hub.cut[weights] = len(files[weights]) // 3 // 4096 * 4096
    reports = []
    snapshot = model_dir(REPO, progress=lambda done, total: reports.append((done, total)))

    wanted = {f for f in files if f not in ("README.md", "pytorch_model.bin", "modeling_tiny.py")}
    assert snapshot == hf.cache / "models--test-org--tiny-moe" / "snapshots" / commit_of(files)
    assert {p.name for p in snapshot.iterdir()} == wanted
    assert all((snapshot / f).read_bytes() == files[f] for f in wanted)
    fetched = hub.file_requests("GET")
    assert sorted({f for f, _ in fetched}) == sorted(wanted)  # nothing else was asked for
    # the cut transfer went on from its last byte
    assert [r for f, r in fetched if f == weights] == [None, f"bytes={hub.cut_at[weights]}-"]
    total = sum(len(files[f]) for f in wanted)
    assert reports[-1] == (total, total)
    assert all(a[0] < b[0] for a, b in zip(reports, reports[1:], strict=False))

    # Once there, a second resolution downloads nothing; offline, it asks nothing at all.
    before = len(hub.requests)
    assert model_dir(REPO) == snapshot and not hub.file_requests("GET")[len(fetched) :]
    hf.offline()
    after = len(hub.requests)
    assert model_dir(REPO) == snapshot and len(hub.requests) == after >= before


def test_a_failed_download_goes_on_from_the_files_it_has(hf, tiny):
    files = model_files(tiny)
    hub = hf.serve({REPO: files})
    weights = "model.safetensors"
    hub.fail.add(weights)
    with pytest.raises(HubError) as e:
        model_dir(REPO)
    assert str(e.value) == (
        f"downloading {REPO} failed: the Hub answered HTTP 500: run again later (the files "
        "already downloaded are kept)"
    )
    first = len(hub.file_requests("GET"))
    hub.fail.clear()
    snapshot = model_dir(REPO)
    assert [f for f, _ in hub.file_requests("GET")[first:]] == [weights]  # only what it lacked
    assert (snapshot / weights).read_bytes() == files[weights]


def test_unknown_repositories_and_revisions_are_one_line(hf, tiny):
    hf.serve({REPO: model_files(tiny)})
    with pytest.raises(HubError, match=r"^some-org/absent-model: no such model on the Hugging"):
        model_dir("some-org/absent-model")
    with pytest.raises(HubError) as e:
        model_dir(f"{REPO}@no-such-branch")
    assert str(e.value) == (
        f"{REPO}@no-such-branch: the model has no revision 'no-such-branch': give a branch, "
        "tag or commit"
    )


def test_unreachable_hub_without_the_model_is_one_line(hf):
    with pytest.raises(HubError) as e:
        model_dir(REPO)
    assert str(e.value).startswith(
        f"{REPO} is not in the Hugging Face cache ({hf.cache}) and the Hub "
        f"(http://127.0.0.1:9) cannot be reached ("
    )


def test_a_local_directory_wins_over_an_id(capfd, hf, tiny, monkeypatch, tmp_path):
    hub = hf.serve({})
    local = tmp_path / "here"
    shutil.copytree(tiny, local / REPO)
    monkeypatch.chdir(local)
    assert model_dir(REPO) == Path(REPO)
    code, out, err = run(capfd, "generate", "--model", REPO, "--max-tokens", "2", "--json")
    assert code == 0 and len(json.loads(out)["tokens"]) == 2, err
    assert hub.requests == []


def test_cache_lists_a_hub_model_and_removes_its_download_when_asked(capfd, hf, tiny):
    # content of its own: a store of its own, named after the repository
    files = repo_files(tiny) | {"generation_config.json": b'{"for": "cache list"}'}
    snapshot = lay_out_cache(hf.cache, REPO, files)
    hf.offline()
    code, _, err = run(capfd, "generate", "--model", REPO, "--max-tokens", "1")
    assert code == 0, err
    code, out, _ = run(capfd, "cache", "list")
    row = next(line for line in out.splitlines() if f" {REPO} " in line)
    name, model, kind = row.split()[:3]
    assert name.startswith("test-org--tiny-moe-") and (model, kind) == (REPO, FIRST_USE)
    download = sum(len(b) for b in files.values())
    assert f"{download / 1e3:.1f} kB" in row, row  # the snapshot's bytes

    code, out, _ = run(capfd, "cache", "rm", name)
    assert code == 0 and f"kept its download {snapshot}" in out and snapshot.is_dir()
    run(capfd, "generate", "--model", REPO, "--max-tokens", "1")  # converted again
    code, out, _ = run(capfd, "cache", "rm", "--download", name)
    assert code == 0 and f"removed {snapshot} (the download" in out
    assert not snapshot.exists()


def test_the_command_line_downloads_through_hf_endpoint(tiny, tmp_path):
    """The environment variables as a user sets them, in a process of its own: HF_HOME
    and HF_ENDPOINT for the download, HF_HUB_OFFLINE for the refusal."""
    hub = Hub({REPO: model_files(tiny)})
    env = {
        **os.environ,
        "HF_HOME": str(tmp_path / "hf"),
        "HF_ENDPOINT": hub.url,
        "EXPERTSTREAM_CACHE": str(tmp_path / "stores"),
        "PYTHONPATH": str(ROOT),
    }
    env.pop("HF_HUB_CACHE", None)
    command = [sys.executable, "-m", "engine.cli", "generate", "--max-tokens", "2", "--json"]
    try:
        done = subprocess.run(
            [*command, "--model", REPO], env=env, capture_output=True, text=True, timeout=300
        )
    finally:
        hub.close()
    assert done.returncode == 0, done.stderr
    assert (
        f"downloading {REPO} from the Hugging Face Hub into {tmp_path / 'hf' / 'hub'} "
        in done.stderr
    )
    assert len(json.loads(done.stdout)["tokens"]) == 2
    assert (tmp_path / "hf" / "hub" / "models--test-org--tiny-moe" / "refs" / "main").is_file()

    env["HF_HUB_OFFLINE"] = "1"
    done = subprocess.run(
        [*command, "--model", "some-org/absent-model"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.startswith(
        "expertstream generate: error: some-org/absent-model is not in the Hugging Face cache "
    )
    assert done.stderr.count("\n") == 1


def test_serve_names_the_model_by_its_id(tiny, tmp_path):
    """`serve --model org/name` from the hub cache, offline: the model lists name it by
    its id, as clients of mlx-lm's server ask for it."""
    lay_out_cache(tmp_path / "hf" / "hub", REPO, repo_files(tiny))
    env = {
        **os.environ,
        "HF_HOME": str(tmp_path / "hf"),
        "HF_HUB_OFFLINE": "1",
        "EXPERTSTREAM_CACHE": str(tmp_path / "stores"),
        "PYTHONPATH": str(ROOT),
    }
    env.pop("HF_HUB_CACHE", None)
    command = [sys.executable, "-m", "engine.cli", "serve", "--model", REPO, "--port", "0"]
    p = subprocess.Popen(
        [*command, "--log-level", "warning"], env=env, stderr=subprocess.PIPE, text=True
    )
    try:
        line = ""
        while not line.startswith("serving on "):
            line = p.stderr.readline()
            assert line, "the server stopped"
        url = line.split()[2]
        with urllib.request.urlopen(f"{url}/v1/models", timeout=60) as r:
            assert [m["id"] for m in json.load(r)["data"]] == [REPO]
    finally:
        p.send_signal(signal.SIGINT)
        p.wait(60)


def test_allow_patterns_keep_every_file_a_store_copies(tiny):
    """Every file convert copies into a store (config, tokenizer, chat template) and every
    weight file it reads is one the download fetches."""
    from huggingface_hub.utils import filter_repo_objects

    from engine.convert import aux_files

    model = tiny
    needed = [f.name for f in aux_files(model)] + [f.name for f in model.glob("model*.safetensors")]
    assert sorted(filter_repo_objects(needed, allow_patterns=ALLOW_PATTERNS)) == sorted(needed)
