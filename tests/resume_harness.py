"""One resume check for every stateful loader: checkpoint after 0, 1, k and the last batches,
reload in a fresh process, and compare the rest with an uninterrupted run.

    check_resume("test_resume:array_loader", {"root": ...}, child_overrides={"fetch_threads": 3})

A factory is ``module:function`` importable from tests/ (the child process imports it too),
called as ``factory(seed=..., **kwargs)``; it seeds torch's generator with ``seed`` (as a
script would), builds the loader (sampler epoch set, etc.) and returns it. The child gets
another ``seed``: everything that decides the rest of the epoch must come from the state.
Run as a script, this file is the child: ``resume_harness.py SPEC KWARGS_JSON STATE_JSON OUT``.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent


def build(spec: str, seed: int, kwargs: dict):
    module, function = spec.split(":")
    sys.path.insert(0, str(HERE))
    return getattr(importlib.import_module(module), function)(seed=seed, **kwargs)


def to_cpu(batch):
    """A batch as plain CPU objects (tensors, lists, dicts), comparable and picklable."""
    if isinstance(batch, torch.Tensor):
        return batch.detach().cpu().clone()
    if isinstance(batch, dict):
        return {k: to_cpu(v) for k, v in batch.items()}
    if hasattr(batch, "_asdict"):  # namedtuples (RecordBatch, SampledBatch-likes)
        return {"__type__": type(batch).__name__, **{k: to_cpu(v) for k, v in batch._asdict().items()}}
    if hasattr(batch, "__dataclass_fields__"):
        return {"__type__": type(batch).__name__, **{k: to_cpu(getattr(batch, k)) for k in batch.__dataclass_fields__}}
    if isinstance(batch, (list, tuple)):
        return [to_cpu(v) for v in batch]
    return batch


def assert_equal(a, b, where: str) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, (
            f"{where}: {getattr(b, 'dtype', type(b))}{tuple(getattr(b, 'shape', ()))} vs {a.dtype}{tuple(a.shape)}"
        )
        assert torch.equal(a, b), f"{where}: values differ"
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b), f"{where}: keys {list(b)} vs {list(a)}"
        for key in a:
            assert_equal(a[key], b[key], f"{where}[{key!r}]")
    elif isinstance(a, list):
        assert isinstance(b, list) and len(a) == len(b), f"{where}: lengths differ"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_equal(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {b!r} vs {a!r}"


def run_child(spec: str, kwargs: dict, state: dict, seed: int, timeout: float = 300) -> list:
    """Build the loader in a fresh interpreter, load ``state``, return the rest of its epoch."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rest.pt")
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE.parent), os.environ.get("PYTHONPATH", "")]))
        proc = subprocess.run(
            [
                sys.executable,
                str(HERE / "resume_harness.py"),
                spec,
                json.dumps(kwargs),
                json.dumps(state),
                out,
                str(seed),
            ],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=env,
        )
        assert proc.returncode == 0, f"resumed child failed:\n{proc.stdout}\n{proc.stderr}"
        return torch.load(out, weights_only=False)


def check_resume(
    spec: str,
    kwargs: dict,
    *,
    points: Iterable[int] | None = None,
    child_overrides: dict | None = None,
    fresh_process: bool = True,
) -> list:
    """Checkpoint after each of ``points`` batches (default 0, 1, k = half and the last),
    resume from the JSON round-tripped state, compare the rest with an uninterrupted run.
    Returns the uninterrupted epoch's batches."""
    full = [to_cpu(b) for b in build(spec, 0, kwargs)]
    assert len(full) >= 2, f"{spec} gave {len(full)} batches: too few to test a resume"
    points = sorted(set(points if points is not None else (0, 1, len(full) // 2, len(full) - 1, len(full))))
    child_kwargs = {**kwargs, **(child_overrides or {})}
    for k in points:
        loader = build(spec, 0, kwargs)
        iterator = iter(loader)
        head = [to_cpu(next(iterator)) for _ in range(k)]
        state = json.loads(json.dumps(loader.state_dict()))  # what a checkpoint file holds
        del iterator
        for i, batch in enumerate(head):
            assert_equal(full[i], batch, f"{spec} batch {i} before the checkpoint")
        if fresh_process:
            rest = run_child(spec, child_kwargs, state, seed=1)
        else:
            resumed = build(spec, 1, child_kwargs)
            resumed.load_state_dict(state)
            rest = [to_cpu(b) for b in resumed]
        expected = full[k:]  # after the last batch (before StopIteration): nothing left
        assert len(rest) == len(expected), (
            f"{spec}: after {k} of {len(full)} batches the resumed run gave "
            f"{len(rest)} batches, expected {len(expected)}"
        )
        for i, (want, got) in enumerate(zip(expected, rest)):
            assert_equal(want, got, f"{spec} checkpoint after {k}: batch {k + i}")
    return full


def _child(argv: list) -> None:
    spec, kwargs, state, out, seed = argv[0], json.loads(argv[1]), json.loads(argv[2]), argv[3], int(argv[4])
    loader = build(spec, seed, kwargs)
    loader.load_state_dict(state)
    torch.save([to_cpu(b) for b in loader], out)


if __name__ == "__main__":
    _child(sys.argv[1:])
