"""Gradient accumulation fed by a DataLoader: an MLP trained with AdamW, optimizer.step() every 2 batches.

One step is one optimizer step: 2 micro-batches of 16 samples, each with its DataLoader wait,
forward, loss and backward (32 samples a step), then AdamW's step and zero_grad.
"""
from __future__ import annotations

import argparse

import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

DEFAULT_STEPS = 3
ACCUMULATE = 2
MICRO_BATCH = 16


def main(argv: list[str] | None = None) -> list[float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=DEFAULT_STEPS, help="optimizer steps")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    criterion = nn.CrossEntropyLoss()
    batches = args.steps * ACCUMULATE
    dataset = TensorDataset(torch.randn(batches * MICRO_BATCH, 32), torch.randint(0, 4, (batches * MICRO_BATCH,)))
    loader = DataLoader(dataset, batch_size=MICRO_BATCH)
    losses = []
    total = 0.0
    for i, (x, y) in enumerate(loader):
        loss = criterion(model(x), y) / ACCUMULATE
        loss.backward()
        total += loss.item()
        if (i + 1) % ACCUMULATE == 0:
            optimizer.step()
            optimizer.zero_grad()
            losses.append(total)
            total = 0.0
    print(f"{len(losses)} optimizer steps of {ACCUMULATE} DataLoader batches; last loss {losses[-1]:.4f}")
    return losses


if __name__ == "__main__":
    main()
