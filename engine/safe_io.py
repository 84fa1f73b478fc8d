"""Reading the files of model directories and stores, which may be hostile.

Every file the loaders read goes through here: it is opened without blocking
(`O_NONBLOCK`) and read only when `fstat` says it is a regular file, so a FIFO, a device
such as `/dev/zero`, a socket or a directory under a file's name never blocks a load or
floods memory; its size is bounded before anything is read; JSON is parsed with its
nesting bounded by the interpreter's recursion limit (a `RecursionError` becomes an
error naming the file). Files handed to other readers are checked first: with
`check_regular` (MLX's safetensors loader) or `stat_regular` without opening them (the
native cache's blobs; `engine.store` checks every entry of a store this way before the
tokenizer reads any). Symbolic links of a model directory are followed only to targets
inside it (`contained`, `regular_files`).

Every file the product writes (stores, traces, pin sets, plots, screenshots) is written
beside its target and renamed over it once complete and flushed (`atomic_write`; the
store writer does the same for whole directories), so a reader, or a run killed at any
instant, finds the old file or the new one, never a part of one; what a killed writer
leaves (`.NAME.tmp-PID`) is removed by the next writer in that directory
(`remove_leftovers`).
"""

import json
import os
import re
import shutil
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

# Sizes no legitimate file of its kind reaches (the largest real ones are far smaller:
# configs of a few KB, manifests under a few MB, tokenizer.json files of tens of MB);
# MAX_TOKENIZER_BYTES bounds every file of a store other than its weights.
MAX_JSON_BYTES = 64 << 20
MAX_TOKENIZER_BYTES = 1 << 30

_OPEN_FLAGS = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)


class ModelFileError(ValueError):
    """A file of a model directory or expert store cannot be used: it is not a regular
    file, is larger than its kind allows, is not valid JSON, or a field has the wrong type
    or value. The message names the file and the field or value at fault."""


def os_error_text(e: OSError) -> str:
    """An OSError as a user reads it: the file and the reason, without Python's
    "[Errno N]" ("x.json: Permission denied"); its own text where it has no reason."""
    if not e.strerror or e.filename2 is not None:
        return str(e)
    if e.filename is None or str(e.filename) in e.strerror:
        return e.strerror
    return f"{e.filename}: {e.strerror}"


def _kind(mode: int) -> str:
    for test, name in (
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISDIR, "a directory"),
    ):
        if test(mode):
            return name
    return "not a regular file"


def open_regular(path: str | Path, error: type[Exception] = ModelFileError) -> int:
    """Opens `path` for reading without blocking and returns the descriptor, a regular file.

    Raises:
        error: `path` (or its link target) is a FIFO, device, socket or directory.
        OSError: it cannot be opened (FileNotFoundError when missing).
    """
    fd = os.open(path, _OPEN_FLAGS)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise error(f"{path}: is {_kind(mode)}, not a regular file")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def check_regular(path: str | Path, error: type[Exception] = ModelFileError) -> int:
    """The size in bytes of `path`, opened (without blocking) and checked to be a regular
    file, for files another library reads (MLX's safetensors loader).

    Raises:
        error: not a regular file.
        OSError: it cannot be opened.
    """
    fd = open_regular(path, error)
    try:
        return os.fstat(fd).st_size
    finally:
        os.close(fd)


def stat_regular(path: str | Path, error: type[Exception] = ModelFileError) -> int:
    """The size in bytes of `path` (links followed), checked to be a regular file without
    opening it (for files another reader opens, e.g. the native cache's blobs).

    Raises:
        error: not a regular file.
        OSError: it cannot be reached (FileNotFoundError when missing).
    """
    st = os.stat(path)
    if not stat.S_ISREG(st.st_mode):
        raise error(f"{path}: is {_kind(st.st_mode)}, not a regular file")
    return st.st_size


def read_bytes(
    path: str | Path, limit: int = MAX_JSON_BYTES, error: type[Exception] = ModelFileError
) -> bytes:
    """The whole content of the regular file `path`, at most `limit` bytes.

    Raises:
        error: not a regular file, or longer than `limit` bytes.
        OSError: it cannot be opened or read.
    """
    with os.fdopen(open_regular(path, error), "rb") as f:
        # a buffer of the file's size, not of the limit: a small file costs little memory
        want = min(limit, os.fstat(f.fileno()).st_size) + 1
        data = f.read(want)
        if len(data) == want <= limit:  # longer than fstat said (growing, or procfs)
            data += f.read(limit + 1 - len(data))
    if len(data) > limit:
        raise error(f"{path}: more than {limit} bytes, too large for a file of its kind")
    return data


def parse_json(data: bytes, where: str, error: type[Exception] = ModelFileError):
    """`data` decoded as JSON (UTF-8).

    Raises:
        error: invalid UTF-8 or JSON, or nested too deeply to parse.
    """
    try:
        return json.loads(data)
    except RecursionError:
        raise error(f"{where}: JSON nested too deeply") from None
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
        raise error(f"{where}: invalid JSON ({e})") from None


def read_json(
    path: str | Path, limit: int = MAX_JSON_BYTES, error: type[Exception] = ModelFileError
):
    """The JSON value in the regular file `path` (at most `limit` bytes).

    Raises:
        error: not a regular file, too large, invalid JSON or nested too deeply.
        OSError: it cannot be opened or read (FileNotFoundError when missing).
    """
    return parse_json(read_bytes(path, limit, error), str(path), error)


def read_json_object(
    path: str | Path, limit: int = MAX_JSON_BYTES, error: type[Exception] = ModelFileError
) -> dict:
    """`read_json` of a file whose top level must be a JSON object.

    Raises:
        error: as `read_json`, or the top level is not an object.
        OSError: it cannot be opened or read.
    """
    data = read_json(path, limit, error)
    if not isinstance(data, dict):
        raise error(f"{path}: top level is {type(data).__name__}, not a JSON object")
    return data


def link_root(directory: Path) -> Path:
    """The directory whose inside symbolic links of `directory` may point to: the directory
    itself, or for a Hugging Face cache snapshot (`<repo>/snapshots/<revision>`, whose
    files are links into `<repo>/blobs`) the repository's directory."""
    directory = directory.resolve()
    if directory.parent.name == "snapshots":
        return directory.parent.parent
    return directory


def inside(path: Path, root: Path) -> bool:
    """True when `path`, its links resolved, lies inside the (resolved) directory `root`."""
    try:
        path.resolve().relative_to(root)
    except (ValueError, OSError, RuntimeError):  # outside, unreadable, or a link loop
        return False
    return True


def contained(directory: Path, name: str, error: type[Exception] = ModelFileError) -> Path:
    """`directory / name`, refused when it is a symbolic link leading out of
    `link_root(directory)` (it may be missing: the caller's open reports that).

    Raises:
        error: naming the link and its target.
    """
    path = directory / name
    if path.is_symlink() and not inside(path, link_root(directory)):
        raise error(
            f"{path}: a link to {os.path.realpath(path)}, outside the model directory "
            "(files are read only from inside it)"
        )
    return path


def regular_files(directory: Path) -> list[Path]:
    """The entries of `directory` that are regular files, or links resolving to regular
    files inside `link_root(directory)`, sorted by name; FIFOs, devices, sockets,
    directories and links leading out are left out."""
    root = link_root(directory)
    out = []
    for entry in sorted(directory.iterdir()):
        try:
            if entry.is_symlink() and not inside(entry, root):
                continue
            if stat.S_ISREG(entry.stat().st_mode):
                out.append(entry)
        except OSError:
            continue
    return out


_LEFTOVER = re.compile(r"\.(?P<name>.+)\.(?P<kind>tmp|old)-(?P<pid>\d+)")


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's process
        return True
    return True


def remove_leftovers(directory: Path, name: str | None = None) -> list[Path]:
    """Cleans up after runs killed while writing into `directory` (a store being
    written, a store being replaced, a pin file being saved): `.NAME.tmp-PID` entries of
    processes that are gone are removed, and `.NAME.old-PID` (a replaced store) is put
    back as NAME when its replacement never arrived (the run died between the two
    renames), else removed. Only leftovers of `name` when given. Best effort: a
    directory that cannot be changed is left as it is.

    Returns:
        The entries removed or put back.
    """
    try:
        entries = list(directory.iterdir())
    except OSError:
        return []
    done = []
    for entry in entries:
        m = _LEFTOVER.fullmatch(entry.name)
        if m is None or (name is not None and m["name"] != name) or _alive(int(m["pid"])):
            continue
        target = directory / m["name"]
        try:
            if m["kind"] == "old" and not os.path.lexists(target):
                os.rename(entry, target)
            elif entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry)
            else:
                entry.unlink()
        except OSError:
            continue
        done.append(entry)
    return done


def fsync_path(path: Path) -> None:
    """Flushes the file `path` to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: Path) -> None:
    """Make a rename durable; a no-op where directories cannot be fsynced."""
    if os.name != "posix":
        return
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextmanager
def atomic_write(path: str | Path) -> Iterator[BinaryIO]:
    """A binary file to write the whole new content of `path` into: it is a temporary
    sibling (`.NAME.tmp-PID`), flushed to the disk and renamed over `path` when the `with`
    block ends without an error, and removed when it raises. A reader, or a run killed at
    any instant, finds the old `path` or the new one; leftovers of killed writers in
    its directory are removed first, whatever file they were writing
    (`remove_leftovers`): a trace saved under one name cleans up after a save of
    another that was killed.

    Raises:
        OSError: the temporary file cannot be created, written or renamed (the error of
            the write, e.g. ENOSPC; `path` is then untouched).
    """
    path = Path(path)
    remove_leftovers(path.parent)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)
