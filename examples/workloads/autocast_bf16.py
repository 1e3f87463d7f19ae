"""Mixed precision on CPU: a small MLP under torch.autocast("cpu", dtype=torch.bfloat16).

Each iteration is an evaluation forward (no_grad, autocast) then a training iteration
(zero_grad, autocast forward + loss, backward in fp32 params, AdamW step): xsp reports them
apart, as two steps per iteration: the evaluation call (a step of its own) and a train_step
from the training forward to AdamW's step.
"""
from __future__ import annotations

import argparse

import torch
import torch.nn as nn

DEFAULT_STEPS = 8


def build(steps: int | None = None):
    """Set up model, data, optimizer; return run_steps(n) doing n inference+training steps."""
    default_n = DEFAULT_STEPS if steps is None else steps
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(128, 256),
        nn.ReLU(),
        nn.Linear(256, 256),
        nn.ReLU(),
        nn.Linear(256, 10),
    )
    criterion = nn.CrossEntropyLoss()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(64, 128, generator=g) for _ in range(4)]
    ys = [torch.randint(0, 10, (64,), generator=g) for _ in range(4)]
    counter = [0]

    def run_steps(n: int | None = None) -> list[tuple[int, float, str]]:
        n = default_n if n is None else n
        records = []
        for _ in range(n):
            i = counter[0] % len(xs)
            counter[0] += 1
            # inference
            model.eval()
            with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
                logits = model(xs[i])
            correct = int((logits.argmax(dim=1) == ys[i]).sum())
            # training
            model.train()
            optimizer.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = model(xs[i])
                loss = criterion(out, ys[i])
            loss.backward()
            optimizer.step()
            records.append((correct, loss.item(), str(logits.dtype)))
        return records

    return run_steps


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=DEFAULT_STEPS)
    args = parser.parse_args(argv)
    run_steps = build(args.steps)
    records = run_steps(args.steps)
    print(f"autocast_bf16: steps={len(records)} logits_dtype={records[0][2]}")
    print(f"first_loss={records[0][1]:.4f} last_loss={records[-1][1]:.4f}")
    print(f"correct={[r[0] for r in records]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
