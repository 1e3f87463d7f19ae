"""Dynamic quantization: an MLP's inference loop in float, then quantize_dynamic, then the
quantized model's loop.

Setup (building and quantizing the model) is no step; each of the --steps float calls and each
of the --steps quantized calls is one step (2 x --steps steps).
"""
from __future__ import annotations

import argparse

import torch
import torch.nn as nn

DEFAULT_STEPS = 8


def main(argv: list[str] | None = None) -> list[int]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=DEFAULT_STEPS, help="calls of each model")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(128, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10)).eval()
    x = torch.randn(32, 128)
    predictions = []
    with torch.no_grad():
        for _ in range(args.steps):
            predictions.append(int(model(x).argmax(1)[0]))
        quantized = torch.ao.quantization.quantize_dynamic(model, {nn.Linear}, dtype=torch.qint8)
        for _ in range(args.steps):
            predictions.append(int(quantized(x).argmax(1)[0]))
    print(f"{args.steps} float and {args.steps} quantized calls; first predictions {predictions[:2]}")
    return predictions


if __name__ == "__main__":
    main()
