"""ImageNet training in the style of the PyTorch ImageNet example, fed by torch_fastload.

    python examples/imagenet.py                          # embedded default: generated real-photo JPEGs
    python examples/imagenet.py --data /datasets/imagenet --arch resnet50 --epochs 90
    torchrun --nproc-per-node 2 examples/imagenet.py --data /datasets/imagenet   # DDP
    python examples/imagenet.py --loader torch           # the same model fed by torch's DataLoader

--data is an ImageNet folder with train/ and val/ (``<class>/<image>.JPEG``), or a folder of
two packs made by ``python -m torch_fastload pack`` (train/ and val/ holding meta.json).
Without --data a folder of ImageNet-like JPEGs (real photographs, ~110 KB, 500x375, with a
CMYK, a grayscale and a PNG-named-.JPEG file) is generated once under --sample-dir.

--loader fastload (default): encoded bytes read by the C++ engine, decoded by nvJPEG or the C++
decoder (the first batches time both and keep the faster) and augmented on the GPU
(torch_fastload.sources.ImageFolder). --loader torch: torchvision's
ImageFolder + PIL transforms + torch DataLoader(num_workers, pin_memory). --loader synthetic:
one batch kept on the GPU (the step time with no input pipeline at all, for comparison).
--loader dali: NVIDIA DALI's ResNet-50 example pipeline (hardware/nvJPEG decode, --workers
threads, fp16 NHWC under autocast), a peer for benchmarks/imagenet_train.py.

Training: SGD (momentum 0.9, nesterov off, weight decay 1e-4, no decay on norms and biases),
learning rate 0.1 x batch/256 with linear warmup and cosine decay, bf16 autocast on a GPU,
channels_last, top-1/top-5 validation each epoch, a checkpoint each epoch (--resume continues
from it). --json writes the figures (train images/s, input-wait fraction, step time).

Without a GPU the defaults are CPU-sized (ResNet-18, batch 16, float32, 12 steps, a 10-class
sample set) and one printed line says so; any option given explicitly wins.

Distributed (torchrun): one process a GPU (cuda:LOCAL_RANK, backend nccl; on a machine without
CUDA the processes train on the CPU over gloo, for smoke tests). The training set is sharded by
torch_fastload.DistributedSampler (torch's where the package has none) with set_epoch each
epoch; losses, accuracies and throughput are all-reduced; rank 0 alone prints and saves.

    torchrun --nproc-per-node 8 examples/imagenet.py --data /datasets/imagenet
    torchrun --nnodes 2 --node-rank 0 --master-addr HOST0 --master-port 29500 --nproc-per-node 8 \
        examples/imagenet.py --data /datasets/imagenet          # and --node-rank 1 on the other node

Mid-epoch checkpoints: --checkpoint-every N also saves every N steps (model, optimizer, the
schedule's position, epoch, step and the loader's state_dict()); --resume then continues
inside that epoch with exactly the batches that were left (the loader's load_state_dict();
a loader without one replays the epoch's order and skips the batches already trained).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torchvision

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

import torch_fastload  # noqa: E402
from torch_fastload.sources import ImageFolder, PackedImageFolder  # noqa: E402
from torch_fastload.vision import EvalTransform, TrainTransform  # noqa: E402
from torch_fastload.vision.route_trial import cpu_share_of, engine_share_of, on_engines, route_name  # noqa: E402
from torch_fastload.vision.sample_data import make_image_folder  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--data", help="ImageNet folder (train/, val/) or a folder of train/val packs")
    p.add_argument(
        "--sample-dir",
        default=None,
        help="where the embedded default dataset is generated (once) [cache/imagenet-sample, on the CPU "
        "cache/imagenet-sample-cpu]",
    )
    p.add_argument("--sample-classes", type=int, default=None, help="[100 / CPU 10]")
    p.add_argument("--sample-train-per-class", type=int, default=None, help="[40 / CPU 16]")
    p.add_argument("--sample-val-per-class", type=int, default=None, help="[10 / CPU 4]")
    p.add_argument("--arch", default=None, help="a torchvision.models constructor name [resnet50 / CPU resnet18]")
    p.add_argument("--loader", choices=("fastload", "torch", "synthetic", "dali"), default="fastload")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--steps-per-epoch", type=int, default=0, help="stop each epoch after N steps (0: all)")
    p.add_argument("--batch-size", type=int, default=None, help="per GPU [256 / CPU 16]")
    p.add_argument("--lr", type=float, default=None, help="default 0.1 x global batch / 256")
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--weight-decay", type=float, default=1e-4)
    p.add_argument("--warmup-epochs", type=float, default=0.5)
    p.add_argument("--label-smoothing", type=float, default=0.1)
    p.add_argument(
        "--workers", type=int, default=None, help="worker processes of --loader torch (threads of dali) [16 / CPU 2]"
    )
    p.add_argument("--amp", dest="amp", action="store_true", default=None, help="bf16 autocast [GPU: on]")
    p.add_argument("--no-amp", dest="amp", action="store_false", help="train in float32 [CPU: float32]")
    p.add_argument("--no-channels-last", action="store_true")
    p.add_argument("--compile", action="store_true", help="torch.compile the model")
    p.add_argument("--evaluate", action="store_true", help="only validate (with --resume)")
    p.add_argument("--no-val", action="store_true", help="skip validation")
    p.add_argument("--checkpoint-dir", default="checkpoints")
    p.add_argument(
        "--checkpoint-every",
        type=int,
        default=0,
        metavar="STEPS",
        help="also checkpoint every STEPS training steps, mid-epoch (0: at epoch ends only)",
    )
    p.add_argument(
        "--max-steps", type=int, default=None, help="stop after N training steps in all (0: no limit) [0 / CPU 12]"
    )
    p.add_argument("--resume", help="checkpoint to continue from (an epoch end or mid-epoch)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--warmup-steps", type=int, default=None, help="steps left out of the throughput figures [10 / CPU 2]"
    )
    p.add_argument("--json", help="write the run's figures here")
    p.add_argument("--no-progress", action="store_true")
    return p.parse_args(argv)


# GPU-sized defaults, and what a CPU can train in about a minute: ResNet-50 at batch 256 under bf16
# autocast ran no step in 8 minutes on a CPU machine (13 GB resident)
GPU_DEFAULTS = dict(
    arch="resnet50",
    batch_size=256,
    amp=True,
    workers=16,
    max_steps=0,
    warmup_steps=10,
    sample_classes=100,
    sample_train_per_class=40,
    sample_val_per_class=10,
    sample_dir="imagenet-sample",
)
CPU_DEFAULTS = dict(
    arch="resnet18",
    batch_size=16,
    amp=False,
    workers=2,
    max_steps=12,
    warmup_steps=2,
    sample_classes=10,
    sample_train_per_class=16,
    sample_val_per_class=4,
    sample_dir="imagenet-sample-cpu",
)


def apply_defaults(args, device: torch.device) -> str | None:
    """Fill the options left unset with the GPU's or, without a GPU, the CPU's defaults (an
    explicit argument always wins); on the CPU, the line that says so (None on a GPU)."""
    defaults = GPU_DEFAULTS if device.type == "cuda" else CPU_DEFAULTS
    picked = []
    for key, value in defaults.items():
        if getattr(args, key) is not None:
            continue
        if key == "sample_dir":
            value = os.path.join(torch_fastload.config.cache_dir(), value)
        elif not (key.startswith("sample_") and args.data):
            picked.append(
                f"--{key.replace('_', '-')} {value}" if key != "amp" else "--no-amp" if not value else "--amp"
            )
        setattr(args, key, value)
    args.no_amp = not args.amp
    if device.type == "cuda":
        return None
    return (
        f"no GPU: CPU-sized defaults ({' '.join(picked) or 'none: all set by you'}); the figures show the CPU's "
        "speed, not the loader's (nvJPEG, pinned copies and their overlap need a GPU); pass any option to override"
    )


# -- distributed -----------------------------------------------------------------------------


def setup_distributed():
    """torchrun sets WORLD_SIZE/RANK/LOCAL_RANK; a plain launch is rank 0 of 1. Each process
    takes cuda:LOCAL_RANK with nccl, or the CPU with gloo where there is no CUDA device."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        local_rank = int(os.environ["LOCAL_RANK"])
        if torch.cuda.is_available():
            torch.cuda.set_device(local_rank)
            device = torch.device("cuda", local_rank)
            dist.init_process_group("nccl")
        else:
            device = torch.device("cpu")
            dist.init_process_group("gloo")
        return dist.get_rank(), dist.get_world_size(), device
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    return 0, 1, device


def distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def all_reduce(values: list[float], device, op=None) -> list[float]:
    """``values`` summed (or ``op``) over the ranks; unchanged in a single process."""
    if not distributed():
        return list(values)
    # nccl reduces device tensors, gloo host tensors
    t = torch.tensor(values, dtype=torch.float64, device=device if dist.get_backend() == "nccl" else "cpu")
    dist.all_reduce(t, op=op if op is not None else dist.ReduceOp.SUM)
    return t.tolist()


def all_reduce_sum(values: list[float], device) -> list[float]:
    return all_reduce(values, device)


# -- data ------------------------------------------------------------------------------------


def find_data(args, rank: int) -> tuple[str, str]:
    if args.data:
        train, val = os.path.join(args.data, "train"), os.path.join(args.data, "val")
        for split in (train, val):
            if not os.path.isdir(split):
                raise SystemExit(f"--data {args.data}: expected {split} (an ImageFolder or a pack)")
        return train, val
    if int(os.environ.get("LOCAL_RANK", "0")) == 0:  # once per node; the others wait
        make_image_folder(
            args.sample_dir,
            args.sample_classes,
            args.sample_train_per_class,
            args.sample_val_per_class,
            progress=not args.no_progress and rank == 0,
        )
    if distributed():
        dist.barrier()
    return make_image_folder(
        args.sample_dir, args.sample_classes, args.sample_train_per_class, args.sample_val_per_class, progress=False
    )


def fastload_dataset(path: str, transform):
    if os.path.exists(os.path.join(path, "meta.json")):
        return PackedImageFolder(path, transform)
    return ImageFolder(path, transform)


def make_loaders(args, train_dir, val_dir, device, world_size, rank):
    channels_last = not args.no_channels_last
    # bf16 input under bf16 autocast: the first conv would cast to bf16 anyway; half the bytes
    dtype = torch.bfloat16 if (not args.no_amp and device.type == "cuda") else torch.float32
    sampler_kw = {}
    if args.loader == "dali":  # a peer for the benchmarks: DALI's reader shards and shuffles itself
        from torch_fastload._benchutil import peers

        try:
            peers.require("dali", device)
        except peers.PeerUnavailable as why:
            raise SystemExit(f"--loader dali: {why}") from None

        def dali(path, training):
            return peers.dali_image_loader(
                path,
                args.batch_size,
                args.workers,
                device,
                half_nhwc=dtype != torch.float32,  # DALI has no bf16 output: fp16 NHWC
                training=training,
                shard_id=rank,
                num_shards=world_size,
            )

        classes = sum(1 for d in os.scandir(train_dir) if d.is_dir())
        return dali(train_dir, True), None if args.no_val else dali(val_dir, False), None, classes
    if args.loader in ("fastload", "synthetic"):
        train_ds = fastload_dataset(train_dir, TrainTransform(dtype=dtype, channels_last=channels_last))
        val_ds = fastload_dataset(val_dir, EvalTransform(dtype=dtype, channels_last=channels_last))
        make = torch_fastload.DataLoader
        loader_kw = dict(device=device)
    else:
        import torchvision.transforms as T

        norm = T.Normalize(mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225])
        train_ds = torchvision.datasets.ImageFolder(
            train_dir, T.Compose([T.RandomResizedCrop(224), T.RandomHorizontalFlip(), T.ToTensor(), norm])
        )
        val_ds = torchvision.datasets.ImageFolder(
            val_dir, T.Compose([T.Resize(256), T.CenterCrop(224), T.ToTensor(), norm])
        )
        make = torch.utils.data.DataLoader
        loader_kw = dict(num_workers=args.workers, pin_memory=True, persistent_workers=args.workers > 0)
    # the training order is a function of (seed, epoch) alone, on one process too: a resumed run
    # replays it, and the sampler's state (a mid-epoch checkpoint) can be restored
    Sampler = getattr(torch_fastload, "DistributedSampler", torch.utils.data.distributed.DistributedSampler)
    train_sampler = Sampler(train_ds, num_replicas=world_size, rank=rank, shuffle=True, seed=args.seed)
    val_sampler = None
    if world_size > 1:
        val_sampler = Sampler(val_ds, num_replicas=world_size, rank=rank, shuffle=False)
    train = make(
        train_ds,
        batch_size=args.batch_size,
        shuffle=train_sampler is None,
        sampler=train_sampler,
        drop_last=True,
        **loader_kw,
        **sampler_kw,
    )
    val = make(val_ds, batch_size=args.batch_size, shuffle=False, sampler=val_sampler, **loader_kw)
    return train, val, train_sampler, len(train_ds.classes)


class SyntheticBatches:
    """One realistic batch held on the GPU, yielded ``steps`` times: the step time of the model
    with no input pipeline, the baseline of the end-to-end figures."""

    def __init__(self, loader, steps: int, device):
        x, y = next(iter(loader))
        self.x, self.y, self.steps = x.to(device), y.to(device), steps

    def __iter__(self):
        for _ in range(self.steps):
            yield self.x, self.y

    def __len__(self):
        return self.steps


# -- training --------------------------------------------------------------------------------


def param_groups(model, weight_decay):
    decay, no_decay = [], []
    for p in model.parameters():
        (no_decay if p.ndim <= 1 else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def lr_at(step, total, warmup, base):
    if step < warmup:
        return base * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return 0.5 * base * (1 + math.cos(math.pi * min(1.0, progress)))


def accuracy(output, target, topk=(1, 5)):
    k = min(max(topk), output.shape[1])
    pred = output.topk(k, 1).indices
    correct = pred.eq(target.view(-1, 1))
    return [correct[:, : min(t, k)].any(1).float().sum() for t in topk]


def progress(iterable, total, desc, enabled):
    if not enabled:
        return iterable
    try:
        from tqdm import tqdm
    except ImportError:
        return iterable
    return tqdm(iterable, total=total, desc=desc, dynamic_ncols=True, mininterval=1.0)


def train_epoch(
    model, loader, criterion, optimizer, schedule, epoch, args, device, state, resume=None, checkpoint=None
) -> dict:
    """One epoch (or what is left of it after a mid-epoch checkpoint: ``resume``). Returns the
    epoch's figures, all-reduced over the ranks. ``checkpoint(epoch, epoch_step)`` is called
    every --checkpoint-every steps (on every rank: the loaders' states are gathered)."""
    model.train()
    channels_last = not args.no_channels_last
    world = dist.get_world_size() if distributed() else 1
    steps = len(loader) if not args.steps_per_epoch else min(args.steps_per_epoch, len(loader))
    start = 0
    replay = 0  # batches to draw and drop: a resumed epoch on a loader without load_state_dict
    if resume is not None and resume["epoch_step"]:
        done_samples = resume["epoch_step"] * resume["batch_size"] * resume["world_size"]
        start = done_samples // (args.batch_size * world)
        if resume["world_size"] != world and done_samples % (args.batch_size * world):
            print(
                f"warning: the checkpoint's {done_samples} samples of epoch {epoch} are not whole batches of "
                f"{args.batch_size} x {world} ranks: resuming after {start} batches",
                file=sys.stderr,
            )
        states = resume.get("loader_states")
        loader_state = None
        if states:
            loader_state = states[dist.get_rank() if distributed() else 0] if len(states) == world else states[0]
        if loader_state is not None and hasattr(loader, "load_state_dict"):
            loader.load_state_dict(loader_state)  # after set_epoch, before iter: the batches that were left
        else:
            if resume["world_size"] != world:
                print(
                    "warning: the loader has no load_state_dict() and the world size changed: the resumed "
                    "epoch replays this world size's order",
                    file=sys.stderr,
                )
            replay = start
    it = iter(loader)
    for _ in range(replay):  # the same order (sampler seeded by seed and epoch): skip what was trained
        next(it)
    timed_images = timed_wait = 0.0
    timed_start = None
    bar = progress(range(start, steps), steps - start, f"epoch {epoch} train", state["show"])
    loss_sum = torch.zeros((), device=device)
    checksum = torch.zeros((), dtype=torch.float64, device=device)
    trained = samples = 0
    stopped = False
    saved_at = None
    for i in bar:
        if args.max_steps and state["step"] >= args.max_steps:
            stopped = True
            break
        if timed_start is None and state["step"] >= state["timing_from"]:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            timed_start = time.perf_counter()
        waited = time.perf_counter()
        try:
            images, target = next(it)
        except StopIteration:
            break
        images = images.to(device, non_blocking=True)
        target = target.to(device, non_blocking=True)
        if channels_last:
            images = images.contiguous(memory_format=torch.channels_last)
        wait = time.perf_counter() - waited
        for group in optimizer.param_groups:
            group["lr"] = schedule(state["step"])
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=not args.no_amp):
            output = model(images)
            loss = criterion(output, target)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        loss_sum += loss.detach()
        # which samples, in which order: (label + 1) x (position in the epoch + 1), summed over ranks
        position = i * args.batch_size + torch.arange(1, len(target) + 1, device=device, dtype=torch.float64)
        checksum += ((target.to(torch.float64) + 1) * position).sum()
        if timed_start is not None:
            timed_images += len(target)
            timed_wait += wait
        state["step"] += 1
        trained += 1
        samples += len(target)
        if state["show"] and i % 20 == 0 and hasattr(bar, "set_postfix"):
            bar.set_postfix(loss=f"{loss.item():.3f}", lr=f"{optimizer.param_groups[0]['lr']:.3f}")
        if (
            checkpoint is not None
            and args.checkpoint_every
            and state["step"] % args.checkpoint_every == 0
            and i + 1 < steps
        ):  # the epoch's last step gets the end-of-epoch checkpoint
            checkpoint(epoch, i + 1, loader)
            saved_at = i + 1
    else:
        stopped = bool(args.max_steps and state["step"] >= args.max_steps and start + trained < steps)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    if timed_start is not None:
        elapsed = time.perf_counter() - timed_start
        state["timed"].append((timed_images, timed_wait, elapsed))
    loss_total, trained_all, samples_all, checksum_all = all_reduce(
        [loss_sum.item(), trained, samples, checksum.item()], device
    )
    if stopped and checkpoint is not None and saved_at != start + trained:
        checkpoint(epoch, start + trained, loader)  # --max-steps ended the run inside the epoch: keep its place
    del it
    return {
        "loss": loss_total / max(1, trained_all),
        "steps": trained,
        "samples": int(samples_all),
        "label_checksum": checksum_all,
        "resumed_at": start,
        "partial": stopped,
    }


@torch.no_grad()
def validate(model, loader, device, args, show):
    model.eval()
    channels_last = not args.no_channels_last
    totals = torch.zeros(3, dtype=torch.float64, device=device)
    for images, target in progress(loader, len(loader), "validate", show):
        images = images.to(device, non_blocking=True)
        target = target.to(device, non_blocking=True)
        if channels_last:
            images = images.contiguous(memory_format=torch.channels_last)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=not args.no_amp):
            output = model(images)
        top1, top5 = accuracy(output.float(), target)
        totals += torch.stack(
            [top1.double(), top5.double(), torch.tensor(float(len(target)), device=device, dtype=torch.float64)]
        )
    top1, top5, n = all_reduce_sum(totals.tolist(), device)
    return 100.0 * top1 / max(n, 1), 100.0 * top5 / max(n, 1)


def main(argv=None) -> dict:
    args = parse_args(argv)
    rank, world_size, device = setup_distributed()
    note = apply_defaults(args, device)
    if note and rank == 0:
        print(note, flush=True)
    torch.manual_seed(args.seed + rank)
    show = rank == 0 and not args.no_progress
    train_dir, val_dir = find_data(args, rank)
    train_loader, val_loader, train_sampler, classes = make_loaders(args, train_dir, val_dir, device, world_size, rank)
    model = getattr(torchvision.models, args.arch)(num_classes=classes).to(device)
    if not args.no_channels_last:
        model = model.to(memory_format=torch.channels_last)
    if args.compile:
        model = torch.compile(model)
    if world_size > 1:
        ddp_model = nn.parallel.DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None
        )
    else:
        ddp_model = model
    base_lr = args.lr if args.lr is not None else 0.1 * args.batch_size * world_size / 256
    optimizer = torch.optim.SGD(param_groups(model, args.weight_decay), lr=base_lr, momentum=args.momentum)
    criterion = nn.CrossEntropyLoss(label_smoothing=args.label_smoothing)
    steps_per_epoch = len(train_loader) if not args.steps_per_epoch else min(args.steps_per_epoch, len(train_loader))
    total_steps = steps_per_epoch * args.epochs
    if args.max_steps:
        total_steps = min(total_steps, args.max_steps)
    warmup = int(args.warmup_epochs * steps_per_epoch)
    state = {"step": 0, "timing_from": args.warmup_steps, "timed": [], "show": show}
    start_epoch, best_top1, resume = 0, 0.0, None
    if args.resume:
        checkpoint = torch.load(args.resume, map_location=device, weights_only=True)
        model.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        state["step"], best_top1 = checkpoint["step"], checkpoint["best_top1"]
        if checkpoint.get("mid_epoch"):  # continue inside the epoch it was saved in
            start_epoch = checkpoint["epoch"]
            resume = {
                "epoch_step": checkpoint["epoch_step"],
                "loader_states": checkpoint.get("loader_states"),
                "world_size": checkpoint.get("world_size", world_size),
                "batch_size": checkpoint.get("batch_size", args.batch_size),
            }
        else:
            start_epoch = checkpoint["epoch"] + 1
        state["timing_from"] = state["step"] + args.warmup_steps
        if rank == 0:
            where = f", step {resume['epoch_step']} of that epoch" if resume else ""
            print(f"resumed from {args.resume}: epoch {start_epoch}{where}, step {state['step']}", flush=True)
    if args.evaluate:
        top1, top5 = validate(ddp_model, val_loader, device, args, show)
        if rank == 0:
            print(f"validation: top-1 {top1:.2f}%  top-5 {top5:.2f}%")
        ddp_model = None  # noqa: F841 (finish's docstring says why)
        return finish({"top1": top1, "top5": top5}, args, rank)
    if args.loader == "synthetic":
        train_loader = SyntheticBatches(train_loader, steps_per_epoch, device)
    path = os.path.join(args.checkpoint_dir, f"{args.arch}-last.pt")

    def save(epoch: int, mid_epoch: bool = False, epoch_step: int = 0, loader=None) -> None:
        """Every rank calls this at a mid-epoch checkpoint (the loaders' states are gathered);
        rank 0 writes. The learning rate is a function of the step: the schedule's state."""
        states = None
        if mid_epoch and hasattr(loader, "state_dict"):
            states = [loader.state_dict()]
            if distributed():
                states = [None] * world_size
                dist.all_gather_object(states, loader.state_dict())
        if rank != 0:
            return
        os.makedirs(args.checkpoint_dir, exist_ok=True)
        torch.save(
            {
                "model": model.state_dict(),
                "optimizer": optimizer.state_dict(),
                "scheduler": {
                    "kind": "warmup-cosine",
                    "step": state["step"],
                    "total_steps": total_steps,
                    "warmup_steps": warmup,
                    "base_lr": base_lr,
                },
                "epoch": epoch,
                "step": state["step"],
                "mid_epoch": mid_epoch,
                "epoch_step": epoch_step,
                "loader_states": states,
                "world_size": world_size,
                "batch_size": args.batch_size,
                "best_top1": best_top1,
                "args": vars(args),
            },
            path + ".tmp",
        )
        os.replace(path + ".tmp", path)  # a preempted save never leaves a torn checkpoint
        if mid_epoch:
            print(f"checkpoint: epoch {epoch} step {epoch_step} (global step {state['step']}) -> {path}", flush=True)

    def save_mid_epoch(epoch, epoch_step, loader):
        save(epoch, True, epoch_step, loader)

    history = []
    for epoch in range(start_epoch, args.epochs):
        if args.max_steps and state["step"] >= args.max_steps:
            break
        if train_sampler is not None:
            train_sampler.set_epoch(epoch)  # before iter() and before load_state_dict()
        figures = train_epoch(
            ddp_model,
            train_loader,
            criterion,
            optimizer,
            lambda s: lr_at(s, total_steps, warmup, base_lr),
            epoch,
            args,
            device,
            state,
            resume=resume if epoch == start_epoch else None,
            checkpoint=save_mid_epoch,
        )
        top1 = top5 = float("nan")
        if not args.no_val and not figures["partial"]:
            top1, top5 = validate(ddp_model, val_loader, device, args, show)
        history.append({"epoch": epoch, "top1": top1, "top5": top5, **figures})
        if rank == 0:
            if figures["partial"]:
                print(
                    f"epoch {epoch}: train loss {figures['loss']:.4f} (stopped inside the epoch at step "
                    f"{state['step']}: --max-steps)",
                    flush=True,
                )
            else:
                val = "" if args.no_val else f"  val top-1 {top1:.2f}%  top-5 {top5:.2f}%"
                print(f"epoch {epoch}: train loss {figures['loss']:.4f}{val}", flush=True)
            best_top1 = max(best_top1, top1 if top1 == top1 else 0.0)
        if figures["partial"]:
            break  # the mid-epoch checkpoint is already written
        save(epoch)
    images, wait, elapsed = (sum(t[k] for t in state["timed"]) for k in range(3))
    images, wait_fraction = all_reduce([images, wait / elapsed if elapsed else 0.0], device)
    (elapsed,) = all_reduce([elapsed], device, op=dist.ReduceOp.MAX if distributed() else None)  # the slowest rank
    result = {
        "arch": args.arch,
        "loader": args.loader,
        "world_size": world_size,
        "batch_size": args.batch_size,
        "amp": not args.no_amp,
        "backend": dist.get_backend() if distributed() else None,
        "timed_steps": int(images // (args.batch_size * world_size)) if images else 0,
        "train_images_per_s": images / elapsed if elapsed else 0.0,
        "step_ms": 1e3 * elapsed / max(1, images / (args.batch_size * world_size)),
        "input_wait_fraction": wait_fraction / world_size,
        "steps": state["step"],
        "history": history,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "sampler": type(train_sampler).__module__ + "." + type(train_sampler).__qualname__,
        "loader_state_dict": hasattr(train_loader, "state_dict"),
    }
    if args.loader == "fastload" and hasattr(train_loader, "stats"):
        stats = train_loader.stats()
        result["loader_stats"] = {"decoded": stats.decoded, "wait_fraction": stats.wait_fraction, "io": stats.io}
        trial = train_loader.dataset.decoder(train_loader.device).trial  # cpu_decode_share="auto": the route it kept
        if trial is not None and trial.choice is not None:
            result["decode_route"] = {
                "route": route_name(trial.choice),
                "cpu_share": cpu_share_of(trial.choice),
                "gpu": "engines" if on_engines(trial.choice) else "nvjpeg",
                "engine_share": engine_share_of(trial.choice),  # of the JPEGs; with nvJPEG too on a three-way split
                "trial_batches": trial.batches_to_choose,
                "measured": trial.describe(),
            }
            if rank == 0:
                print(f"decode route: {route_name(trial.choice)} ({trial.describe()})")
    if rank == 0:
        print(
            f"{args.arch} / {args.loader}: {result['train_images_per_s']:,.0f} train images/s "
            f"({world_size} process{'es' if world_size > 1 else ''}), step {result['step_ms']:.1f} ms, input wait "
            f"{100 * result['input_wait_fraction']:.1f}% (steps after the first {args.warmup_steps})"
        )
    ddp_model = None  # noqa: F841 (finish's docstring says why)
    return finish(result, args, rank)


def finish(result: dict, args, rank: int) -> dict:
    """Write --json (rank 0) and leave the process group. The caller drops its
    DistributedDataParallel wrapper first and it is collected here: its reducer holds the group,
    which would otherwise outlive ``destroy_process_group`` into interpreter exit, where a gloo
    worker thread releasing a finished collective's tensor takes the GIL and aborts the process
    ("terminate called without an active exception"; examples/gnn_sage.py hit it in CI)."""
    gc.collect()
    if rank == 0 and args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    if dist.is_initialized():
        dist.destroy_process_group()
    return result


if __name__ == "__main__":
    main()
