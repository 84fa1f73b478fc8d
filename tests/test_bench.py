"""The benchmark suite runs end to end on a tiny case and its figures are sane; Belady's
MIN bounds every policy replayed through the native cache; traces and synthetic stores
round-trip."""

import itertools
import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bench import routing_traces_dir, run_suite
from bench.disk import engine_at_depth
from bench.policy import POLICIES, belady, replay, trace_store
from engine.config import EVICTION_POLICIES, ConfigError, StreamConfig
from engine.model import load
from engine.store import ExpertStore
from engine.synthetic import QWEN3_30B_A3B, expert_segments, store_bytes, tiny_config, write_store
from engine.trace import Trace, load_trace, local_trace, random_trace, record, reuse_rate

NATIVE = (*EVICTION_POLICIES, "lfu-nodecay")  # demand policies without scratch streaming
DEMAND = (*NATIVE, "lfu+autopin", "predictive+autopin")


@pytest.fixture(scope="module")
def quick(model_dirs, tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "quick"
    results = run_suite("quick", out, model_dirs("qwen3_moe"), log=lambda *_: None)
    return out, results


def test_engine_at_depth_misses_every_id_of_every_call(qwen_store):
    stride = qwen_store.manifest.layers[0].stride
    r = engine_at_depth(qwen_store, 3, 40 * 3 * stride, reader_threads=2)
    assert (r["depth"], r["calls"], r["threads"]) == (3, 40, 2)
    assert r["bytes"] == 40 * 3 * stride and r["MBps"] > 0
    with pytest.raises(ValueError, match="depth 5: needs 2 x depth <= 8"):
        engine_at_depth(qwen_store, 5, stride)


def test_quick_suite_writes_sane_results(quick):
    out, results = quick
    assert (out / "results.md").read_text().startswith("# ExpertStream benchmarks")
    data = json.loads((out / "results.json").read_text())
    rows = data["decode"]["rows"]
    kinds = {r["kind"] for r in rows}
    assert {"resident", "streamed", "pagecache", "mmap"} <= kinds
    for r in rows:
        assert "error" not in r, r
        assert r["decode_tps"] > 0 and r["prefill_tps"] > 0
        assert 0.0 <= r["hit_rate"] <= 1.0 and 0.0 <= r["decode_hit_rate"] <= 1.0
        assert r["bytes_per_token"] >= 0
    streamed = [r for r in rows if r["kind"] == "streamed"]
    resident = next(r for r in rows if r["kind"] == "resident")
    assert all(r["tokens"] == resident["tokens"] for r in streamed)  # same greedy tokens
    # A rate of nothing is null (the table's "—"), not 0%: no prefetch, no accuracy.
    for r in rows:
        if r["kind"] == "streamed" and r["config"].get("prefetch"):
            assert r["prefetch_accuracy"] is None or 0.0 <= r["prefetch_accuracy"] <= 1.0
        else:
            assert r["prefetch_accuracy"] is None, r
    io = data["io"]
    assert all(r["MBps"] > 0 for r in io["raw"])
    assert io["engine"]["bytes_read"] > 0 and io["engine"]["MBps_while_reading"] > 0
    if io["engine"]["resident_after"] is not None:
        assert io["engine"]["resident_after"] < 0.05  # O_DIRECT: nothing left cached
        assert io["engine_buffered"]["resident_after"] > io["engine"]["resident_after"]
    assert [d["depth"] for d in io["depth"]] == [1, 4]
    assert all(d["raw_MBps"] > 0 and d["engine_MBps"] > 0 for d in io["depth"])
    cost = data["policy_cost"]
    assert all(r["ns_per_call"] > 0 for r in cost["per_call"].values())
    assert {"off", "off@lfu"} <= {r["name"].split()[-1] for r in cost["decode"]}
    pred = data["prediction"]
    assert {r["distance"] for r in pred["rows"]} == {1, 2}
    for r in pred["rows"]:
        assert 0.0 <= r["recall"] <= 1.0 and 0.0 <= r["precision"] <= 1.0
        assert r["precision"] == pytest.approx(r["recall"] * pred["top_k"] / pred["budget"])
    for name in data["plots"]:
        assert (out / name).stat().st_size > 0


def test_quick_suite_belady_bounds_every_policy(quick):
    _, results = quick
    assert results["policy"]
    for t in results["policy"]:
        for i, cap in enumerate(t["capacities"]):
            b = t["belady"][i]["hit_rate"]
            assert 0.0 <= b <= 1.0
            for p in DEMAND:
                r = t["curves"][p][i]
                assert 0.0 <= r["hit_rate"] <= 1.0
                assert r["fetch_hit_rate"] <= b + 1e-12, (t["name"], cap, p)
            oracle = t["curves"]["lfu+oracle"][i]
            assert oracle["fetch_hit_rate"] <= t["belady_plus_k"][i]["hit_rate"] + 1e-12


def _brute_force_hits(steps, capacity):
    """Most hits of any demand policy (each token's experts resident together)."""
    best = {}

    def go(t, cache):
        if t == len(steps):
            return 0
        key = (t, cache)
        if key in best:
            return best[key]
        step = set(steps[t])
        hits = len(step & cache)
        full = cache | step
        over = len(full) - capacity
        options = (
            [frozenset(full)]
            if over <= 0
            else [
                frozenset(full - set(v)) for v in itertools.combinations(sorted(cache - step), over)
            ]
        )
        best[key] = hits + max(go(t + 1, c) for c in options)
        return best[key]

    return go(0, frozenset())


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 2), st.integers(3, 5), st.data())
def test_belady_is_optimal(k, num_experts, data):
    tokens = data.draw(st.integers(1, 9))
    rows = [data.draw(st.permutations(range(num_experts)))[:k] for _ in range(tokens)]
    trace = Trace("t", np.asarray(rows, np.int32)[:, None, :], num_experts)
    for cap in range(k, num_experts + 1):
        assert belady(trace, cap)["hits"] == _brute_force_hits([list(r) for r in rows], cap)


@pytest.fixture(scope="module")
def policy_root(tmp_path_factory):
    return tmp_path_factory.mktemp("trace-stores")


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 10**6), st.floats(0.0, 0.9))
def test_belady_bounds_native_policies(policy_root, seed, reuse):
    trace = local_trace(40, 2, 6, 2, reuse=reuse, skew=1.0, seed=seed)
    store = trace_store(trace, policy_root)
    for cap in range(2, 6):
        b = belady(trace, cap)["hit_rate"]
        for p in POLICIES:
            r = replay(store, trace, cap, p)
            assert r["lookups"] == belady(trace, cap)["lookups"]
            bound = b if p != "lfu+oracle" else belady(trace, min(cap + 2, 6))["hit_rate"]
            assert r["fetch_hit_rate"] <= bound + 1e-12, (cap, p)
            if p in NATIVE:
                assert r["hits"] == r["lookups"] - r["loads"]


def test_recorded_trace_round_trips(model_dirs, tmp_path):
    sm = load(model_dirs("qwen3_moe"), StreamConfig(expert_slots=3))
    from bench.common import timed_generate

    original = [m._cache for m in sm.model.modules() if hasattr(m, "_cache")]
    with record(sm) as rec:
        rec.begin_segment()
        timed_generate(sm.model, [1, 2, 3, 4, 5], 6)
        rec.begin_segment()
        timed_generate(sm.model, [7, 8], 4)
        trace = rec.trace("rt")
    assert [m._cache for m in sm.model.modules() if hasattr(m, "_cache")] == original
    m = sm.store.manifest
    assert trace.ids.shape[1:] == (len(m.layers), m.top_k)
    assert trace.num_tokens >= 5 + 2 + 2 and len(trace.segments) == 2
    assert int(trace.prefill.sum()) >= 4
    lookups = sm.snapshot().totals()
    assert lookups["hits"] + lookups["misses"] > 0
    # The router's top k of every (token, layer) are the experts it routed to.
    k = m.top_k
    assert trace.router_ids.shape == (*trace.ids.shape[:2], min(8, m.num_experts))
    assert np.array_equal(np.sort(trace.router_ids[..., :k], -1), np.sort(trace.ids, -1))
    probs = trace.router_probs
    assert np.all(probs[..., :-1] >= probs[..., 1:]) and np.all(probs.sum(-1) <= 1 + 1e-5)
    assert np.allclose(trace.router_dense(0).sum(-1), 1.0, atol=1e-5)
    back = load_trace(trace.save(tmp_path / "rt.npz"))
    assert np.array_equal(back.ids, trace.ids) and back.num_experts == m.num_experts
    assert np.array_equal(back.segments, trace.segments)
    assert np.array_equal(back.router_ids, trace.router_ids)
    assert np.array_equal(back.router_probs, trace.router_probs)


def test_generated_traces():
    r = random_trace(200, 3, 16, 4, seed=1)
    assert r.ids.shape == (200, 3, 4)
    assert all(len(set(row)) == 4 for row in r.ids.reshape(-1, 4).tolist())
    assert abs(reuse_rate(r) - 4 / 16) < 0.08
    loc = local_trace(300, 2, 16, 4, reuse=0.6, seed=2)
    assert all(len(set(row)) == 4 for row in loc.ids.reshape(-1, 4).tolist())
    assert abs(reuse_rate(loc) - 0.6) < 0.1


@pytest.mark.skipif(routing_traces_dir() is None, reason="shared routing traces not present")
def test_hdmoe_trace_loads():
    t = load_trace(routing_traces_dir() / "experts_math_mixtral.json")
    assert t.ids.shape == (10307, 32, 2) and t.num_experts == 8
    assert len(t.segments) == 10 and t.segments[0] == 0


def test_synthetic_store_is_a_valid_store(tmp_path):
    path = write_store(tmp_path / "syn", tiny_config(3, 8, 2), group_size=32, seed=5)
    store = ExpertStore(path)
    assert store.verify() == 3 * 8
    sm = load(path, StreamConfig(expert_slots=3))
    from bench.common import timed_generate

    t = timed_generate(sm.model, [3, 1, 4, 1, 5], 4)
    assert len(t.tokens) == 4


def test_qwen3_30b_a3b_shapes():
    segs = {s.key: s for s in expert_segments(QWEN3_30B_A3B, 64, 4)}
    assert segs["gate_proj.weight"].shape == (768, 256)
    assert segs["gate_proj.scales"].shape == (768, 32)
    assert segs["down_proj.weight"].shape == (2048, 96)
    assert sum(s.nbytes for s in segs.values()) == 2_949_120
    assert 16e9 < store_bytes(QWEN3_30B_A3B) < 19e9


def test_bench_outside_a_checkout_says_it_needs_one(tmp_path, monkeypatch, capsys):
    import engine.cli

    # An installed wheel: engine/ sits in site-packages, with no bench/ next to it.
    monkeypatch.setattr(engine.cli, "__file__", str(tmp_path / "engine" / "cli.py"))
    assert engine.cli.main(["bench", "--suite", "quick", "--out", str(tmp_path / "o")]) == 2
    assert "source checkout" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_prefill_suite_times_the_first_token_against_resident(model_dirs, tmp_path):
    """`--suite prefill`: a 1,536-token prompt, resident then the engine at 100/25/12.5%;
    at 100% the prefill fits the real region; at 25% (2 of 8 experts) each MoE layer's
    prefill call is over capacity; at 12.5% (1 slot) also the calls of the prompt's last
    token and of the next one, which mlx-lm starts before it yields the first (2 ids
    each)."""
    from bench.decode import long_prompt

    out = tmp_path / "prefill"
    results = run_suite("prefill", out, model_dirs("qwen3_moe"), log=lambda *_: None)
    p = results["prefill"]
    assert p["prompt_tokens"] == 1536
    assert p["baseline"] == "resident (mlx-lm)"
    names = [r["name"] for r in p["rows"]]
    assert names == ["resident (mlx-lm)", "streamed 100.0%", "streamed 25.0%", "streamed 12.5%"]
    base = p["rows"][0]["ttft_s"]
    layers = load(model_dirs("qwen3_moe"), StreamConfig()).cache.num_layers
    for r in p["rows"]:
        lo, hi = r["ttft_s_spread"]
        assert 0 < lo <= r["ttft_s"] <= hi and r["reps"] == 3
        assert r["ratio"] == pytest.approx(base / r["ttft_s"])
        assert r["prefill_tps"] == pytest.approx(1536 / r["ttft_s"])
        assert r["same_tokens"], r["name"]
    assert [r["overcap_calls"] for r in p["rows"][1:]] == [0, layers, 3 * layers]
    # 100%: every expert was read at load (as resident mlx-lm reads every weight), none after
    assert [r["bytes_read"] > 0 for r in p["rows"][1:]] == [False, True, True]
    for r in p["rows"][2:]:  # the rate while reading: over the time a read was in flight
        assert 0 < r["reading_s"] < r["ttft_s"]
        assert r["MBps_while_reading"] == pytest.approx(r["bytes_read"] / r["reading_s"] / 1e6)
    # no host tier on this backend; the loads' host time is a share of the first token's
    assert [r["host_tier_bytes"] for r in p["rows"][1:]] == [0, 0, 0]
    assert [0 < r["load_s"] < r["ttft_s"] for r in p["rows"][2:]] == [True, True]
    md = (out / "results.md").read_text()
    assert "## Time to first token" in md and "| streamed 12.5% |" in md
    assert long_prompt([1, 2, 3], 7) == [1, 2, 3, 1, 2, 3, 1]
    with pytest.raises(ValueError, match="empty"):
        long_prompt([])


def test_the_device_bench_runs_on_any_backend(qwen_store, monkeypatch):
    """bench.device is run on a lent GPU, rarely: on this backend too its rows come out,
    each with the figures its tables print and tokens equal to its baseline's."""
    import bench.device as device

    monkeypatch.setattr(device, "drop_page_cache", lambda: None)
    keys = {"decode_tps", "MB_read_per_token", "MB_host_per_token", "MBps_while_reading"}
    runs = device.embedded(2, lambda *_: None, fractions=(0.25,))["runs"]
    assert len(runs) == 4 and "25.0% (8 slots), prefetch on, CPU-stream acquire" in runs
    synthetic = device.synthetic(
        qwen_store.path, 2, print, fractions=(1.0, 0.25), rounds=2, side_slots=1
    )
    assert synthetic["side_slots"] == 1
    # --rounds: engine 100% (the ratios' baseline), each fraction with the host tier and
    # the bare table, alternated; each host-tier row also with the fill stream
    rounds = synthetic["alternated"]
    assert list(rounds) == [
        "engine 100%",
        "engine 25%, host tier",
        "engine 25%, host tier, fill stream",
        "bare device table",
    ]
    assert all(len(r["decode_tps"]) == 2 for r in rounds.values())
    assert rounds["engine 100%"]["ratios"] == [1.0, 1.0]
    runs |= synthetic["runs"]
    assert "25.0% (2 slots), prefetch on, host tier (warmed by one decode)" in runs
    for label, r in runs.items():
        assert keys <= r.keys() and r["same_tokens"], label
    disk = runs["25.0% (2 slots), prefetch on, disk, O_DIRECT, no host tier"]
    assert disk["MB_read_per_token"] > 0 and disk["MBps_while_reading"] > 0
    assert disk["fills_per_token"] > 0 and "dd_MBps" in disk
    demand_only = runs["25.0% (2 slots), prefetch off, disk, O_DIRECT, no host tier"]
    assert demand_only["fills_per_token"] == 0 and demand_only["demand_reads_per_token"] > 0


def test_the_device_bench_times_a_stores_first_token(qwen_store, tmp_path):
    """`bench.device --prefill --no-decode` on a store: only the time to first token, at
    each --prefill-tokens length: every expert cached in mlx-lm's form (the reference)
    and expert-major, 25% with the host tier and O_DIRECT, each row's first token and
    logits equal to the reference's, each 25% row with what it read and the rate while
    reading; then the split of one forward's time, in both forms."""
    import json

    import bench.device as device

    argv = ["--out", str(tmp_path), "--skip-embedded", "--synthetic", str(qwen_store.path)]
    argv += ["--prefill", "--no-decode", "--rounds", "1", "--prefill-tokens", "24,40"]
    assert device.main(argv) == 0
    results = json.loads((tmp_path / "device.json").read_text())
    assert list(results) == ["prefill_synthetic"]
    out = results["prefill_synthetic"]
    assert list(out) == ["24", "40", "split"]
    for n in ("24", "40"):
        names = [r["name"] for r in out[n]["rows"]]
        assert names == [
            "100%, mlx-lm's form",
            "100%",
            "25%, host tier",
            "25%, host tier warm",
            "25%, O_DIRECT",
        ]
        assert out[n]["prompt_tokens"] == int(n)
        for r in out[n]["rows"]:
            assert r["same_tokens"] and r["same_logits"], r["name"]
        base, *_, part = out[n]["rows"]
        assert base["bytes_read"] == 0 and part["overcap_calls"] > 0
        assert part["MBps_while_reading"] == pytest.approx(
            part["bytes_read"] / part["reading_s"] / 1e6
        )
    for form in ("off", "auto"):
        split = out["split"][form]
        assert split["tokens"] == 24
        parts = split["experts_ms"] + split["attention_ms"] + split["rest_ms"]
        assert parts == pytest.approx(split["forward_ms"]) and split["rest_ms"] > 0


def test_the_device_bench_drives_clients_at_once_through_serve(qwen_store, tmp_path):
    """`bench.device --batch --no-decode` on a store (served with a tokenizer of its
    own): 1 and 4 streamed clients at once (--clients) at 100% and at 25% of the experts,
    prefetch off and on, their tokens all counted, and a client joining the running
    batch."""
    import json

    import bench.device as device

    argv = ["--out", str(tmp_path), "--skip-embedded", "--synthetic", str(qwen_store.path)]
    assert device.main([*argv, "--batch", "--no-decode", "--tokens", "4", "--clients", "1,4"]) == 0
    results = json.loads((tmp_path / "device.json").read_text())
    assert list(results) == ["batch_synthetic"]
    assert list(results["batch_synthetic"]) == ["100%", "25%", "25%, prefetch"]
    for out in results["batch_synthetic"].values():
        assert list(out["rows"]) == ["1", "4"] and list(out["join"]) == ["4"]
        for clients, row in out["rows"].items():
            # every client's 4 tokens (the random model never says its end of sequence)
            assert row["tokens"] == 4 * int(clients) and row["total_tps"] > 0, row
            assert 0 < row["ttft_median_s"] <= row["ttft_max_s"]
        assert all(j["join_ttft_s"] > 0 and j["prefill_s"] > 0 for j in out["join"].values())
        assert out["exact"] == {"clients": 4, "same": 4, "first_difference_chars": []}
    md = (tmp_path / "device.md").read_text()
    assert "| 4 |" in md and "| 8 |" not in md and "prefetch on (4 side rows)" in md


def test_the_device_bench_refuses_bad_arguments_before_running(tmp_path, capsys):
    """`bench.device` checks its arguments before it measures anything: each mistake is
    one line naming the flag, exit status 2."""
    import bench.device as device

    out = ["--out", str(tmp_path / "out")]
    for argv, message in (
        (["--skip-embedded"], "nothing to run"),
        (["--fractions", "1,abc"], "--fractions: must be fractions in (0, 1]"),
        (["--fractions", "0"], "got '0'"),
        (["--synthetic", str(tmp_path)], f"--synthetic {tmp_path}: not a store"),
        (["--no-decode"], "--no-decode leaves nothing to run without --prefill"),
        (["--tokens", "1"], "--tokens: must be an integer >= 2, got '1'"),
        (["--prefill-tokens", "2048,0"], "--prefill-tokens: '2048,0': every count"),
        (["--clients", "1,x"], "--clients: '1,x' is not a list of counts"),
    ):
        with pytest.raises(SystemExit) as e:
            device.main(out + argv)
        assert e.value.code == 2, argv
        assert message in capsys.readouterr().err, argv
    assert not (tmp_path / "out").exists()


def test_the_device_bench_names_the_server_packages_batch_needs(tmp_path, capsys, monkeypatch):
    """A device without the server's packages is told which before anything runs."""
    import importlib.util

    import bench.device as device

    find = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name: None if name == "uvicorn" else find(name)
    )
    with pytest.raises(SystemExit) as e:
        device.main(["--out", str(tmp_path / "out"), "--batch", "--no-decode"])
    assert e.value.code == 2 and not (tmp_path / "out").exists()
    err = capsys.readouterr().err
    assert "--batch serves through `expertstream serve`, which needs uvicorn:" in err


def test_the_device_bench_refuses_more_side_rows_than_experts(qwen_store, tmp_path, capsys):
    import bench.device as device

    argv = ["--out", str(tmp_path / "out"), "--skip-embedded", "--synthetic"]
    with pytest.raises(SystemExit) as e:
        device.main([*argv, str(qwen_store.path), "--side-slots", "9"])
    assert e.value.code == 2 and not (tmp_path / "out").exists()
    assert f"--side-slots 9: {qwen_store.path} has 8 experts a layer" in capsys.readouterr().err


def test_the_device_bench_keeps_the_rows_measured_before_a_refused_config(
    qwen_store, tmp_path, monkeypatch
):
    """A run the machine refuses at load (here the host tier, as one short of memory
    refuses `host_memory="auto"`) is logged; the rows measured before it stay in
    device.json and device.md, and the bench exits 1."""
    import bench.device as device

    def load(store, config):
        if config.host_memory == "auto" and config.expert_slots == 2:  # the 25% tier row
            raise ConfigError("host_memory", "auto", "within the memory available")
        return real_load(store, config)

    real_load = device.load
    monkeypatch.setattr(device, "load", load)
    argv = ["--out", str(tmp_path), "--skip-embedded", "--synthetic", str(qwen_store.path)]
    assert device.main([*argv, "--fractions", "1,0.25", "--tokens", "2"]) == 1
    out = json.loads((tmp_path / "device.json").read_text())["synthetic"]
    assert list(out["runs"]) == [
        "100% (8 slots)",
        "100% (8 slots), sync path (before)",
        "25.0% (2 slots), prefetch on, disk, O_DIRECT, no host tier",
        "25.0% (2 slots), prefetch off, disk, O_DIRECT, no host tier",
    ]
    assert out["stopped"].startswith("host_memory = 'auto'")
    md = (tmp_path / "device.md").read_text()
    assert "| 25.0% (2 slots), prefetch off, disk" in md and "synthetic: stopped: host_memory" in md


def test_dd_rate_is_dds_bytes_over_its_seconds(monkeypatch, tmp_path):
    """dd prints its rate to two significant figures; `dd_rate` divides the bytes and
    seconds it printed instead, and gives 0.0 where dd failed."""
    import subprocess

    import bench.device as device

    def fake(stderr: str, code: int = 0):
        return lambda *a, **k: subprocess.CompletedProcess(a, code, "", stderr)

    line = "512+0 records out\n1073741824 bytes (1.1 GB, 1.0 GiB) copied, 0.7 s, 1.5 GB/s\n"
    monkeypatch.setattr(device.subprocess, "run", fake(line))
    assert device.dd_rate(tmp_path) == pytest.approx(1073.741824 / 0.7)
    short = "4096 bytes (4.1 kB, 4.0 KiB) copied, 2.3074e-05 s, 178 MB/s\n"
    monkeypatch.setattr(device.subprocess, "run", fake(short))
    assert device.dd_rate(tmp_path) == pytest.approx(4096 / 2.3074e-05 / 1e6)
    monkeypatch.setattr(device.subprocess, "run", fake("dd: failed to open: Invalid argument", 1))
    assert device.dd_rate(tmp_path) == 0.0


def test_prefetch_bench_compares_the_adaptive_degree_with_fixed_side_rows(qwen_store):
    """`--suite prefetch`'s comparison on a tiny store: prefetch off, each fixed number of
    side rows (top-k 2: 1, 2, 4) and the adaptive degree up to 4, all giving the same
    tokens; a fixed run fills its side rows, the adaptive run at most as many."""
    from bench.prefetch import compare

    r = compare(qwen_store.path, [3, 1, 4, 1, 5, 9, 2, 6], 0.25, 1, 6, log=lambda *_: None)
    rows = {row["name"]: row for row in r["rows"]}
    assert list(rows) == [
        "prefetch off",
        "1 side rows, fixed",
        "2 side rows, fixed",
        "4 side rows, fixed",
        "adaptive (up to 4)",
    ]
    tokens = [row["tokens"] for row in rows.values()]
    assert len(tokens[0]) == 6 and all(t == tokens[0] for t in tokens)
    assert rows["prefetch off"]["fills_per_token"] == 0
    assert [rows[f"{n} side rows, fixed"]["degree"] for n in (1, 2, 4)] == [1, 2, 4]
    adaptive = rows["adaptive (up to 4)"]
    assert 0 <= adaptive["degree"] <= 4 and adaptive["threshold"] in (0.0, 0.1, 0.2)
    for row in rows.values():
        assert row["decode_tps"] > 0 and 0 <= row["hit_rate"] <= 1 and row["reps"] == 1


def test_the_answer_bench_times_the_mailboxs_answers_from_the_host_tier(tmp_path):
    """bench.answer: every miss of a request is staged from the host tier (it holds every
    expert), and the acquire is timed inside the answer that the mailbox's thread times."""
    from bench.answer import answer_cost, shaped_store, suite

    shapes = {"num_hidden_layers": 2, "num_experts": 16, "num_experts_per_tok": 2}
    lines = []
    rows = suite(tmp_path, (1, 3, 5), (0.5,), ("predictive", "lru"), 10, shapes, lines.append)
    # 5 rows of 2 ids exceed 8 slots: over capacity, not a mailbox request.
    assert [(r["slots"], r["rows"], r["policy"]) for r in rows] == [
        (8, 1, "predictive"),
        (8, 1, "lru"),
        (8, 3, "predictive"),
        (8, 3, "lru"),
    ]
    for r in rows:
        assert r["misses"] > 0 and r["host_hits"] == r["misses"]
        assert 0 < r["acquire_us"] <= r["answer_us"] <= r["post_us"]
        assert 0 <= r["hit_table_share"] < 1
    # One row of 2 ids in 8 of 16 experts: a quarter of the requests find both in slots.
    assert rows[0]["hit_table_share"] > 0
    # Three rows miss more than one row does.
    assert rows[2]["misses"] > rows[0]["misses"]
    assert len(lines) == 3 + len(rows)
    with pytest.raises(ValueError, match="5 rows of top-2 ids exceed 8 slots"):
        answer_cost(shaped_store(tmp_path, 2, 16, 2), 8, 5, "lru")


def test_the_bench_server_loads_the_model_for_its_batch(qwen_store, tmp_path):
    """bench.server.Server loads as `expertstream serve --max-batch N` does: the config's
    max_batch is the server's, so the acquire kernels are sized for N rows of top-k ids
    (a config of 1 sent every batched step of a GPU down the host path)."""
    from bench.server import Server, with_tokenizer

    model = with_tokenizer(qwen_store.path, tmp_path / "served")
    server = Server(model, StreamConfig(expert_slots=2), max_batch=4)
    try:
        assert server.engine.sm.config.max_batch == 4
        assert server.engine.max_batch == 4
    finally:
        server.close()


def test_the_batch_bench_refuses_bad_flags_by_name(capsys):
    import bench.batch as batch

    for argv, message in (
        (["--side-slots", "-1"], "--side-slots -1: must be >= 0"),
        (["--fill-stream"], "--fill-stream copies prefetch fills: give --side-slots too"),
        (["--tokens", "1"], "--tokens >= 2"),
    ):
        with pytest.raises(SystemExit) as e:
            batch.main(argv)
        assert e.value.code == 2, argv
        assert message in capsys.readouterr().err, argv
