"""Data-parallel training on CPU (gloo): DDP with a DataLoader, a loss all-reduced for logging,
and a periodic all_gather of each rank's accuracy. Run it with torchrun, plainly or under xsp:

    torchrun --nproc_per_node=2 ddp_train.py --steps 8
    torchrun --nproc_per_node=2 -m xsp run -o ddp.xsp.parquet -- ddp_train.py --steps 8

``--slow-rank R --delay-ms D`` makes rank R sleep D ms before each forward: a straggler the
other ranks wait for inside their collectives.
"""

from __future__ import annotations

import argparse
import gc
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--slow-rank", type=int, default=-1)
    parser.add_argument("--delay-ms", type=float, default=0.0)
    args = parser.parse_args(argv)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(nn.Sequential(
        nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 4)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    generator = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(64 * args.steps * world, 32, generator=generator),
                         torch.randint(0, 4, (64 * args.steps * world,), generator=generator))
    loader = DataLoader(data, batch_size=64, sampler=DistributedSampler(data, shuffle=False))
    losses = []
    for step, (x, y) in enumerate(loader):
        if step >= args.steps:
            break
        if rank == args.slow_rank:
            time.sleep(args.delay_ms / 1000)
        loss = nn.functional.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        logged = loss.detach().clone()
        dist.all_reduce(logged)
        losses.append(logged.item() / world)
        if step % 4 == 3:
            with torch.no_grad():
                correct = torch.tensor([float((model(x).argmax(1) == y).float().mean())])
            gathered = [torch.zeros(1) for _ in range(world)]
            dist.all_gather(gathered, correct)
    dist.barrier()
    if rank == 0:
        print(f"ddp_train: world={world} steps={len(losses)}")
        print("losses=" + " ".join(f"{loss:.4f}" for loss in losses))
    # DDP's reducer keeps the gloo process group alive; left to interpreter shutdown, its worker
    # threads are torn down unjoined and one run in 20-40 aborts ("terminate called without an
    # active exception", SIGABRT) after main has returned. Releasing it here: 0 in 100.
    del model, optimizer
    gc.collect()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
