#!/usr/bin/env python3
"""What each stateful loader restores exactly, run rather than read from the docs: torchdata's
StatefulDataLoader against torch_fastload.DataLoader, on the same cases.

Each case checkpoints after --k batches of a shuffled epoch (--samples samples of --batch), loads
the state into a loader built afresh under another global seed, and compares what it yields
with an uninterrupted run:
  mid-epoch w0 / w2       same settings, 0 or 2 worker processes
  other workers 2->0      checkpointed with 2 workers, resumed with 0 (and 0->2)
  other world 2->1 / 2->3 ranks simulated in one process (each rank's loader over its
                          DistributedSampler shard: torch_fastload's, torchdata's
                          StatefulDistributedSampler), every rank checkpoints after k batches,
                          rank 0's state loaded into each rank of the new world; exact = every
                          sample of the epoch seen once, before or after (padding aside)
  iterable w0 / w2        an IterableDataset (a seeded shuffle, split by worker), same workers
  iterable workers 2->1   an IterableDataset resumed with another worker count
Outcomes: exact; wrong (what differs); refused (the loader raised: no silent wrong batches).
The loaders run on the CPU (resume semantics do not depend on the device).
Target: every case StatefulDataLoader restores exactly, torch_fastload does too.

    python benchmarks/resume_peers.py        # seconds, CPU only
"""

from __future__ import annotations

import pickle
import sys
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset, IterableDataset, get_worker_info

import torch_fastload
from torch_fastload._benchutil import Study, log, parse_study, peers, study_parser, table


class Numbers(Dataset):
    """Sample i is tensor([i]): a batch says which samples it holds and in which order."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i):
        return torch.tensor([i])


class ShuffledStream(IterableDataset):
    """range(n) in a seeded order, split across worker processes by position."""

    def __init__(self, n: int, seed: int = 7):
        self.order = np.random.default_rng(seed).permutation(n).tolist()

    def __iter__(self):
        info = get_worker_info()
        step, start = (info.num_workers, info.id) if info else (1, 0)
        for i in self.order[start::step]:
            yield torch.tensor([i])


def make_loader(kind: str, dataset, batch: int, workers: int, seed: int, sampler=None):
    """``kind`` "torchdata" or "fastload"; shuffled by a generator seeded with ``seed`` (map
    datasets without a sampler), the global generator reseeded too."""
    torch.manual_seed(seed + 1000)
    kw = dict(num_workers=workers)
    if sampler is not None:
        kw["sampler"] = sampler
    elif not isinstance(dataset, IterableDataset):
        kw.update(shuffle=True, generator=torch.Generator().manual_seed(seed))
    if kind == "torchdata":
        return peers.stateful_loader(dataset, batch, **kw)
    return torch_fastload.DataLoader(dataset, batch, device="cpu", **kw)


def samples(batches) -> list[list[int]]:
    return [b.view(-1).tolist() for b in batches]


def roundtrip(state):
    """The state as a checkpoint file would bring it back."""
    return pickle.loads(pickle.dumps(state))


def outcome(run) -> dict:
    """``run()`` -> (exact, detail); a raised error is a refusal."""
    try:
        exact, detail = run()
        return {"outcome": "exact" if exact else "wrong", "detail": detail}
    except Exception as exc:
        return {"outcome": "refused", "detail": f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:200]}"}


def same_rest(kind: str, make, k: int, before: dict, after: dict) -> dict:
    """Checkpoint ``make(kind, seed=0, **before)`` after k batches; resume
    ``make(kind, seed=1, **after)``; exact when the rest equals the uninterrupted epoch's."""

    def run():
        full = samples(make(kind, seed=0, **before))
        loader = make(kind, seed=0, **before)
        it = iter(loader)
        for _ in range(k):
            next(it)
        state = roundtrip(loader.state_dict())
        del it
        resumed = make(kind, seed=1, **after)
        resumed.load_state_dict(state)
        rest = samples(resumed)
        if rest == full[k:]:
            return True, f"{len(rest)} batches, as uninterrupted"
        first = next((i for i, (a, b) in enumerate(zip(rest, full[k:])) if a != b), min(len(rest), len(full) - k))
        return False, f"{len(rest)} batches vs {len(full) - k}; first differing batch {first}"

    return outcome(run)


def other_world(kind: str, n: int, batch: int, k: int, old: int, new: int) -> dict:
    """Ranks simulated in one process; exact when the epoch's samples are all seen once."""

    def sampler(rank: int, world: int):
        if kind == "torchdata":
            from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler

            s = StatefulDistributedSampler(Numbers(n), num_replicas=world, rank=rank, shuffle=True, seed=3)
        else:
            s = torch_fastload.DistributedSampler(Numbers(n), num_replicas=world, rank=rank, shuffle=True, seed=3)
        s.set_epoch(0)
        return s

    def run():
        seen, state = [], None
        for rank in range(old):
            loader = make_loader(kind, Numbers(n), batch, 0, 0, sampler=sampler(rank, old))
            it = iter(loader)
            seen += [i for b in samples(next(it) for _ in range(k)) for i in b]
            if rank == 0:
                state = roundtrip(loader.state_dict())
            del it
        for rank in range(new):
            loader = make_loader(kind, Numbers(n), batch, 0, 1, sampler=sampler(rank, new))
            loader.load_state_dict(state)
            seen += [i for b in samples(loader) for i in b]
        counts = np.bincount(seen, minlength=n)
        skipped, repeated = int((counts == 0).sum()), int(np.clip(counts - 1, 0, None).sum())
        exact = skipped == 0 and repeated < new  # the new world's padding may repeat < new samples
        return exact, f"{skipped} samples skipped, {repeated} repeated (of {n})"

    return outcome(run)


def cases(args) -> dict:
    """case name -> kind -> outcome."""
    n, batch, k = args.samples, args.batch, args.k

    def mapped(kind, seed, workers):
        return make_loader(kind, Numbers(n), batch, workers, seed)

    def stream(kind, seed, workers):
        return make_loader(kind, ShuffledStream(n), batch, workers, seed)

    plan = {
        "mid-epoch w0": lambda kind: same_rest(kind, mapped, k, {"workers": 0}, {"workers": 0}),
        "mid-epoch w2": lambda kind: same_rest(kind, mapped, k, {"workers": 2}, {"workers": 2}),
        "other workers 2->0": lambda kind: same_rest(kind, mapped, k, {"workers": 2}, {"workers": 0}),
        "other workers 0->2": lambda kind: same_rest(kind, mapped, k, {"workers": 0}, {"workers": 2}),
        "other world 2->1": lambda kind: other_world(kind, n, batch, k, 2, 1),
        "other world 2->3": lambda kind: other_world(kind, n, batch, k, 2, 3),
        "iterable w0": lambda kind: same_rest(kind, stream, k, {"workers": 0}, {"workers": 0}),
        "iterable w2": lambda kind: same_rest(kind, stream, k, {"workers": 2}, {"workers": 2}),
        "iterable workers 2->1": lambda kind: same_rest(kind, stream, k, {"workers": 2}, {"workers": 1}),
    }
    kinds = ["torchdata", "fastload"] if args.torchdata else ["fastload"]
    out = {}
    for name, run in plan.items():
        out[name] = {kind: run(kind) for kind in kinds}
        log(f"  {name:<22} " + "  ".join(f"{kind}: {r['outcome']} ({r['detail']})" for kind, r in out[name].items()))
    return out


def main(argv=None) -> int:
    p = study_parser(__doc__, Path(__file__).resolve().parent / "out")
    p.add_argument("--samples", type=int, default=64, help="samples an epoch [64]")
    p.add_argument("--batch", type=int, default=4, help="[4]")
    p.add_argument("--k", type=int, default=5, help="batches before the checkpoint [5]")
    args = parse_study(p, argv)
    study = Study("resume_peers", args, "resume: torchdata StatefulDataLoader vs torch_fastload, run")
    torchdata = peers.status("torchdata")
    study["peers"] = {"torchdata": torchdata.as_dict()}
    args.torchdata = torchdata.installed
    log(f"  {torchdata.line()}")
    study["cases"] = results = cases(args)
    rows = []
    for name, by in results.items():
        rows.append(
            [name] + [f"{by[k]['outcome']}: {by[k]['detail']}" if k in by else "-" for k in ("torchdata", "fastload")]
        )
        ours = by["fastload"]["outcome"] == "exact"
        study.figure(f"fastload_exact_{name.replace(' ', '_')}", ours)
        if "torchdata" in by:
            study.figure(f"torchdata_exact_{name.replace(' ', '_')}", by["torchdata"]["outcome"] == "exact")
    theirs = [n for n, by in results.items() if by.get("torchdata", {}).get("outcome") == "exact"]
    missed = [n for n in theirs if results[n]["fastload"]["outcome"] != "exact"]
    if args.torchdata:
        study.verdict(
            "every case StatefulDataLoader restores exactly, torch_fastload does too",
            not missed,
            f"StatefulDataLoader exact in {len(theirs)} of {len(results)}; fastload misses: {missed or 'none'}",
        )
    else:
        study.verdict("every case StatefulDataLoader restores, fastload does too", None, torchdata.line())
    heads = ["case", f"torchdata {torchdata.version or '(not installed)'}", "torch_fastload"]
    title = (
        f"resume after {args.k} of {args.samples // args.batch} batches ({args.samples} samples, batch {args.batch})"
    )
    return study.finish(table(heads, rows, title))


if __name__ == "__main__":
    sys.exit(main())
