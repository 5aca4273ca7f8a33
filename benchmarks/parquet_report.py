"""benchmarks/parquet.py's tables and plot (kept apart so the study stays readable)."""

from __future__ import annotations

import numpy as np

from torch_fastload._benchutil import MiB, Study, fmt, table

__all__ = ["plot", "tables"]


def plot(data: dict, plt):
    cells = data["alert"] + data["profiles"]
    fig, ax = plt.subplots(figsize=(11, 0.42 * len(cells) + 1.8))
    names = [c["name"] for c in cells]
    y = np.arange(len(cells))
    ax.barh(y - 0.2, [c["fastload"]["gbps"] for c in cells], 0.4, label="ParquetDataset -> device", color="#1f77b4")
    ax.barh(y + 0.2, [c["read_table"]["gbps"] for c in cells], 0.4, label="read_table -> host", color="#999999")
    ax.set_yticks(y, names, fontsize=7)
    ax.invert_yaxis()
    ax.set(xlabel="decoded GB/s (hot page cache)", title="Parquet -> tensors: torch_fastload vs pyarrow.read_table")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def tables(study: Study) -> list:
    out = []
    rows = []
    for c in study["alert"] + study["profiles"]:
        torch_cell = c.get("torch")
        rows.append(
            [
                c["name"],
                f"{c['rows']:,}",
                fmt(c["file_bytes"] / MiB, ".0f"),
                fmt(c["fastload"]["gbps"]),
                fmt(c["fastload"]["file_gbit"], ".1f"),
                fmt(c["fastload_shuffled"]["gbps"]),
                fmt(c["read_table"]["gbps"]),
                fmt(c["read_table_h2d"]["gbps"]),
                fmt(c["over_read_table"]),
                fmt(c["ceiling_over_read_table"]) if "decode_copy" in c else "-",
                fmt(c["of_ceiling"], ".0%") if "decode_copy" in c else "-",
                fmt(c.get("over_read_table_first_epoch")),
                f"{c.get('batch_rows', study.args.batch_rows):,}",
                f"{fmt(c.get('over_torch'), '.1f')} (w{torch_cell['best']['workers']})" if torch_cell else "-",
            ]
        )
    heads = ["file", "rows", "MiB", "GB/s", "Gbps file", "shuffled", "read_table", "+H2D", "x read_table"]
    heads += ["ceiling x read_table", "of ceiling"]
    heads += ["x (1st epoch)", "batch rows", "x torch"]
    title = (
        f"hot page cache, to {study.args.device}, the loader's 2nd epoch timed (1st: its pool and threads set up);"
        f" batches of >= {study.args.batch_rows} rows and >= {study.args.batch_mib:g} MiB; torch: sampled rows,"
        " extrapolated; ceiling: every row group decoded and copied to the device on its own thread, nothing else"
    )
    out.append(table(heads, rows, title))
    if study["skipped"]:
        out.append(f"skipped for --budget-s {study.args.budget_s:.0f}: " + ", ".join(study["skipped"]))
    if study["read_modes"]:
        rows = [
            [
                c["read_mode"],
                c["arrow_threads"],
                c.get("at_once", "-" if c["read_mode"] == "read_table" else "auto"),
                "cold" if c["cold"] else "hot",
            ]
            + [fmt(c["resident_before"], ".0%"), fmt(c["gbps"]), fmt(c["file_gbit"], ".1f")]
            for c in study["read_modes"]
        ]
        heads = ["read_mode", "arrow threads", "row groups at once", "cache", "resident", "GB/s", "Gbps file"]
        out.append(table(heads, rows, "read paths"))
    if study["grid"]:
        threads = sorted({c["threads"] for c in study["grid"]})
        groups = sorted({c["row_group_rows"] for c in study["grid"]})
        rows = [
            [g]
            + [
                fmt(next(c["gbps"] for c in study["grid"] if c["threads"] == t and c["row_group_rows"] == g))
                for t in threads
            ]
            for g in groups
        ]
        out.append(
            table(["row group rows"] + [f"{t} thr" for t in threads], rows, "threads x row-group size, GB/s decoded")
        )
    if ov := study.get("overlap"):
        rows = [
            ["device-resident", fmt(ov["resident_ms"]), "1.000"],
            ["ParquetDataset", fmt(ov["fastload_ms"]), fmt(ov["over_resident"], ".3f")],
        ]
        out.append(
            table(
                ["feed", "step ms", "x resident"],
                rows,
                f"bf16 step of {ov['gemms_per_step']} GEMMs beside the loader "
                f"(medians of {ov.get('rounds', 1)} interleaved pairs)",
            )
        )
    return out
