"""TorchScript scripting: torch.jit.script of a small module with data-dependent control flow.

One profiler "step" is one call of the scripted module on a 32 x 64 batch (a loop of
residual blocks whose count and branch depend on the input), under torch.no_grad().
"""
from __future__ import annotations

import argparse

import torch
import torch.nn as nn

DEFAULT_STEPS = 10


class GatedStack(nn.Module):
    def __init__(self, dim: int = 64, max_blocks: int = 4) -> None:
        super().__init__()
        self.max_blocks = max_blocks
        self.proj = nn.Linear(dim, dim)
        self.blocks = nn.ModuleList([nn.Linear(dim, dim) for _ in range(max_blocks)])
        self.out = nn.Linear(dim, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.proj(x))
        # number of blocks applied depends on the input
        n = int(h.mean().item() * 10.0) % self.max_blocks + 1
        i = 0
        for block in self.blocks:
            if i < n:
                if bool(h.sum() > 0):
                    h = h + torch.relu(block(h))
                else:
                    h = h - torch.tanh(block(h))
            i += 1
        return self.out(h)


def build(steps: int | None = None):
    """Build and script the module; return run_steps(n) calling it n times."""
    default_n = DEFAULT_STEPS if steps is None else steps
    torch.manual_seed(0)
    scripted = torch.jit.script(GatedStack().eval())
    g = torch.Generator().manual_seed(1)
    inputs = [torch.randn(32, 64, generator=g) * (0.5 + k) for k in range(4)]

    def run_steps(n: int | None = None) -> list[float]:
        n = default_n if n is None else n
        sums = []
        with torch.no_grad():
            for i in range(n):
                out = scripted(inputs[i % len(inputs)])
                sums.append(out.sum().item())
        return sums

    return run_steps


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=DEFAULT_STEPS)
    args = parser.parse_args(argv)
    run_steps = build(args.steps)
    sums = run_steps(args.steps)
    print(f"jit_script: steps={len(sums)}")
    print("sums=" + " ".join(f"{v:.4f}" for v in sums[:4]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
