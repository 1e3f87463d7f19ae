"""Activation checkpointing: 4 residual blocks under torch.utils.checkpoint, trained with Adam.

One step is one training iteration (forward, loss, backward, Adam step). Each block's forward
is recomputed during the backward; --reentrant picks the reentrant implementation (the default
is use_reentrant=False).
"""
from __future__ import annotations

import argparse

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

DEFAULT_STEPS = 4


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x))


class Net(nn.Module):
    def __init__(self, width: int = 64, blocks: int = 4, reentrant: bool = False) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(width) for _ in range(blocks))
        self.head = nn.Linear(width, 10)
        self.reentrant = reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=self.reentrant)
        return self.head(x)


def main(argv: list[str] | None = None) -> list[float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=DEFAULT_STEPS)
    parser.add_argument("--reentrant", action="store_true")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    model = Net(reentrant=args.reentrant)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    x = torch.randn(32, 64, requires_grad=args.reentrant)  # reentrant checkpoints need an input that wants grad
    y = torch.randint(0, 10, (32,))
    losses = []
    for _ in range(args.steps):
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    print(f"{args.steps} steps with checkpointed blocks (reentrant={args.reentrant}); last loss {losses[-1]:.4f}")
    return losses


if __name__ == "__main__":
    main()
