"""Shared by the GPU host's edge probes (epoch_edges.py, edge_pieces.py)."""

import time


def wrap_timed(owner, name: str, record) -> None:
    """Replace ``owner.name`` with a wrapper that passes the seconds of each call to ``record``
    (raised calls too)."""
    f = getattr(owner, name)

    def timed(*a, **k):
        t = time.perf_counter()
        try:
            return f(*a, **k)
        finally:
            record(time.perf_counter() - t)

    setattr(owner, name, timed)
