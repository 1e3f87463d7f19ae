"""Two-stage inference: an `encoder` nn.Sequential feeding a separate `head` nn.Sequential.

One profiler "step" is one iteration under torch.no_grad(): features = encoder(x)
(conv feature extractor) then logits = head(features) (MLP classifier).
"""
from __future__ import annotations

import argparse

import torch
import torch.nn as nn

DEFAULT_STEPS = 10


def build(steps: int | None = None):
    """Set up both models and inputs; return run_steps(n) doing n encoder+head iterations."""
    default_n = DEFAULT_STEPS if steps is None else steps
    torch.manual_seed(0)
    encoder = nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1),
        nn.BatchNorm2d(16),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
    ).eval()
    head = nn.Sequential(
        nn.Linear(32, 64),
        nn.ReLU(),
        nn.Dropout(0.1),
        nn.Linear(64, 10),
    ).eval()
    g = torch.Generator().manual_seed(1)
    inputs = [torch.randn(16, 3, 32, 32, generator=g) for _ in range(4)]

    def run_steps(n: int | None = None) -> list[tuple[list[int], float]]:
        n = default_n if n is None else n
        preds = []
        with torch.no_grad():
            for i in range(n):
                x = inputs[i % len(inputs)]
                features = encoder(x)
                logits = head(features)
                preds.append((logits.argmax(dim=1).tolist(), logits.sum().item()))
        return preds

    return run_steps


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=DEFAULT_STEPS)
    args = parser.parse_args(argv)
    run_steps = build(args.steps)
    preds = run_steps(args.steps)
    print(f"two_models: steps={len(preds)}")
    print(f"preds[0]={preds[0][0]}")
    print(f"logits_sum={sum(v for _, v in preds):.4f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
