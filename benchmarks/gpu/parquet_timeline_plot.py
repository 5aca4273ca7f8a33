"""Draw a timeline JSON of benchmarks/gpu/parquet_timeline.py: one lane per thread, spans
coloured by what the thread was doing, and the GIL probe's lateness underneath.

  python3 benchmarks/gpu/parquet_timeline_plot.py timeline-....json [more.json ...]  (PNG beside each)
"""

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

COLOURS = {
    "decode": "#4c72b0",
    "prepare": "#8172b2",
    "rows-wait": "#dd8452",
    "rows": "#ccb974",
    "tensors": "#64b5cd",
    "credit": "#cccccc",
    "get": "#eeeeee",
    "put": "#bbbbbb",
    "memcpy": "#55a868",
    "slot": "#c44e52",
    "start-copy": "#937860",
    "next": "#da8bc3",
}
ORDER = ("MainThread", "fastload-fetch", "fastload-stage", "fastload-parquet", "fastload-copy", "gil-probe")


def lane_rank(name: str) -> tuple:
    for rank, prefix in enumerate(ORDER):
        if name.startswith(prefix):
            return rank, name
    return len(ORDER), name


def draw(path: Path) -> Path:
    r = json.loads(path.read_text())
    t0 = r["t0"]
    spans = list(r["spans"])
    # the loader's own trace: next() (consumer) and the stage threads' slot / start-copy marks
    for what, _number, start, end in r["trace"]:
        if what == "next":
            spans.append(("MainThread", "next", -1, start, end))
    lanes = sorted({s[0] for s in spans}, key=lane_rank)
    row = {name: k for k, name in enumerate(lanes)}
    fig, (ax, gil) = plt.subplots(
        2, 1, figsize=(16, 2 + 0.35 * len(lanes)), sharex=True, gridspec_kw={"height_ratios": [max(3, len(lanes)), 2]}
    )
    nested = {"rows-wait", "prepare", "tensors"}  # inside another span on the same thread: drawn thinner
    for thread, what, _key, start, end in spans:
        height = 0.4 if what in nested else 0.8
        ax.broken_barh(
            [(1e3 * (start - t0), 1e3 * (end - start))],
            (row[thread] - height / 2, height),
            color=COLOURS.get(what, "#000000"),
            linewidth=0,
        )
    ax.set_yticks(range(len(lanes)), lanes, fontsize=7)
    ax.invert_yaxis()
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in COLOURS.values()]
    ax.legend(handles, COLOURS.keys(), ncol=len(COLOURS), fontsize=7, loc="upper center", bbox_to_anchor=(0.5, 1.12))
    ax.set_title(
        f"{r['file']} {r['variant']}: {r['gbps']:.2f} GB/s, x{r['x_read_table']:.2f} read_table, "
        f"{r['batches']} batches",
        fontsize=9,
        pad=24,
    )
    if r["gil"]:
        xs = [1e3 * (t - t0) for t, _ in r["gil"]]
        ys = [1e6 * late for _, late in r["gil"]]
        gil.plot(xs, ys, ".", markersize=2)
        gil.set_yscale("log")
    gil.set_ylabel("GIL probe late (us)", fontsize=8)
    gil.set_xlabel("ms since the epoch began")
    gil.set_xlim(0, 1e3 * r["seconds"])
    fig.tight_layout()
    png = path.with_suffix(".png")
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return png


if __name__ == "__main__":
    for name in sys.argv[1:]:
        print(draw(Path(name)))
