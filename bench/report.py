"""results.md tables and PNG plots of a suite's results dict."""

from pathlib import Path


def _mb(x) -> str:
    return "—" if x is None or x < 0 else f"{x / 1e6:.2f}"


def _pct(x) -> str:
    return "—" if x is None else f"{x:.1%}"  # None: a rate of nothing (no prefetch issued)


def _mib(x) -> str:
    return "—" if not x else f"{x / 2**20:.0f}"


def _pages(r: dict) -> str:
    return "2 MiB" if r.get("huge_pages", True) else "4 KiB"


def _bw(r: dict) -> str:
    lo, hi = r.get("MBps_spread", [r["MBps"], r["MBps"]])
    return f"{r['MBps']:.0f} ({lo:.0f}..{hi:.0f})"


def _spread(r: dict, key: str) -> str:
    lo, hi = r.get(f"{key}_spread", [0, 0])
    return f"{r[key]:.1f} ({lo:.1f}..{hi:.1f})"


def decode_markdown(d: dict) -> str:
    out = ["## 1. Decode and prefill vs resident\n"]
    if d.get("resident_note"):
        out.append(f"{d['resident_note']}\n")
    out.append(
        "| run | prefill tok/s (min..max) | decode tok/s (min..max) | × resident | "
        "hit rate (decode) | side hits | prefetch acc. | MB read/token (decode) | "
        "disk MB/token | peak MLX MiB | peak RSS MiB | budget MiB |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|"
    )
    for r in d["rows"]:
        if "error" in r:
            out.append(f"| {r['name']} | {r['error']} |" + " |" * 10)
            continue
        ratio = r.get("ratio_to_resident")
        bound = r.get("bound")
        budget = _mib(r.get("budget_bytes"))
        if r.get("budget_bytes") is not None:
            budget += " (cgroup)" if bound else " (unbounded)"
        out.append(
            f"| {r['name']} | {_spread(r, 'prefill_tps')} | {_spread(r, 'decode_tps')} | "
            f"{'—' if ratio is None else f'{ratio:.2f}'} | {_pct(r['hit_rate'])} "
            f"({_pct(r['decode_hit_rate'])}) | {r['side_hit_rate']:.1%} | "
            f"{_pct(r['prefetch_accuracy'])} | {_mb(r['bytes_per_token'])} "
            f"({_mb(r['decode_bytes_per_token'])}) | {_mb(r['disk_bytes_per_token'])} | "
            f"{_mib(r['peak_mlx_bytes'])} | {_mib(r['peak_rss_bytes'])} | {budget} |"
        )
    ratios = {}
    for r in d["rows"]:
        if r.get("fraction") is not None and r.get("ratio_to_resident") is not None:
            ratios.setdefault(r["fraction"], {})[r["mode"]] = r["ratio_to_resident"]
    if ratios:
        modes = list(dict.fromkeys(m for v in ratios.values() for m in v))
        out.append("\nStreamed decode tok/s as a ratio of resident, per real-region budget:\n")
        out.append("| experts cached | " + " | ".join(modes) + " |\n|---|" + "---|" * len(modes))
        for f, v in ratios.items():
            out.append(
                f"| {f:.1%} | " + " | ".join(f"{v[m]:.2f}" if m in v else "—" for m in modes) + " |"
            )
    return "\n".join(out) + "\n"


def policy_markdown(traces: list[dict]) -> str:
    out = [
        "## 2. Cache policies on routing traces\n",
        "Hit rate per policy and capacity (real-region slots per layer), and in brackets "
        "as a fraction of Belady's MIN at the same capacity. Reads that are not misses "
        "(autopin's pin loads, the oracle's prefetches) do not lower a hit rate, so the "
        "last two columns give 1 − reads/lookups of those two, which Belady bounds "
        "(at capacity + top_k for `lfu+oracle`, which holds top_k side rows more).\n",
    ]
    extra = ("lfu+autopin", "predictive+autopin", "lfu+oracle")
    for t in traces:
        pols = list(t["curves"])
        out.append(
            f"### {t['name']} ({t['tokens']} tokens, {t['layers']} layers × "
            f"{t['num_experts']} experts, top-{t['top_k']}, reuse rate "
            f"{t['reuse_rate']:.2f})\n"
        )
        shown = [p for p in extra if p in pols]
        out.append(
            "| capacity | Belady | "
            + " | ".join(pols + [f"{p} 1 − reads/lookups" for p in shown])
            + " |\n|---|---|"
            + "---|" * (len(pols) + len(shown))
        )
        for i, c in enumerate(t["capacities"]):
            b = t["belady"][i]["hit_rate"]
            cells = [
                f"{t['curves'][p][i]['hit_rate']:.1%} ({t['of_belady'][p][i]:.2f})" for p in pols
            ]
            cells += [f"{t['curves'][p][i]['fetch_hit_rate']:.1%}" for p in shown]
            out.append(
                f"| {c} ({c / t['num_experts']:.0%}) | {b:.1%} | " + " | ".join(cells) + " |"
            )
        out.append("")
    return "\n".join(out) + "\n"


def policy_cost_markdown(cost: dict) -> str:
    out = [
        "### What the eviction policy costs\n",
        f"Per `acquire` call, demand reads excluded, median (min..max) over rounds: "
        f"`{cost['trace']}` at {cost['capacity']} slots "
        f"({next(iter(cost['per_call'].values()))['calls']} calls per run).\n",
        "| policy | ns per call |\n|---|---|",
    ]
    for p, r in cost["per_call"].items():
        lo, hi = r["spread"]
        out.append(f"| {p} | {r['ns_per_call']:.0f} ({lo:.0f}..{hi:.0f}) |")
    out.append("\nDecode at 25% of the experts, prefetch off, side by side:\n")
    out.append("| run | decode tok/s (min..max) | hit rate (decode) |\n|---|---|---|")
    for r in cost["decode"]:
        lo, hi = r["decode_tps_spread"]
        out.append(
            f"| {r['name']} | {r['decode_tps']:.1f} ({lo:.1f}..{hi:.1f}) | "
            f"{r['hit_rate']:.1%} ({r['decode_hit_rate']:.1%}) |"
        )
    return "\n".join(out) + "\n"


def prediction_markdown(pred: dict) -> str:
    out = [
        "## The prefetch predictor\n",
        f"Recall (routed experts of the target layer among the prediction) and precision "
        f"(fills used) of {pred['budget']} fills per prediction, top-{pred['top_k']}, over "
        f"{pred['tokens']} decode tokens, per distance from the predicting layer.\n",
        "| distance | predictor | recall | precision |\n|---|---|---|---|",
    ]
    for r in pred["rows"]:
        out.append(
            f"| {r['distance']} | {r['predictor']} | {r['recall']:.1%} | {r['precision']:.1%} |"
        )
    return "\n".join(out) + "\n"


def io_markdown(io: dict) -> str:
    out = [
        "## 3. I/O against the disk's limit\n",
        "| read | threads | MB/s (min..max) | MB per pass | O_DIRECT | buffer pages |\n"
        "|---|---|---|---|---|---|",
    ]
    for r in io["raw"]:
        out.append(
            f"| raw pread, {r['pattern']} | {r['threads']} | {_bw(r)} | "
            f"{r['bytes'] / 1e6:.0f} | {r['direct']} | {_pages(r)} |"
        )
    e = io["engine"]
    out.append(
        f"| engine, while reading (bytes_read / reading_seconds) | {e['threads']} | "
        f"{e['MBps_while_reading']:.0f} | {e['bytes_read'] / 1e6:.0f} | True | heap |"
    )
    out.append(
        f"| engine, over wall time (bytes_read / wall) | {e['threads']} | "
        f"{e['MBps_wall']:.0f} | {e['bytes_read'] / 1e6:.0f} | True | heap |"
    )
    ref = io["reference"]
    out.append(
        f"\nEngine / best raw {ref['pattern']} pread ({ref['threads']} threads, "
        f"{_pages(ref)} pages, {ref['MBps']:.0f} MB/s): "
        f"**{io['ratio_while_reading']:.2f}** while reading, {io['ratio_wall']:.2f} "
        f"over wall time (reads are {e['read_share_of_wall']:.0%} of the wall time).\n"
    )
    if io.get("depth"):
        out.append(
            "Engine against raw random `O_DIRECT` pread at the same queue depth (misses per "
            "`acquire` call; raw: that many threads), demand reads through io_uring and "
            "through the reader threads, alternated per round; median:\n\n"
            "| depth | raw MB/s | io_uring MB/s | threads MB/s | reader threads | checksums "
            "| io_uring / raw | threads / raw |\n"
            "|---|---|---|---|---|---|---|---|"
        )

        def path(d, name, key, fmt):
            p = d["paths"][name]
            return "n/a" if p is None else format(p[key], fmt)

        for d in io["depth"]:
            out.append(
                f"| {d['depth']} | {d['raw_MBps']:.0f} | "
                f"{path(d, 'io_uring', 'engine_MBps', '.0f')} | "
                f"{path(d, 'threads', 'engine_MBps', '.0f')} | {d['threads']} | "
                f"{'on' if d['verify'] else 'off'} | "
                f"**{path(d, 'io_uring', 'ratio', '.2f')}** | "
                f"{path(d, 'threads', 'ratio', '.2f')} |"
            )
        out.append("")
    c = io["engine_buffered"]
    s = io["second_read"]

    def pct(x):
        return "n/a" if x is None else f"{x:.1%}"

    out.append(
        "Uncached proof (page-cache residency of the blob files, mincore): engine "
        f"O_DIRECT run {pct(e['resident_before'])} → {pct(e['resident_after'])}; "
        f"buffered control {pct(c['resident_before'])} → {pct(c['resident_after'])}. "
        f"Second sequential pass: O_DIRECT {s['direct']['first_MBps']:.0f} → "
        f"{s['direct']['second_MBps']:.0f} MB/s, buffered "
        f"{s['buffered']['first_MBps']:.0f} → {s['buffered']['second_MBps']:.0f} "
        "MB/s.\n"
    )
    return "\n".join(out) + "\n"


def scale_markdown(s: dict) -> str:
    out = [
        "## 4. Scale: Qwen3-30B-A3B shapes, 4 GiB budget\n",
        f"Store `{s['store']}` ({s['store_bytes'] / 2**30:.1f} GiB of experts); "
        f"{s['slots']} slots + {s['scratch']} scratch rows per layer "
        f"({s['pool_bytes'] / 2**30:.2f} GiB of pools); budget "
        f"{s['budget_bytes'] / 2**30:.0f} GiB; prompt {s['prompt_tokens']} tokens.\n",
        "| run | tok/s | hit rate | MB/s while reading | MB/s wall | GB read/token | "
        "disk GB/token | peak RSS GiB | peak MLX GiB | cgroup peak GiB | bound |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in s["runs"]:
        if "error" in r:
            out.append(f"| {r['name']} | {r['error']} |" + " |" * 9)
            continue
        tps = r.get("decode_tps", r.get("tokens_per_s", 0.0))
        bw = r.get("MBps_while_reading")
        wall = r.get("MBps_wall")
        per_tok = r.get("decode_bytes_per_token", r.get("bytes_per_token", 0))
        disk = r.get("decode_disk_bytes_per_token", r.get("disk_bytes_per_token"))
        out.append(
            f"| {r['name']} | {tps:.2f} | {r['hit_rate']:.1%} | "
            f"{'—' if not bw else f'{bw:.0f}'} | {'—' if wall is None else f'{wall:.0f}'} | "
            f"{per_tok / 1e9:.2f} | {'—' if disk is None or disk < 0 else f'{disk / 1e9:.2f}'} | "
            f"{r['peak_rss_bytes'] / 2**30:.2f} | {r.get('peak_mlx_bytes', 0) / 2**30:.2f} | "
            f"{(r.get('cgroup_peak_bytes') or 0) / 2**30:.2f} | {r.get('bound') or 'none'} |"
        )
    if s.get("raw"):
        out.append("\nRaw uncached pread of the scale store's blobs (record-sized, O_DIRECT):\n")
        out.append(
            "| pattern | threads | buffer pages | MB/s median (min..max) of 3 |\n|---|---|---|---|"
        )
        out.extend(
            f"| {r['pattern']} | {r['threads']} | {_pages(r)} | {_bw(r)} |" for r in s["raw"]
        )
        resid = [
            f"{r['resident_before']:.1%} → {r['resident_after']:.1%}"
            for r in s["runs"]
            if r.get("resident_after") is not None
        ]
        if resid:
            out.append(
                "\nPage-cache residency of the blobs (mincore) before → after each ids-only "
                "run: " + ", ".join(resid) + "."
            )
        if s.get("paired"):
            pairs = "; ".join(
                f"{p['engine_MBps']:.0f} / {p['raw_MBps']:.0f} MB/s = {p['ratio']:.2f}"
                for p in s["paired"]["pairs"]
            )
            out.append(
                "\nEngine ids-only reads (uniform random, checksums off) / raw random pread "
                "(1 thread), alternated in one process: "
                f"{pairs}; median **{s['paired']['median_ratio']:.2f}**."
            )
        ratios = [
            f"{r['name']}: **{r['ratio_to_raw']:.2f}**" for r in s["runs"] if r.get("ratio_to_raw")
        ]
        if ratios:
            out.append(
                f"\nEngine MB/s while reading as a fraction of the best raw random pread "
                f"({s['reference']['MBps']:.0f} MB/s): " + "; ".join(ratios) + "."
            )
    return "\n".join(out) + "\n"


def prefill_markdown(p: dict) -> str:
    out = [
        "## Time to first token\n",
        f"A {p['prompt_tokens']}-token prompt, each run from a freshly loaded model (the "
        "engine's cache cold: every expert the prompt routes to is read); median and "
        "spread (min..max) over the repetitions.\n",
        f"| run | time to first token, ms (min..max) | prefill tok/s | × {p['baseline']} | "
        "over-capacity calls | MB read | first token as the baseline's |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in p["rows"]:
        lo, hi = r["ttft_s_spread"]
        out.append(
            f"| {r['name']} | {r['ttft_s'] * 1e3:.0f} ({lo * 1e3:.0f}..{hi * 1e3:.0f}) | "
            f"{r['prefill_tps']:.1f} | {r['ratio']:.2f} | "
            f"{r.get('overcap_calls', '—')} | {_mb(r.get('bytes_read'))} | {r['same_tokens']} |"
        )
    return "\n".join(out) + "\n"


def prefetch_markdown(res: dict) -> str:
    """The prefetch suite (`bench.prefetch`): a table per model, tok/s as a ratio of the
    best fixed setting's."""
    out = ["## Prefetch degree: adaptive against fixed side rows\n"]
    for kind, r in res.items():
        rows = r["rows"]
        fixed = [x for x in rows if "fixed" in x["name"] or x["name"] == "prefetch off"]
        best = max(fixed, key=lambda x: x["decode_tps"])
        out.append(
            f"{kind} routers, {r['fraction']:.0%} of {r['num_experts']} experts in the real "
            f"regions (top-{r['top_k']}); best fixed: {best['name']}\n"
        )
        out.append(
            "| run | decode tok/s (min..max) | ÷ best fixed | hit rate | fills / token "
            "(used, wasted) | degree | threshold |\n|---|---|---|---|---|---|---|"
        )
        for x in rows:
            lo, hi = x["decode_tps_spread"]
            threshold = f"{x['threshold']:.2f}" if "adaptive" in x["name"] else "—"
            out.append(
                f"| {x['name']} | {x['decode_tps']:.1f} ({lo:.1f}..{hi:.1f}) | "
                f"{x['decode_tps'] / best['decode_tps']:.2f} | {x['hit_rate']:.1%} | "
                f"{x['fills_per_token']:.1f} ({x['used_per_token']:.1f}, "
                f"{x['wasted_per_token']:.1f}) | {x['degree']:.1f} | {threshold} |"
            )
        out.append("")
    return "\n".join(out)


def markdown(results: dict) -> str:
    m = results["machine"]
    out = [
        f"# ExpertStream benchmarks: suite `{results['suite']}`\n",
        f"Model `{results['model']}`. Started {m['start']['time']} (load average "
        f"{m['start']['loadavg_1m']:.2f} on {m['start']['cpus']} CPUs), ended "
        f"{m['end']['time']} (load {m['end']['loadavg_1m']:.2f}); "
        f"{results['seconds']:.0f} s.\n",
    ]
    if "decode" in results:
        out.append(decode_markdown(results["decode"]))
    if "prefill" in results:
        out.append(prefill_markdown(results["prefill"]))
    if "policy" in results:
        out.append(policy_markdown(results["policy"]))
    if "policy_cost" in results:
        out.append(policy_cost_markdown(results["policy_cost"]))
    if "prediction" in results:
        out.append(prediction_markdown(results["prediction"]))
    if "io" in results:
        out.append(io_markdown(results["io"]))
    if "scale" in results:
        out.append(scale_markdown(results["scale"]))
    if "prefetch" in results:
        out.append(prefetch_markdown(results["prefetch"]))
    if results.get("plots"):
        out.append("## Plots\n")
        out.extend(f"![{p}]({p})" for p in results["plots"])
    return "\n".join(out) + "\n"


def plots(results: dict, out: Path) -> list[str]:
    """Writes the PNG plots; returns their file names (none without matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    names = []
    if "decode" in results:
        d = results["decode"]
        series: dict = {}
        for r in d["rows"]:
            if r.get("fraction") is None or r.get("ratio_to_resident") is None:
                continue
            series.setdefault(r["mode"], []).append((r["fraction"], r["ratio_to_resident"]))
        if series:
            fig, ax = plt.subplots(figsize=(6.4, 4.2))
            for mode, pts in series.items():
                pts.sort()
                style = "--" if mode in ("pagecache", "mmap") else "-"
                ax.plot([p[0] for p in pts], [p[1] for p in pts], style, marker="o", label=mode)
            ax.axhline(1.0, color="k", lw=0.8, ls=":", label="resident")
            ax.set_xscale("log", base=2)
            ax.set_xlabel("real region (fraction of experts); peers: same memory budget")
            ax.set_ylabel("decode tok/s ÷ resident")
            ax.set_title("Decode speed vs memory budget")
            ax.legend(fontsize=8)
            fig.tight_layout()
            fig.savefig(out / "decode.png", dpi=110)
            plt.close(fig)
            names.append("decode.png")
    for t in results.get("policy", []):
        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        xs = [c / t["num_experts"] for c in t["capacities"]]
        ax.plot(xs, [b["hit_rate"] for b in t["belady"]], "k--", marker="s", label="Belady MIN")
        for p, runs in t["curves"].items():
            label = f"{p} (+{t['top_k']} side rows)" if p == "lfu+oracle" else p
            line = ax.plot(xs, [r["hit_rate"] for r in runs], marker="o", label=label)
            if p == "lfu+oracle":
                ax.plot(
                    xs,
                    [r["fetch_hit_rate"] for r in runs],
                    ls=":",
                    marker=".",
                    color=line[0].get_color(),
                    label=f"{p}: 1 - reads/lookups",
                )
        ax.set_xlabel("capacity (fraction of experts per layer)")
        ax.set_ylabel("hit rate")
        ax.set_ylim(0, 1.02)
        ax.set_title(f"{t['name']}: {t['layers']}×{t['num_experts']} top-{t['top_k']}")
        ax.legend(fontsize=8)
        fig.tight_layout()
        name = f"policy-{t['name']}.png"
        fig.savefig(out / name, dpi=110)
        plt.close(fig)
        names.append(name)
    if "io" in results:
        io = results["io"]
        labels = [f"raw {r['pattern']} x{r['threads']}" for r in io["raw"]]
        values = [r["MBps"] for r in io["raw"]]
        labels += ["engine (reading)", "engine (wall)"]
        values += [io["engine"]["MBps_while_reading"], io["engine"]["MBps_wall"]]
        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        ax.barh(labels, values, color=["C0"] * len(io["raw"]) + ["C1", "C2"])
        ax.set_xlabel("MB/s (uncached)")
        ax.set_title("Read bandwidth: raw pread vs engine")
        fig.tight_layout()
        fig.savefig(out / "io.png", dpi=110)
        plt.close(fig)
        names.append("io.png")
    return names
