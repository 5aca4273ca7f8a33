"""Issue 17: where the loader's group turns should run, workload by workload: on the turn thread
(config turn_thread, the default for CUDA outputs) or inside next() (turn_thread=0), alternated,
with what a rule choosing between them could read.

Each workload is fed by one TensorDataset loader (ROW_KIB-KiB rows, batch 256, shuffled):
  launch-bound     LAUNCHES tiny kernels a step, nothing waited for
  sync each step   a bf16 GEMM step about as long as the batch's transfer, then .item() (a
                   spinning wait every step)
  GEMM, 2 ahead    the same step, the host kept 2 steps ahead by polling an event (beside_step.py)
  MLP train step   forward, backward() and an SGD step of a 4-layer MLP on the batch's first
                   KiB a row (backward() waits in autograd's device thread, as the main job's)
Per run: steps/s after a warm-up; with the turn thread, each turn's wall seconds over its CPU
seconds on the turn thread (above 1: it waited for the GIL between its pieces, so it took the
GIL mid-step) and the training thread's CPU share between next() calls (a spinning wait counts
as CPU). A rule is good if it picks, per workload, the mode with more steps/s.

    python3 benchmarks/gpu/turn_contention_probe.py [--rounds 5]   # JSON on stdout's last line
    python3 benchmarks/gpu/turn_contention_probe.py --device cpu --rows 2048 --row-kib 16 --batch-size 16 --steps 100
        (a smoke run: host outputs, turn_thread=1 for the thread)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import beside_step as bs  # noqa: E402
import step_cpu_share as cpu_share  # noqa: E402

import torch_fastload  # noqa: E402
from torch_fastload import native  # noqa: E402
from torch_fastload._benchutil import InflightWindow, gemm_seconds, h2d_copy_seconds  # noqa: E402

WARMUP = 40
_turns: list = []  # (wall s, turn thread's CPU s) of each turn taken on the turn thread


def _instrument() -> None:
    """Time each turn on the turn thread, and the training thread's CPU share between next()
    calls (``step_cpu_share``'s wrapper: its ``_shares``)."""
    take_turn = native.NativePipeline._take_turn

    def timed_turn(self):
        wall, cpu = time.perf_counter(), time.thread_time()
        try:
            return take_turn(self)
        finally:
            _turns.append((time.perf_counter() - wall, time.thread_time() - cpu))

    native.NativePipeline._take_turn, native.NativePipeline.next = timed_turn, cpu_share._timed_next


def workloads(args, device, rows: torch.Tensor) -> dict:
    """name -> a step function of a batch (run once per batch)."""
    x = torch.zeros(1, device=device)
    cuda = device.type == "cuda"
    dim = 4096 if cuda else 256
    dtype = torch.bfloat16 if cuda else torch.float32
    a, b = (torch.randn(dim, dim, device=device, dtype=dtype) for _ in range(2))
    if cuda:
        batch_bytes = args.batch_size * args.row_kib * 1024
        src = torch.empty(batch_bytes, dtype=torch.uint8, pin_memory=True)
        dst = torch.empty(batch_bytes, dtype=torch.uint8, device=device)
        transfer = statistics.median(h2d_copy_seconds(src, dst, reps=10))
        gemms = max(1, round(transfer / gemm_seconds(a, b, warmup=10)))
    else:
        gemms = 1
    mlp = torch.nn.Sequential(*(torch.nn.Linear(1024, 1024) for _ in range(4))).to(device)
    opt = torch.optim.SGD(mlp.parameters(), lr=1e-6)
    window = InflightWindow(device, 2)

    def launch_bound(batch):
        for _ in range(args.launches):
            x.add_(1)

    def gemm(batch):
        acc = batch.view(-1)[:: max(1, batch.numel() // 1024)].float().sum()
        for _ in range(gemms):
            a @ b
        return acc

    def sync_each_step(batch):
        gemm(batch).item()

    def gemm_two_ahead(batch):
        gemm(batch)
        window.step_done()

    def mlp_step(batch):
        inputs = batch[:, :1024].float() / 255
        loss = mlp(inputs).square().mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    return {
        "launch-bound": launch_bound,
        "sync each step": sync_each_step,
        "GEMM, 2 ahead": gemm_two_ahead,
        "MLP train step": mlp_step,
    }


def run(step, loader, steps: int, device) -> float:
    """Steps a second over ``steps`` steps after the warm-up, epoch after epoch of ``loader``."""
    feed = bs.endless(lambda: loader)
    for i in range(WARMUP + steps):
        if i == WARMUP:
            if device.type == "cuda":
                torch.cuda.synchronize()
            _turns.clear(), cpu_share._shares.clear(), cpu_share._last.clear()
            started = time.perf_counter()
        step(bs.first_field(next(feed)))
    if device.type == "cuda":
        torch.cuda.synchronize()
    return steps / (time.perf_counter() - started)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--rows", type=int, default=4096)
    p.add_argument("--row-kib", type=int, default=192)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--launches", type=int, default=150, help="tiny kernels a launch-bound step [150]")
    p.add_argument("--only", default="", help="comma-separated workload names (default: all)")
    p.add_argument("--device", default="cuda")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    _instrument()
    rows = torch.randint(0, 256, (args.rows, args.row_kib * 1024), dtype=torch.uint8)
    dataset = torch.utils.data.TensorDataset(rows)
    thread = "auto" if device.type == "cuda" else True
    modes = {"turn thread": thread, "turns in next()": False}
    out: dict = {}
    for name, step in workloads(args, device, rows).items():
        if args.only and not any(n.strip() in name for n in args.only.split(",")):
            continue
        runs: dict = {m: [] for m in modes}
        turns, shares = [], []
        for k in range(args.rounds):
            for mode in list(modes) if k % 2 == 0 else list(modes)[::-1]:
                with torch_fastload.config.override(turn_thread=modes[mode]):
                    loader = torch_fastload.DataLoader(
                        dataset, batch_size=args.batch_size, shuffle=True, drop_last=True, device=device
                    )
                    runs[mode].append(run(step, loader, args.steps, device))
                    loader.close()
                if mode == "turn thread":
                    turns += [w / c for w, c in _turns if c > 5e-6]
                    shares += list(cpu_share._shares)
        thread_vs_next = [t / n for t, n in zip(runs["turn thread"], runs["turns in next()"])]
        out[name] = {
            "steps_per_s": runs,
            "thread_vs_next": statistics.median(thread_vs_next),
            "turn_wall_over_cpu": statistics.median(turns) if turns else None,
            "turns": len(turns),
            "training_share": statistics.median(shares) if shares else None,
        }
        r = out[name]
        wall_cpu = f"{r['turn_wall_over_cpu']:.2f}" if turns else "-"
        share = f"{r['training_share']:.3f}" if shares else "-"
        print(
            f"{name}: steps/s thread {statistics.median(runs['turn thread']):.0f}, in next() "
            f"{statistics.median(runs['turns in next()']):.0f} (thread / next {r['thread_vs_next']:.3f}, pairs "
            f"{min(thread_vs_next):.3f}-{max(thread_vs_next):.3f}); turn wall / CPU {wall_cpu} over {len(turns)} "
            f"turns; training thread's CPU share {share}",
            flush=True,
        )
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
