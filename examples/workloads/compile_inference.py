"""Inference with a small MLP wrapped in torch.compile (default inductor backend).

The model has a data-dependent branch, so dynamo breaks its graph there (one graph break,
two graphs), as real models often do. One profiler "step" is one eval-mode forward of the
compiled model on a 64 x 128 batch under torch.no_grad(); the first call, in build(),
compiles it (a compile span, not model latency).
"""
from __future__ import annotations

import argparse

import torch
import torch.nn as nn

DEFAULT_STEPS = 20


class GatedMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(128, 256), nn.GELU(), nn.Linear(256, 256), nn.GELU())
        self.head = nn.Linear(256, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.body(x)
        if h.mean() > 0:  # data-dependent: a graph break
            h = h * 0.5
        return self.head(h)


def make_model() -> nn.Module:
    return GatedMLP()


def build(steps: int | None = None):
    """Set up and compile the model (warm-up included); return run_steps(n) doing n forwards."""
    default_n = DEFAULT_STEPS if steps is None else steps
    torch.manual_seed(0)
    model = make_model().eval()
    compiled = torch.compile(model)
    g = torch.Generator().manual_seed(1)
    inputs = [torch.randn(64, 128, generator=g) for _ in range(4)]
    with torch.no_grad():
        compiled(inputs[0])  # compile warm-up

    def run_steps(n: int | None = None) -> list[int]:
        n = default_n if n is None else n
        preds = []
        with torch.no_grad():
            for i in range(n):
                out = compiled(inputs[i % len(inputs)])
                preds.append(int(out.argmax(dim=1).sum()))
        return preds

    return run_steps


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=DEFAULT_STEPS)
    args = parser.parse_args(argv)
    run_steps = build(args.steps)
    preds = run_steps(args.steps)
    print(f"compile_inference: steps={len(preds)}")
    print(f"argmax_sums={preds[:4]} total={sum(preds)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
