#!/usr/bin/env python3
"""The figures benchmarks/RESULTS.md cites, measured again, beside the record's values.

RESULTS.md's tables name each figure with a key in their first column, `study:key`: `key` is one
of the study's JSON "figures", or a dotted path into its JSON (list items by index), e.g.
`h2d_copy:pool_over_pinned_1MiB`, `bench:speedup`, `doctor:h2d.pinned.gbps`. This reads every
<study>.json under the given directories and prints, for each key found, the new value, the
record's value and their ratio. Keys with no JSON here are listed once at the end.

    python benchmarks/compare.py OUT_DIR [OUT_DIR ...]
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

RECORD = Path(__file__).resolve().parent / "RESULTS.md"
ROW = re.compile(r"^\|\s*`(?P<study>[\w-]+):(?P<key>[^`]+)`\s*\|(?P<rest>.*)\|\s*$")


def record_rows(text: str) -> list[dict]:
    """Every table row whose first cell is a `study:key`: its figure, value and baseline cells."""
    rows = []
    for line in text.splitlines():
        m = ROW.match(line.strip())
        if m:
            cells = [c.strip() for c in m["rest"].split("|")]
            rows.append({"study": m["study"], "key": m["key"], "figure": cells[0], "value": cells[1]})
    return rows


def lookup(data: dict, key: str):
    if key in (data.get("figures") or {}):
        return data["figures"][key]
    node = data
    for part in key.split("."):
        if isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        elif isinstance(node, dict) and part in node:
            node = node[part]
        else:
            return None
    return node


def first_number(text: str) -> float | None:
    m = re.search(r"-?\d[\d,]*\.?\d*", text.replace("**", ""))
    if not m:
        return None
    value = float(m.group().replace(",", ""))
    return value / 100 if text[m.end() : m.end() + 1] == "%" else value


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("dirs", nargs="+", type=Path, help="where the studies wrote their JSON")
    args = p.parse_args(argv)
    found = {f.stem: f for d in args.dirs for f in sorted(d.rglob("*.json"))}
    rows, missing = [], set()
    for row in record_rows(RECORD.read_text()):
        path = found.get(row["study"])
        if path is None:
            missing.add(row["study"])
            continue
        now = lookup(json.loads(path.read_text()), row["key"])
        then = first_number(row["value"])
        ratio = f"{now / then:.2f}" if isinstance(now, (int, float)) and then else "-"
        shown = f"{now:,.4g}" if isinstance(now, (int, float)) else "missing"
        rows.append((f"{row['study']}:{row['key']}", shown, row["value"], ratio, row["figure"]))
    widths = [max(len(r[i]) for r in rows + [("key", "now", "record", "now/record", "")]) for i in range(4)]
    print("  ".join(h.ljust(w) for h, w in zip(("key", "now", "record", "now/record"), widths)) + "  figure")
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[4])
    if missing:
        print(f"\nnot run here: {', '.join(sorted(missing))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
