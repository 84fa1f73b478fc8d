"""Models named by their Hugging Face Hub id: `org/name` or `org/name@revision`,
resolved through `huggingface_hub` into its own cache, as mlx-lm resolves them.

Every front end names a model through `model_dir`: a path that exists is used as it is
(a local directory wins over an id of the same spelling); an id is downloaded, only the
files the engine reads (`ALLOW_PATTERNS`), resumably, with huggingface_hub's own progress
bars, into the cache huggingface_hub defines (`HF_HOME`, `HF_HUB_CACHE`), offline when
`HF_HUB_OFFLINE` is set and with the token it finds (`HF_TOKEN`, `hf auth login`).
A download that cannot happen is a `HubError`: one line that says what was asked and
what to do.
"""

import re
from collections.abc import Callable
from pathlib import Path

# The files of a repository the engine reads: config, weights and their index, tokenizer
# and chat template files (mlx-lm's own list without `*.py`: custom model code is never run).
ALLOW_PATTERNS = [
    "*.json",
    "model*.safetensors",
    "tokenizer.model",
    "*.tiktoken",
    "tiktoken.model",
    "*.txt",
    "*.jsonl",
    "*.jinja",
]

# huggingface_hub's repository names: letters, digits, `-`, `_`, `.`; one `/` between
# the owner and the name. A revision is a branch, tag or commit after `@`.
_ID = re.compile(r"(?P<repo>[\w.-]+/[\w.-]+)(?:@(?P<revision>[^\s@]+))?")

# The progress bar of the bytes snapshot_download writes (its other bars count files and
# network bytes).
_BYTES_BAR = "huggingface_hub.snapshot_download"


class HubError(ValueError):
    """A model id that cannot be resolved: the message is one line naming the id and
    what to do (log in, go online, check the name)."""


def parse_id(name: str) -> tuple[str, str | None] | None:
    """(repo id, revision or None) of a hub id `org/name[@revision]`; None for anything
    else (a path, an id huggingface_hub would refuse: `--` or `..` in it, a leading or
    trailing `-` or `.`)."""
    match = _ID.fullmatch(name)
    if match is None:
        return None
    repo = match["repo"]
    for part in repo.split("/"):
        if "--" in part or ".." in part or part[0] in "-." or part[-1] in "-." or len(part) > 96:
            return None
    return repo, match["revision"]


def is_hub_id(name: str | Path) -> bool:
    """Whether `name` names a model of the Hub: an id (`parse_id`) that is no path that
    exists (a local directory wins over an id of the same spelling)."""
    text = str(name)
    return not (Path(text).exists() or Path(text).is_symlink()) and parse_id(text) is not None


def hub_cache_dir() -> Path:
    """huggingface_hub's cache of downloaded repositories (`HF_HUB_CACHE`, else
    `HF_HOME/hub`, else `~/.cache/huggingface/hub`), as it reads them at import."""
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def repo_of(model_dir: Path) -> str | None:
    """The repo id `org/name` of a snapshot folder of the hub cache
    (`models--org--name/snapshots/<commit>`), else None."""
    model_dir = Path(model_dir)
    repo = model_dir.parent.parent.name
    if model_dir.parent.name != "snapshots" or not repo.startswith("models--"):
        return None
    owner, _, name = repo[len("models--") :].partition("--")
    return f"{owner}/{name}" if owner and name else None


def model_dir(
    name: str | Path,
    progress: Callable[[int, int], None] | None = None,
) -> Path:
    """The local directory of the model `name`: `name` itself when that path exists (or
    is not a hub id: the caller reports it missing), else the snapshot folder of the hub
    id `org/name[@revision]` in huggingface_hub's cache, downloaded first where files are
    missing (only `ALLOW_PATTERNS`; files already there are not fetched again, and a
    transfer cut mid-file resumes from its last byte).

    Args:
        name: a path, or a hub id.
        progress: called as `progress(done_bytes, total_bytes)` while files download
            (from huggingface_hub's threads; the total grows as files start), beside
            huggingface_hub's own bars on a terminal. Not called when nothing is missing.

    Raises:
        HubError: offline (`HF_HUB_OFFLINE`, or the Hub unreachable) without the model
            in the cache, no such repository (or a private or gated one without access),
            no such revision, or a download that failed.
    """
    text = str(name)
    if not is_hub_id(text):
        return Path(name)
    repo, revision = parse_id(text)
    import httpx2  # huggingface_hub's HTTP client: its errors end a download
    from huggingface_hub import snapshot_download

    try:
        folder = snapshot_download(
            repo,
            revision=revision,
            allow_patterns=ALLOW_PATTERNS,
            tqdm_class=None if progress is None else _reporting_bar(progress),
        )
    except (OSError, ValueError, httpx2.HTTPError) as e:
        raise HubError(_in_words(text, revision, e)) from None
    return Path(folder)


def _reporting_bar(progress: Callable[[int, int], None]) -> type:
    """huggingface_hub's tqdm, whose bar of bytes written also reports to `progress`."""
    from huggingface_hub.utils import tqdm

    class ReportingBar(tqdm):
        def __init__(self, *args, **kwargs):
            self._reports = kwargs.get("name") == _BYTES_BAR
            self._done = kwargs.get("initial", 0) or 0
            super().__init__(*args, **kwargs)

        def update(self, n=1):
            if self._reports and n:
                self._done += n
                progress(self._done, max(self.total or 0, self._done))
            return super().update(n)

    return ReportingBar


def _in_words(name: str, revision: str | None, e: Exception) -> str:
    """The one line of a download that could not happen: what was asked, why, what to do."""
    from huggingface_hub import constants
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        IncompleteSnapshotError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    cache = hub_cache_dir()
    login = "log in (`hf auth login`, or set HF_TOKEN)"
    if isinstance(e, GatedRepoError):
        return f"{name} is a gated model: accept its terms on the Hub, then {login}"
    if isinstance(e, RepositoryNotFoundError):
        return (
            f"{name}: no such model on the Hugging Face Hub ({constants.ENDPOINT}), or a "
            f"private one: check the name (org/name), or {login}"
        )
    if isinstance(e, RevisionNotFoundError):
        return f"{name}: the model has no revision {revision!r}: give a branch, tag or commit"
    if isinstance(e, IncompleteSnapshotError):
        missing = re.search(r"(\d+) file\(s\) are missing", str(e))
        files = f"{missing[1]} files" if missing else "files"
        why = (
            "HF_HUB_OFFLINE is set: unset it to finish the download"
            if constants.is_offline_mode()
            else "the Hub cannot be reached: connect and run again to finish the download"
        )
        return f"{name}: its download in {cache} misses {files} and {why}"
    if isinstance(e, LocalEntryNotFoundError):
        if constants.is_offline_mode():
            return (
                f"{name} is not in the Hugging Face cache ({cache}) and HF_HUB_OFFLINE is "
                "set: unset it to download the model, or give a model directory"
            )
        cause = e.__cause__
        if isinstance(cause, HfHubHTTPError) and cause.response is not None:
            reason = f"it answered HTTP {cause.response.status_code}"
        else:
            reason = type(cause).__name__ if cause is not None else "no answer"
        return (
            f"{name} is not in the Hugging Face cache ({cache}) and the Hub "
            f"({constants.ENDPOINT}) cannot be reached ({reason}): connect, or give a model "
            "directory"
        )
    if isinstance(e, HfHubHTTPError) and e.response is not None:
        return (
            f"downloading {name} failed: the Hub answered HTTP {e.response.status_code}: run "
            "again later (the files already downloaded are kept)"
        )
    detail = str(e).splitlines()[0] if str(e) else type(e).__name__
    return (
        f"downloading {name} into {cache} failed ({detail}): run again to resume (the files "
        "already downloaded are kept)"
    )
