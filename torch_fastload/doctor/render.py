"""The doctor's report: each section's measurements as a table (``render``)."""

from __future__ import annotations

from torch_fastload import config
from torch_fastload._benchutil import fmt, log, table

from .common import NEAR_BEST, error_text, key_values, size_text
from .gpu import link_for

__all__ = ["render", "SECTIONS"]

SECTIONS = {
    "gpu": "GPU",
    "h2d": "Host -> device copies (H2D)",
    "gds": "GDS / kvikio",
    "storage": "Storage",
    "sweep": "Sweep: engine threads x task size (page cache)",
}


def _render_gpu(r: dict) -> str:
    lines = []
    if r["gpus"]:
        rows = [
            [
                i,
                g["name"],
                fmt(g["memory_mib"] and g["memory_mib"] / 1024, ".1f") + " GiB",
                g["driver"],
                f"Gen{g['pcie_gen_current']} x{g['pcie_width_current']}",
                f"Gen{g['pcie_gen_max']} x{g['pcie_width_max']}",
                fmt(g["pcie_max_gbps"], ".1f"),
            ]
            for i, g in enumerate(r["gpus"])
        ]
        lines.append(table(["#", "name", "memory", "driver", "PCIe now", "PCIe max", "link GB/s"], rows))
        lines.append(
            f"(from {r['source']}; link GB/s: the max link's payload rate per direction. "
            "An idle GPU lowers its link generation; it rises under load.)"
        )
    if r["cuda"]:
        lines.append(f"measuring on cuda:{r['device']['index']} ({r['device']['name']})")
    else:
        lines.append(f"no CUDA device: {r['reason']}; GPU measurements skipped")
    return "\n".join(lines)


def _render_h2d(r: dict, link: dict | None) -> str:
    if "skipped" in r:
        return f"skipped: {r['skipped']}"
    ceiling = link and link.get("pcie_max_gbps")
    rows = []
    for kind in ("pinned", "pageable"):
        m = r[kind]
        share = f"{100 * m['gbps'] / ceiling:.0f}%" if ceiling else "-"
        rows.append([kind, fmt(m["gbps"]), fmt(min(m["samples_gbps"])), fmt(max(m["samples_gbps"])), share])
    return (
        table(["source memory", "GB/s (median)", "min", "max", "of link"], rows)
        + f"\n({size_text(r['bytes'])} copies, CUDA events, median of {r['reps']} after warm-up)"
    )


def _render_gds(r: dict) -> str:
    rows = [
        ("kvikio", r["kvikio_version"] or "not installed"),
        ("compat mode", r["compat_mode"] or "-"),
        ("GDS available", "yes" if r["available"] else "no"),
    ]
    rows += [("why not" if i == 0 else "", why) for i, why in enumerate(r["reasons"])]
    rows += [("kvikio printed" if i == 0 else "", text) for i, text in enumerate(r.get("kvikio_printed", []))]
    rows.append((f"io_mode='auto' on {r['device']}", r["auto_path"]))
    return key_values(rows, indent="")


def _render_storage(r: dict) -> str:
    fs = r["filesystem"]
    disk = fs.get("disk") or {}
    device = fs["block_device"] or f"none ({fs['mount_source']})"
    if disk:
        kind = {True: "rotational per sysfs", False: "non-rotational", None: None}[disk.get("rotational")]
        extra = ", ".join(x for x in (disk.get("model"), kind) if x)
        device += f" ({extra})" if extra else ""
    head = key_values(
        [
            ("directory", fs["dir"]),
            ("filesystem", f"{fs['fstype']} mounted at {fs['mount_point']}"),
            ("block device", device),
            ("test file", f"{size_text(r['size'])}, random bytes, fsynced"),
        ],
        "",
    )
    hot = r["hot"]["gbps"]
    rows, notes = [["write + fsync", fmt(r["write"]["gbps"]), "-"]], []
    for key, label in (
        ("cold_odirect", "cold read, O_DIRECT"),
        ("cold_buffered", "cold read, buffered (after FADV_DONTNEED)"),
        ("hot", "hot read (page cache)"),
    ):
        m = r[key]
        if "skipped" in m:
            rows.append([label, "skipped", "-"])
            notes.append(f"{label}: skipped: {m['skipped']}")
        else:
            rows.append([label, fmt(m["gbps"]), f"{m['gbps'] / hot:.2f}x"])
    notes.append(
        f"reads: the C++ engine, {r['threads']} threads x {size_text(r['task_size'])} tasks, one call "
        "for the whole file."
    )
    notes.append("A cold rate near the hot one: the cache drop did not take effect, or storage is as fast as memory.")
    return head + "\n\n" + table(["", "GB/s", "vs hot"], rows) + "\n" + "\n".join(notes)


def _render_sweep(r: dict) -> str:
    rec = r["recommended"]
    headers = ["threads"] + [size_text(s) + " " for s in r["task_sizes"]]  # " ": room for the "*"
    rows = []
    for t, line in zip(r["threads"], r["gbps"]):
        rows.append(
            [t]
            + [
                fmt(v) + ("*" if (t, s) == (rec["threads"], rec["task_size"]) else " ")
                for s, v in zip(r["task_sizes"], line)
            ]
        )
    best = rec["best"]
    lines = [
        f"{r['what']}; {size_text(r['size'])} file; GB/s (median of passes), columns: task size",
        table(headers, rows),
        f"recommended: io_threads={rec['threads']}, io_task_size={size_text(rec['task_size'])} "
        f"({rec['gbps']:.2f} GB/s; fastest {best['gbps']:.2f} GB/s at {best['threads']} x "
        f"{size_text(best['task_size'])}; within {100 * (1 - NEAR_BEST):.0f}% of it fewer threads, "
        "then smaller tasks win)",
    ]
    now = ", ".join(
        f"{n}={config.get(n) if n == 'io_threads' else size_text(config.get(n))} ({config.source(n)})"
        for n in ("io_threads", "io_task_size")
    )
    lines.append(f"in effect now: {now}")
    return "\n".join(lines)


def _render_saved(r: dict) -> str:
    if "skipped" in r:
        return f"skipped: {r['skipped']}"
    lines = [f"wrote {r['path']}"]
    for name, m in r["in_effect"].items():
        value = size_text(m["value"]) if name == "io_task_size" else m["value"]
        why = {"tuning file": "the loader now uses it"}.get(
            m["source"], f"the tuning file is shadowed by {m['source']}"
        )
        lines.append(f"  config.get({name!r}) = {value}; config.source({name!r}) = {m['source']!r}: {why}")
    return "\n".join(lines)


def render(name: str, result: dict, results: dict | None = None) -> None:
    """Print one section: its title, then its table, or ``<section>: failed: <error>``."""
    title = SECTIONS.get(name, name)
    log(f"\n== {title} ==")
    if "error" in result:
        log(f"{name}: failed: {result['error']}")
        return
    results = results or {}
    text = {
        "gpu": lambda: _render_gpu(result),
        "h2d": lambda: _render_h2d(result, link_for(results.get("gpu", {}))),
        "gds": lambda: _render_gds(result),
        "storage": lambda: _render_storage(result),
        "sweep": lambda: _render_sweep(result),
        "save": lambda: _render_saved(result),
    }[name]
    try:
        log(text())
    except Exception as exc:  # a rendering bug must not end the report either
        log(f"{name}: failed: {error_text(exc)}")
