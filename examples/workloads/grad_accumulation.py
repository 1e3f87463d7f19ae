"""Gradient accumulation: an MLP trained with optimizer.step() every 4 micro-batches.

One step is one optimizer step: 4 forwards and backwards of micro-batches of 16 samples (64
samples a step), then SGD's step and zero_grad.
"""
from __future__ import annotations

import argparse

import torch
import torch.nn as nn

DEFAULT_STEPS = 6
ACCUMULATE = 4
MICRO_BATCH = 16


def main(argv: list[str] | None = None) -> list[float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=DEFAULT_STEPS, help="optimizer steps")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    criterion = nn.CrossEntropyLoss()
    data = [(torch.randn(MICRO_BATCH, 64), torch.randint(0, 10, (MICRO_BATCH,))) for _ in range(ACCUMULATE)]
    losses = []
    for _ in range(args.steps):
        total = 0.0
        for x, y in data:
            loss = criterion(model(x), y) / ACCUMULATE
            loss.backward()
            total += loss.item()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(total)
    print(f"{args.steps} optimizer steps of {ACCUMULATE} micro-batches; last loss {losses[-1]:.4f}")
    return losses


if __name__ == "__main__":
    main()
