"""A loop that ends with os._exit(0) (as some launchers and forked workers end): no exit hook runs.

Each of the --steps calls of an MLP is one step; after them the process leaves through
os._exit(0), so xsp never finishes its session: `xsp recover` builds the file from the windows
that were written.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.nn as nn

DEFAULT_STEPS = 5


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=DEFAULT_STEPS)
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4)).eval()
    with torch.no_grad():
        for _ in range(args.steps):
            model(torch.randn(8, 32))
            time.sleep(0.3)  # a window closes about once a second: several are written
    print(f"{args.steps} steps, then os._exit(0)")
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
