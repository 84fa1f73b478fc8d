"""Memory budgets for benchmark workers: a child memory cgroup, where the OS allows one.

`run_worker(spec, limit_bytes)` runs `python -m bench.worker SPEC` in a fresh
child process. With a limit it first creates a memory cgroup (cgroup v1
`memory.limit_in_bytes` under this process's own memory cgroup, or cgroup v2
`memory.max`), moves the child into it before it execs, and removes the cgroup after.
The page cache the child fills is charged to that cgroup too, so "trust the OS page
cache" and mmap peers are bounded by the same budget as the engine. Where no cgroup can
be made the worker runs unbounded and the result says so (`bound` is None and `reason`
tells why).
"""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

_CHECKOUT = Path(__file__).resolve().parents[1]
_V1_ROOT = Path("/sys/fs/cgroup/memory")
_V2_ROOT = Path("/sys/fs/cgroup")


class MemoryCgroup:
    """A child memory cgroup limited to `limit` bytes (create with `make_cgroup`)."""

    def __init__(self, path: Path, version: int, limit: int):
        self.path, self.version, self.limit = path, version, limit

    @property
    def mechanism(self) -> str:
        if self.version == 1:
            return "cgroup v1 memory.limit_in_bytes"
        return "cgroup v2 memory.max"

    def wrap(self, argv: list[str]) -> list[str]:
        """`argv` prefixed so that the process joins this cgroup before it execs."""
        procs = self.path / "cgroup.procs"
        return ["/bin/sh", "-c", f'echo $$ > "{procs}" && exec "$@"', "sh", *argv]

    def peak_bytes(self) -> int:
        """Peak charged memory (RSS + page cache) of the cgroup so far; -1 if unknown."""
        name = "memory.max_usage_in_bytes" if self.version == 1 else "memory.peak"
        try:
            return int((self.path / name).read_text().split()[0])
        except (OSError, ValueError):
            return -1

    def oom_kills(self) -> int:
        """OOM kills inside the cgroup so far (-1 if unknown)."""
        name = "memory.oom_control" if self.version == 1 else "memory.events"
        try:
            for line in (self.path / name).read_text().splitlines():
                key, _, value = line.partition(" ")
                if key == "oom_kill":
                    return int(value)
        except (OSError, ValueError):
            pass
        return -1

    def close(self) -> None:
        for _ in range(50):
            try:
                self.path.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError:
                time.sleep(0.1)


def _own_path(controller_line_match) -> str | None:
    try:
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            if controller_line_match(controllers):
                return path
    except OSError:
        pass
    return None


def make_cgroup(limit: int, name: str = "expertstream-bench") -> tuple[MemoryCgroup | None, str]:
    """A new memory cgroup limited to `limit` bytes, or (None, why not)."""
    tag = f"{name}-{os.getpid()}-{time.monotonic_ns() % 10**9}"
    v1_own = _own_path(lambda c: "memory" in c.split(","))
    if v1_own is not None and (_V1_ROOT / "memory.limit_in_bytes").exists():
        path = _V1_ROOT / v1_own.lstrip("/") / tag
        try:
            path.mkdir()
            (path / "memory.limit_in_bytes").write_text(str(limit))
            return MemoryCgroup(path, 1, limit), ""
        except OSError as e:
            MemoryCgroup(path, 1, limit).close()
            return None, f"cannot create a v1 memory cgroup at {path}: {e}"
    controllers = _V2_ROOT / "cgroup.controllers"
    if controllers.exists() and "memory" in controllers.read_text().split():
        path = _V2_ROOT / tag
        try:
            path.mkdir()
            (path / "memory.max").write_text(str(limit))
            (path / "memory.swap.max").write_text("0")
            return MemoryCgroup(path, 2, limit), ""
        except OSError as e:
            MemoryCgroup(path, 2, limit).close()
            return None, f"cannot create a v2 memory cgroup at {path}: {e}"
    return None, "no writable memory cgroup (neither cgroup v1 memory nor v2 memory.max)"


def run_worker(spec: dict, limit: int | None = None, timeout: float = 3600) -> dict:
    """Runs one benchmark worker (see bench.worker) and returns its result dict,
    plus `bound` (the mechanism, or None), `limit_bytes`, `cgroup_peak_bytes` and
    `reason` (why unbounded), or `error` when the worker failed or was OOM-killed."""
    argv = [sys.executable, "-m", "bench.worker", json.dumps(spec)]
    cg, reason = (None, "no budget requested") if limit is None else make_cgroup(limit)
    try:
        cmd = cg.wrap(argv) if cg else argv
        env = dict(os.environ)
        env.setdefault("PYTHONUNBUFFERED", "1")
        # `bench` is no installed package: the child finds it in this checkout.
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(_CHECKOUT), env.get("PYTHONPATH")]))
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
        result = {}
        for line in proc.stdout.splitlines():
            if line.startswith("RESULT "):
                result = json.loads(line[len("RESULT ") :])
        if proc.returncode != 0 or not result:
            oom = cg is not None and cg.oom_kills() > 0
            result["error"] = (
                f"out of memory at the {limit / 2**20:.0f} MiB budget (OOM-killed)"
                if oom
                else f"worker exited {proc.returncode}: {proc.stderr.strip()[-800:]}"
            )
        result["bound"] = cg.mechanism if cg else None
        result["limit_bytes"] = limit if cg else None
        result["cgroup_peak_bytes"] = cg.peak_bytes() if cg else None
        if cg is None:
            result["reason"] = reason
        return result
    finally:
        if cg is not None:
            cg.close()


def run_peer(store_path, mode: str, prompt: list[int], max_tokens: int, limit: int | None) -> dict:
    """One repetition of a peer approach (`mode`: "pagecache" or "mmap", see
    bench.peers) in its own process under `limit` bytes; run_worker's result."""
    spec = {
        "kind": "peer",
        "store": str(store_path),
        "mode": mode,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "reps": 1,
    }
    return run_worker(spec, limit=limit)
