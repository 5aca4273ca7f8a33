"""benchmarks/remote.py's report: the verdicts, the printed grids and comparison, the heatmaps."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from torch_fastload._benchutil import fmt, log, pyplot, table

MiB = 1 << 20


def plot(report: dict, path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    panels = [
        (lib, lat) for lat in report["latencies"] for lib in report["grids"] if report["grids"][lib].get(str(lat))
    ]
    if not panels:
        return
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.8), squeeze=False)
    top = max((v or 0) for lib, lat in panels for row in report["grids"][lib][str(lat)]["gbps"] for v in row) or 1
    for ax, (lib, lat) in zip(axes[0], panels):
        values = np.array([[np.nan if v is None else v for v in row] for row in report["grids"][lib][str(lat)]["gbps"]])
        ax.imshow(values, cmap="viridis", vmin=0, vmax=top, aspect="auto")
        for (i, j), v in np.ndenumerate(values):
            ax.text(j, i, "-" if np.isnan(v) else f"{v:.2f}", ha="center", va="center", color="w", fontsize=8)
        ax.set_xticks(range(len(report["sizes"])), [f"{s / MiB:g}M" for s in report["sizes"]])
        ax.set_yticks(range(len(values)), report["grids"][lib][str(lat)].get("concurrency", report["concurrency"]))
        ax.set_xlabel("request size")
        ax.set_ylabel("requests in flight")
        ax.set_title(f"{lib}, {lat * 1e3:.0f} ms latency\ncap {report['cap_bps'] / 1e9:.2f} GB/s (GB/s)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def verdicts(report: dict) -> list:
    out = []
    grids, cap = report["grids"], report.get("cap_bps", 0) / 1e9
    uncapped = report.get("uncapped", {})
    for lat in report["latencies"]:
        if not cap or str(lat) not in grids["fastload"]:  # a run stopped before this latency's grids
            continue
        ours = grids["fastload"][str(lat)]["best"]["gbps"] or 0.0
        loader = grids.get("loader", {}).get(str(lat), {}).get("best", {})
        base = grids.get("boto3", {}).get(str(lat), {}).get("best", {}).get("gbps")
        free = best_of(uncapped, "fastload", lat)
        free_base = best_of(uncapped, "boto3", lat)
        ms = f"{lat * 1e3:.0f} ms"
        check = f"fastload >= 1.5x boto3's best ({ms}, uncapped)"
        if free["gbps"] and free_base["gbps"]:
            ratio = free["gbps"] / free_base["gbps"]
            cpu = cpu_ratio(free_base, free)
            where = f"{free['concurrency']} x {free['request_size'] / MiB:g} MiB vs {free_base['concurrency']} x "
            where += f"{free_base['request_size'] / MiB:g} MiB"
            runs = len(free.get("gbps_repeats", [])) or 1
            detail = f"{ratio:.2f}x ({cpu} less CPU per GB; best cells {where}, median of {runs})"
            out.append((check, ratio >= 1.5, detail))
        else:
            out.append((check, None, report.get("boto3_skipped", "no uncapped boto3 cell")))
        if loader.get("gbps") is not None:  # the DataLoader's path: what the verdict judges
            rate, where = loader["gbps"], f"{loader['concurrency']} x {loader['request_size'] / MiB:g} MiB"
            detail = f"{100 * rate / cap:.0f}% of {cap:.2f} ({where}); the reader's span loop {100 * ours / cap:.0f}%"
            out.append((f"loader >= 80% of the cap ({ms})", rate >= 0.8 * cap, detail))
        else:
            out.append(
                (f"fastload >= 80% of the cap ({ms})", ours >= 0.8 * cap, f"{100 * ours / cap:.0f}% of {cap:.2f}")
            )
        if base:  # informational: under the cap both approach it (see the docstring)
            out.append((f"fastload vs boto3's best under the cap ({ms})", None, f"{ours / base:.2f}x"))
    epochs = report.get("epochs") or {}
    if "cache_over_local" in epochs:
        ratio = epochs["cache_over_local"]
        whole, first = epochs["cache_over_local_whole_epoch"], epochs["cache_first_s"] * 1e3
        detail = f"{ratio:.2f}x from the first batch on; whole epochs {whole:.2f}x, first batch {first:.1f} ms"
        out.append(("cache-hit epoch >= 0.9x the local file's", ratio >= 0.9, detail))
    return out


def best_of(results: dict, lib: str, lat: float) -> dict:
    """A library's best cell at ``lat``: the median of its repeats where it was run again."""
    best = results.get(lib, {}).get(str(lat), {}).get("best") or {"gbps": None, "cpu_s_per_gb": None}
    if best.get("gbps_median") is not None:
        best = best | {"gbps": best["gbps_median"], "cpu_s_per_gb": best["cpu_s_per_gb_median"]}
    return best


def cpu_ratio(theirs: dict, ours: dict) -> str:
    if theirs.get("cpu_s_per_gb") and ours.get("cpu_s_per_gb"):
        return f"{theirs['cpu_s_per_gb'] / ours['cpu_s_per_gb']:.1f}x"
    return "?"


def print_report(report: dict) -> None:
    cap = f"cap {report.get('cap_bps', 0) / 1e9:.3f} GB/s"
    for grids, limit in ((report["grids"], cap), (report.get("uncapped", {}), "no cap")):
        for lib, by_latency in grids.items():
            for lat, result in by_latency.items():
                print_grid(report, lib, lat, result, limit)
    print_uncapped_comparison(report)
    epochs = report.get("epochs") or {}
    if "cache_path" in epochs:
        log(f"\ncache-hit epochs: {epochs['cache_path']}\n  io: {epochs['cache_io_path']}")
    if report.get("boto3_uncapped_gbps"):
        rate = report["boto3_uncapped_gbps"]
        log(f"\nuncapped at 0 ms, 64 x 16 MiB: boto3 {rate:.3f} GB/s (the cap: 60% of fastload's there)")
    if report.get("kvikio_skipped"):
        log(f"\nkvikio: skipped ({report['kvikio_skipped']})")
    log("\nverdicts:")
    for v in report["verdicts"]:
        state = {True: "PASS", False: "FAIL", None: "n/a "}[v["pass"]]
        log(f"  {state}  {v['check']}: {v['value']}")
    for failure in report["failures"]:
        log(f"  failure: {failure}")


def print_grid(report: dict, lib: str, lat: str, result: dict, limit: str) -> None:
    concurrency = result.get("concurrency", report["concurrency"])
    rows = [[c] + [fmt(v, ".3f") for v in row] for c, row in zip(concurrency, result["gbps"])]
    best = result["best"]
    where = (
        f"{best['concurrency']} x {best['request_size'] / MiB:g} MiB ({best['cpu_s_per_gb']:.2f} CPU s/GB)"
        if best["gbps"]
        else "-"
    )
    title = f"{lib}, latency {float(lat) * 1e3:.0f} ms, {limit}: GB/s; best {fmt(best['gbps'], '.3f')} at {where}"
    log("\n" + table(["in flight"] + [f"{s / MiB:g} MiB" for s in report["sizes"]], rows, title=title))


def print_uncapped_comparison(report: dict) -> None:
    """Per latency: each library's best with no cap, its CPU per GB, fastload's ratios."""
    uncapped = report.get("uncapped") or {}
    if not uncapped:
        return
    rows = []
    for lat in report["latencies"]:
        row = [f"{lat * 1e3:.0f} ms"]
        for lib in ("fastload", "boto3", "kvikio"):
            best = best_of(uncapped, lib, lat)
            served, busy = best.get("server_cores"), best.get("in_flight")
            served = f"; {served:.2f}" if served is not None else ""
            served += f"; {busy:.0f}" if busy is not None else ""
            row.append(f"{best['gbps']:.3f} ({best['cpu_s_per_gb']:.2f}{served})" if best["gbps"] else "-")
        ours, theirs = best_of(uncapped, "fastload", lat), best_of(uncapped, "boto3", lat)
        row.append(f"{ours['gbps'] / theirs['gbps']:.2f}x" if ours["gbps"] and theirs["gbps"] else "-")
        row.append(cpu_ratio(theirs, ours) if theirs["gbps"] else "-")
        rows.append(row)
    headers = ["latency", "fastload", "boto3", "kvikio", "fastload/boto3", "boto3 CPU/GB over ours"]
    title = "no cap: each library's best GB/s, median of its repeats (client CPU s/GB; server cores; in flight)"
    log("\n" + table(headers, rows, title=title))
