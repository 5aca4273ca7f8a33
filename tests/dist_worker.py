"""A rank of the multi-process tests (tests/test_distributed.py), launched by torchrun (gloo).

    dist_worker.py DATA OUT [--epochs E] [--stop-after K] [--resume STATE]

Each rank reads its DistributedSampler share of an ArrayDataset file whose row i holds i;
per epoch the ranks all_gather the row ids they got and rank 0 writes them to OUT/epoch-E.json.
--stop-after K checkpoints the last epoch after K batches (rank 0 writes OUT/state.json) and
stops; --resume STATE continues that epoch from it (at this run's world size).
"""

import argparse
import json
import os

import torch.distributed as dist

import torch_fastload
from torch_fastload import DataLoader, DistributedSampler


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("data")
    p.add_argument("out")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--stop-after", type=int)
    p.add_argument("--resume")
    p.add_argument("--fetch-threads", type=int, default=2)
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    dataset = torch_fastload.ArrayDataset(args.data)
    sampler = DistributedSampler(dataset, shuffle=True, seed=3)
    loader = DataLoader(
        dataset, batch_size=args.batch_size, sampler=sampler, device="cpu", fetch_threads=args.fetch_threads
    )
    first_epoch = 0
    if args.resume:
        with open(args.resume) as f:
            state = json.load(f)
        first_epoch = state["sampler"]["epoch"]
        loader.load_state_dict(state)
    for epoch in range(first_epoch, args.epochs):
        sampler.set_epoch(epoch)
        ids = []
        for step, batch in enumerate(loader):
            ids += batch[:, 0].long().tolist()
            if args.stop_after is not None and epoch == args.epochs - 1 and step + 1 == args.stop_after:
                state = loader.state_dict()
                break
        gathered = [None] * world
        dist.all_gather_object(gathered, ids)
        if rank == 0:
            with open(os.path.join(args.out, f"epoch-{epoch}.json"), "w") as f:
                json.dump({"world": world, "ids": gathered}, f)
            if args.stop_after is not None and epoch == args.epochs - 1:
                with open(os.path.join(args.out, "state.json"), "w") as f:
                    json.dump(state, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
