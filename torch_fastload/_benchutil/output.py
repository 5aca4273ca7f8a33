"""What a benchmark prints and writes: lines, tables, progress bars, JSON, plots."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

from .. import fileio

try:  # progress bars are optional
    from tqdm import tqdm as _tqdm
except Exception:  # pragma: no cover - tqdm missing
    _tqdm = None

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30


def log(msg: str = "") -> None:
    """Print and flush (progress bars share the terminal)."""
    print(msg, flush=True)


def error_text(exc: BaseException) -> str:
    """``"TypeName: message"``."""
    return f"{type(exc).__name__}: {exc}"


def fmt(value, spec: str = ".2f", missing: str = "-") -> str:
    """``format(value, spec)``; ``missing`` for None, NaN and infinities."""
    if value is None or (isinstance(value, float) and (math.isnan(value) or math.isinf(value))):
        return missing
    return format(value, spec)


def fmt_size(nbytes: int) -> str:
    """``1 GiB``, ``64 MiB``, ``256 KiB``, ``4096 B``; fractional MiB where nothing divides."""
    for unit, name in ((GiB, "GiB"), (MiB, "MiB"), (KiB, "KiB")):
        if nbytes >= unit and nbytes % unit == 0:
            return f"{nbytes // unit} {name}"
    return f"{nbytes / MiB:.2f} MiB" if nbytes >= MiB else f"{nbytes} B"


def gbps(nbytes: float, seconds: float | None) -> float | None:
    """Decimal GB/s, None without a positive time."""
    return nbytes / seconds / 1e9 if seconds and seconds > 0 else None


def ratio(a, b) -> float | None:
    """``a / b``, None where either is missing or ``b`` is zero."""
    return a / b if (a is not None and b) else None


def table(headers: list, rows: list, title: str | None = None, first_left: bool = True) -> str:
    """A right-aligned plain-text table (the first column left-aligned if ``first_left``)."""
    cells = [[str(c) for c in row] for row in rows]
    widths = [len(str(h)) for h in headers]
    for row in cells:
        for i, c in enumerate(row):
            widths[i] = max(widths[i], len(c))

    def line(items):
        return "  ".join(
            str(c).ljust(w) if (i == 0 and first_left) else str(c).rjust(w)
            for i, (c, w) in enumerate(zip(items, widths))
        )

    out = [title] if title else []
    out.append(line(headers))
    out.append("  ".join("-" * w for w in widths))
    out.extend(line(row) for row in cells)
    return "\n".join(out)


class Progress:
    """A tqdm bar on stderr when tqdm is importable and wanted; otherwise nothing."""

    def __init__(self, total: int, desc: str, enabled: bool = True):
        self.bar = (
            _tqdm(total=total, desc=desc, leave=False, file=sys.stderr, dynamic_ncols=True, mininterval=0.25)
            if (enabled and _tqdm is not None)
            else None
        )

    def update(self, n: int = 1, note: str | None = None) -> None:
        """Advance by ``n``; ``note`` replaces the bar's postfix text."""
        if self.bar is not None:
            if note:
                self.bar.set_postfix_str(note, refresh=False)
            self.bar.update(n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def write_json(path: Path, obj) -> None:
    """``obj`` as indented JSON, written to a new temporary file (``mkstemp`` beside ``path``:
    a symlink planted at a predictable name cannot redirect it) and renamed: never half a file."""
    fileio.write_atomic(path, lambda f: json.dump(obj, f, indent=1, default=str))


def pyplot():
    """matplotlib.pyplot on the Agg backend, or None (and a note) where matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("  (matplotlib missing: no plot)")
        return None
    return plt
