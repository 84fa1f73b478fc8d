"""One benchmark run in a child process: `python -m bench.worker SPEC_JSON`.

Started by `bench.limits.run_worker` (inside a memory cgroup when a budget is
set); prints `RESULT {json}` as its last line. Kinds:

- `streamed`: `decode.streamed_run(store, StreamConfig(**fields), prompt, ...)`
- `peer`: `decode.peer_run(store, mode, prompt, ...)`
- `replay`: `scale.replay_ids(store, fields, trace spec)` (expert ids without matmuls)

Optional `mlx_cache_limit` (bytes) bounds MLX's buffer cache first.
"""

import json
import sys

import mlx.core as mx

from bench.common import vm_hwm_bytes


def run(spec: dict) -> dict:
    if spec.get("mlx_cache_limit") is not None:
        mx.set_cache_limit(int(spec["mlx_cache_limit"]))
    kind = spec["kind"]
    if kind == "streamed":
        from bench.decode import streamed_run

        out = streamed_run(
            spec["store"],
            spec["fields"],
            spec["prompt"],
            spec["max_tokens"],
            spec["reps"],
            name=spec.get("name", "streamed"),
        )
    elif kind == "peer":
        from bench.decode import peer_run

        out = peer_run(
            spec["store"], spec["mode"], spec["prompt"], spec["max_tokens"], spec["reps"]
        )
    elif kind == "replay":
        from bench.scale import replay_ids

        out = replay_ids(spec["store"], spec["fields"], spec["trace"])
    else:
        raise ValueError(f"unknown worker kind {kind!r}")
    out["peak_rss_bytes"] = vm_hwm_bytes()
    out.setdefault("peak_mlx_bytes", int(mx.get_peak_memory()))
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    result = run(json.loads(argv[0]))
    print("RESULT " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
