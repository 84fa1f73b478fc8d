"""Pipeline stages on loopback: 1, 2 and 3 ranks at the same total expert budget.

`python -m bench.pipeline [--model M] [--ranks 1,2,3] [--expert-slots S] [--tokens T]
[--reps R] [--out DIR]` runs `expertstream generate --pipeline --json` under
`mlx.launch --backend ring -n N` on 127.0.0.1 for each N, round-robin R times, and prints
decode tokens/s and the bytes each rank read. `--expert-slots` is per MoE layer, and
every layer belongs to exactly one rank, so the total expert budget is the same for every
N. The ranks share this machine's cores and disk: the figures show the pipeline's
overhead on one host, not what separate hosts gain (docs/benchmarks.md, "Several
machines", estimates that).

With `--serve`, each N serves instead: `expertstream serve` for 1 rank, `serve --pipeline`
under `mlx.launch` for more; after a warm-up request, R greedy completions of T tokens
through HTTP, each timed by the client (completion tokens / wall seconds) and by the
server (`/v1/stats` last_decode_tps).
"""

import argparse
import contextlib
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from bench.common import PROMPT, machine_load
from engine.flags import positive_int

LAUNCH = Path(sys.executable).with_name("mlx.launch")
CLI = Path(sys.executable).with_name("expertstream")


def _free_port(n: int) -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return min(s.getsockname()[1], 65535 - n)


def run_once(ranks: int, model: str | None, slots: int, tokens: int) -> dict:
    """One pipelined generation on `ranks` loopback ranks; its stats JSON (rank 0's).

    Raises:
        RuntimeError: the run failed (with the ranks' output).
    """
    cmd = [str(LAUNCH), "--backend", "ring", "-n", str(ranks)]
    cmd += ["--starting-port", str(_free_port(ranks)), "--", str(CLI), "generate", "--pipeline"]
    cmd += ["--prompt", PROMPT, "--max-tokens", str(tokens), "--expert-slots", str(slots)]
    cmd += ["--json", *(["--model", model] if model else [])]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    lines = [ln for ln in run.stdout.splitlines() if ln.startswith("{")]
    if "[WARN]" in run.stderr or not lines:
        raise RuntimeError(f"{ranks} ranks failed:\n{run.stdout}\n{run.stderr}")
    return json.loads(lines[-1])["stats"]


def _http(url: str, body: dict | None = None) -> dict:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=600) as r:
        return json.loads(r.read())


def _healthy(url: str) -> bool:
    try:
        return _http(f"{url}/health")["status"] == "ok"
    except OSError:
        return False


def serve_runs(ranks: int, model: str | None, slots: int, tokens: int, reps: int) -> list:
    """`reps` timed completions through a server on `ranks` loopback ranks (after one
    warm-up): per request, client tokens/s and the server's decode tok/s.

    Raises:
        RuntimeError: the server ended (with its output) or did not start within 300 s.
    """
    port = _free_port(1)
    cmd = [str(CLI), "serve", "--port", str(port), "--expert-slots", str(slots)]
    cmd += ["--log-level", "warning", *(["--model", model] if model else [])]
    if ranks > 1:
        launch = [str(LAUNCH), "--backend", "ring", "-n", str(ranks)]
        cmd = [*launch, "--starting-port", str(_free_port(ranks)), "--", *cmd, "--pipeline"]
    url = f"http://127.0.0.1:{port}"
    server = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
    )
    try:
        deadline = time.monotonic() + 300
        while not _healthy(url):
            if server.poll() is not None:
                raise RuntimeError(f"{ranks} ranks: the server ended:\n{server.stdout.read()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{ranks} ranks: the server did not start within 300 s")
            time.sleep(0.5)
        body = {"prompt": PROMPT, "max_tokens": tokens, "temperature": 0}
        _http(f"{url}/v1/completions", body)
        runs = []
        for _ in range(reps):
            t = time.perf_counter()
            reply = _http(f"{url}/v1/completions", body)
            wall = time.perf_counter() - t
            served = _http(f"{url}/v1/stats")["server"]
            n = reply["usage"]["completion_tokens"]
            runs.append({"client_tps": n / wall, "decode_tps": served["last_decode_tps"]})
        return runs
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.pid, signal.SIGINT)  # Ctrl-C: rank 0 stops the others
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()


def serve_markdown(results: dict) -> str:
    """The table of `main`'s `--serve` results."""
    rows = ["| ranks | client tok/s (median) | vs 1 rank | server decode tok/s (median) |"]
    rows.append("|---|---|---|---|")
    base = None
    for n, rs in results["runs"].items():
        client = statistics.median(r["client_tps"] for r in rs)
        base = base or client
        decode = statistics.median(r["decode_tps"] for r in rs)
        rows.append(f"| {n} | {client:.1f} | {client / base:.2f} | {decode:.1f} |")
    return "\n".join(rows)


def markdown(results: dict) -> str:
    """The table of docs/benchmarks.md from `main`'s results."""
    rows = [
        "| ranks | decode tok/s (median) | vs 1 rank | prefill tok/s | bytes read per rank "
        "(MB, rank 0 first) | hit rate |",
        "|---|---|---|---|---|---|",
    ]
    base = None
    for n, runs in results["runs"].items():
        decode = statistics.median(r["decode_tps"] for r in runs)
        base = base or decode
        prefill = statistics.median(r["prefill_tps"] for r in runs)
        last = runs[-1]
        per_rank = ", ".join(f"{r['bytes_read'] / 1e6:.2f}" for r in last["ranks"])
        rows.append(
            f"| {n} | {decode:.1f} | {decode / base:.2f} | {prefill:.0f} | {per_rank} | "
            f"{last['hit_rate']:.1%} |"
        )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="python -m bench.pipeline", description=__doc__)
    p.add_argument("--model", help="store or model dir (default: the embedded model)")
    p.add_argument("--ranks", default="1,2,3", help="rank counts, comma-separated")
    p.add_argument("--expert-slots", type=positive_int, default=8, help="per MoE layer")
    p.add_argument("--tokens", type=positive_int, default=64, help="tokens generated per run")
    p.add_argument("--reps", type=positive_int, default=3, help="round-robin repetitions")
    p.add_argument("--out", help="folder for results.json and results.md")
    p.add_argument("--serve", action="store_true", help="through the HTTP server")
    args = p.parse_args(argv)
    counts = [int(n) for n in args.ranks.split(",")]
    results = {"load_before": machine_load(), "expert_slots": args.expert_slots}
    results["runs"] = {n: [] for n in counts}
    if args.serve:
        for n in counts:
            results["runs"][n] = serve_runs(
                n, args.model, args.expert_slots, args.tokens, args.reps
            )
    else:
        for _ in range(args.reps):
            for n in counts:
                runs = results["runs"][n]
                runs.append(run_once(n, args.model, args.expert_slots, args.tokens))
    results["load_after"] = machine_load()
    table = (serve_markdown if args.serve else markdown)(results)
    print(table)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.json").write_text(json.dumps(results, indent=1))
        (out / "results.md").write_text(table + "\n")
    return results


if __name__ == "__main__":
    main()
