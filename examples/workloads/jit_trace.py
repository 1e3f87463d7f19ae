"""TorchScript tracing, tutorial form: torch.jit.trace of a small CNN, then calling the trace.

One profiler "step" is one call of the autograd-enabled trace on a 16 x 3x32x32 batch
followed by one call of a second trace made under torch.no_grad() (called in no_grad): an
inference step, as nothing calls backward. Tracing (and its check run) is no step.
"""
from __future__ import annotations

import argparse

import torch
import torch.nn as nn

DEFAULT_STEPS = 10


class SmallCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(8, 16, 3, padding=1),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
        )
        self.fc = nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(self.features(x), 1))


def build(steps: int | None = None):
    """Build and trace the models; return run_steps(n) calling both traces n times."""
    default_n = DEFAULT_STEPS if steps is None else steps
    torch.manual_seed(0)
    model = SmallCNN().eval()
    model_ng = SmallCNN().eval()
    model_ng.load_state_dict(model.state_dict())
    g = torch.Generator().manual_seed(1)
    example = torch.randn(16, 3, 32, 32, generator=g)
    traced = torch.jit.trace(model, example)  # autograd ON, as in the tutorial
    with torch.no_grad():
        traced_ng = torch.jit.trace(model_ng, example)
    inputs = [torch.randn(16, 3, 32, 32, generator=g) for _ in range(4)]

    def run_steps(n: int | None = None) -> list[tuple[float, float]]:
        n = default_n if n is None else n
        sums = []
        for i in range(n):
            x = inputs[i % len(inputs)]
            out = traced(x)
            with torch.no_grad():
                out_ng = traced_ng(x)
            sums.append((out.detach().sum().item(), out_ng.sum().item()))
        return sums

    return run_steps


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=DEFAULT_STEPS)
    args = parser.parse_args(argv)
    run_steps = build(args.steps)
    sums = run_steps(args.steps)
    total = sum(a for a, _ in sums)
    total_ng = sum(b for _, b in sums)
    print(f"jit_trace: steps={len(sums)}")
    print(f"traced_sum={total:.4f} traced_no_grad_sum={total_ng:.4f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
