#!/usr/bin/env python3
"""The figures benchmarks/RESULTS.md cites, measured again, beside the record's values.

RESULTS.md's tables name each figure with a key in their first column, `study:key`: `key` is one
of the study's JSON "figures", or a dotted path into its JSON (list items by index), e.g.
`h2d_copy:pool_over_pinned_1MiB`, `bench:speedup`, `doctor:h2d.pinned.gbps`. This reads every
<study>.json under the given directories and prints, for each key found, the new value, the
record's value and their ratio; keys a run did not measure are listed at the end.

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
    rows, absent, unmeasured = [], set(), []
    for row in record_rows(RECORD.read_text()):
        path = found.get(row["study"])
        now = lookup(json.loads(path.read_text()), row["key"]) if path else None
        if path is None:
            absent.add(row["study"])
        elif not isinstance(now, (int, float)):
            unmeasured.append(f"{row['study']}:{row['key']}")
        else:
            then = first_number(row["value"])
            ratio = f"{now / then:.2f}" if then else "-"
            rows.append((f"{row['study']}:{row['key']}", f"{now:,.4g}", row["value"][:24], ratio, row["figure"][:44]))
    heads = ("key", "now", "record", "now/record", "figure")
    widths = [max(len(r[i]) for r in rows + [heads]) for i in range(4)]
    for r in [heads, *rows]:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[4])
    if unmeasured:
        print(f"\nnot in this run's JSON ({len(unmeasured)}): {', '.join(unmeasured)}")
    if absent:
        print(f"\nno JSON here: {', '.join(sorted(absent))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
