"""How much memory this process may still take, to refuse a pool before allocating it.

`available_bytes` is the smallest of the system's available memory (Linux `MemAvailable`,
elsewhere the physical memory), the headroom of every memory cgroup (v1 or v2) that
holds this process (its limit minus its usage, plus the page cache it could reclaim), and
the headroom of this process's own limits (`ulimit -v` / `-d`: RLIMIT_AS less the address
space it maps, RLIMIT_DATA less its data segment), which no system figure shows.
`human_bytes` is how every byte figure is shown.
"""

import os
from pathlib import Path

_V1 = Path("/sys/fs/cgroup/memory")
_V2 = Path("/sys/fs/cgroup")


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().split()[0]
    except (OSError, IndexError):
        return None
    return None if text == "max" else int(text) if text.isdigit() else None


def _stat(path: Path, keys: tuple[str, ...]) -> int:
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return 0
    values = dict(line.split(" ", 1) for line in lines if " " in line)
    return sum(int(values.get(k, "0")) for k in keys if values.get(k, "0").isdigit())


def _cgroup_dirs() -> list[tuple[Path, int]]:
    """This process's memory cgroup directories and their ancestors, with the version."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        _, controllers, rel = line.split(":", 2)
        if "memory" in controllers.split(","):
            root, version = _V1, 1
        elif controllers == "" and (_V2 / "cgroup.controllers").exists():
            root, version = _V2, 2
        else:
            continue
        path = root / rel.lstrip("/")
        while True:
            out.append((path, version))
            if path == root or root not in path.parents:
                break
            path = path.parent
    return out


def _cgroup_headroom() -> int | None:
    best = None
    for path, version in _cgroup_dirs():
        if version == 1:
            limit = _read_int(path / "memory.limit_in_bytes")
            usage = _read_int(path / "memory.usage_in_bytes")
            cache = _stat(path / "memory.stat", ("total_inactive_file", "total_active_file"))
        else:
            limit = _read_int(path / "memory.max")
            usage = _read_int(path / "memory.current")
            cache = _stat(path / "memory.stat", ("file",))
        if limit is None or usage is None or limit >= 1 << 60:  # no limit
            continue
        headroom = max(0, limit - usage + cache)
        best = headroom if best is None else min(best, headroom)
    return best


def _system_available() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def _status_bytes(key: str) -> int | None:
    """A `kB` figure of /proc/self/status (e.g. VmSize), in bytes; None where unknown."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(f"{key}:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _rlimit_headroom() -> int | None:
    """What this process's RLIMIT_AS and RLIMIT_DATA still allow it to map, or None when
    it has neither limit (or its use of them cannot be read)."""
    try:
        import resource  # POSIX only
    except ImportError:
        return None
    best = None
    for limit, used_key in ((resource.RLIMIT_AS, "VmSize"), (resource.RLIMIT_DATA, "VmData")):
        soft = resource.getrlimit(limit)[0]
        used = _status_bytes(used_key)
        if soft == resource.RLIM_INFINITY or used is None:
            continue
        best = max(0, soft - used) if best is None else min(best, max(0, soft - used))
    return best


def available_bytes() -> int | None:
    """Bytes this process can still allocate without swapping, meeting a cgroup limit or
    its own address-space / data limits, or None where nothing can be learnt."""
    figures = [
        v for v in (_system_available(), _cgroup_headroom(), _rlimit_headroom()) if v is not None
    ]
    return min(figures) if figures else None


def human_bytes(n: float) -> str:
    """`n` bytes as B / kB / MB / GB text (decimal, as every byte and rate figure the
    CLI, the server and the app show; one decimal above bytes)."""
    for unit in ("B", "kB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} GB"
