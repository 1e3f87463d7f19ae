"""A closure optimizer: LBFGS fits a small regression MLP, optimizer.step(closure).

One step is one optimizer.step(closure): LBFGS calls the closure (forward, loss, backward) up to
max_iter=4 times inside it.
"""
from __future__ import annotations

import argparse

import torch
import torch.nn as nn

DEFAULT_STEPS = 5


def main(argv: list[str] | None = None) -> list[float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=DEFAULT_STEPS, help="optimizer steps")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))
    x, y = torch.randn(256, 8), torch.randn(256, 1)
    optimizer = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=4, history_size=5)
    criterion = nn.MSELoss()
    calls = [0]

    def closure() -> torch.Tensor:
        calls[0] += 1
        optimizer.zero_grad()
        loss = criterion(model(x), y)
        loss.backward()
        return loss

    losses = [float(optimizer.step(closure)) for _ in range(args.steps)]
    print(f"{args.steps} LBFGS steps, {calls[0]} closure calls; last loss {losses[-1]:.4f}")
    return losses


if __name__ == "__main__":
    main()
