"""Training a small MLP compiled with torch.compile (default inductor backend).

One profiler "step" is one training iteration: zero_grad, compiled forward, loss,
backward (compiled backward graph), SGD step (eager, outside the compiled region). The
warm-up forward and backward in build() is a step of its own that holds the compilation.
"""
from __future__ import annotations

import argparse

import torch
import torch.nn as nn

DEFAULT_STEPS = 10


def make_model() -> nn.Module:
    return nn.Sequential(
        nn.Linear(64, 128),
        nn.ReLU(),
        nn.Linear(128, 10),
    )


def build(steps: int | None = None):
    """Set up model, data, optimizer; compile (warm-up included); return run_steps(n) doing n training iterations."""
    default_n = DEFAULT_STEPS if steps is None else steps
    torch.manual_seed(0)
    model = make_model().train()
    compiled = torch.compile(model)
    criterion = nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(32, 64, generator=g) for _ in range(4)]
    ys = [torch.randint(0, 10, (32,), generator=g) for _ in range(4)]
    counter = [0]
    # compile warm-up: builds forward and backward graphs; grads are discarded,
    # parameters are not updated.
    criterion(compiled(xs[0]), ys[0]).backward()
    optimizer.zero_grad()

    def run_steps(n: int | None = None) -> list[float]:
        n = default_n if n is None else n
        losses = []
        for _ in range(n):
            i = counter[0] % len(xs)
            counter[0] += 1
            optimizer.zero_grad()
            out = compiled(xs[i])
            loss = criterion(out, ys[i])
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        return losses

    return run_steps


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=DEFAULT_STEPS)
    args = parser.parse_args(argv)
    run_steps = build(args.steps)
    losses = run_steps(args.steps)
    print(f"compile_train: steps={len(losses)}")
    print(f"first_loss={losses[0]:.4f} last_loss={losses[-1]:.4f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
