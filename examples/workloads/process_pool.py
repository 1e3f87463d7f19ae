"""Toy batch scorer: a multiprocessing Pool of 2 worker processes (spawn) runs no_grad inference.

One profiler "step" is one request scored in a worker process: the forward of a small MLP on a
4 x 64 batch. The parent only hands the requests out and sums the results, so every model call
is made in a child process (each worker builds the model from the same seed on its first
request). run_steps(n) scores n requests (default 16).
"""
from __future__ import annotations

import argparse
import multiprocessing

import torch
import torch.nn as nn

DEFAULT_STEPS = 16
NUM_WORKERS = 2
_model: nn.Module | None = None


def _score(request: int) -> list[int]:
    """In a worker process: the model's predictions for request ``request``."""
    global _model
    if _model is None:
        torch.manual_seed(0)
        _model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10)).eval()
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(request))
    with torch.no_grad():
        return _model(x).argmax(dim=1).tolist()


def build(steps: int | None = None):
    """Return run_steps(n), scoring n requests in a pool of 2 spawned worker processes."""
    default_n = DEFAULT_STEPS if steps is None else steps

    def run_steps(n: int | None = None) -> list[list[int]]:
        n = default_n if n is None else n
        with multiprocessing.get_context("spawn").Pool(NUM_WORKERS) as pool:
            return pool.map(_score, range(n), chunksize=1)

    return run_steps


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=DEFAULT_STEPS)
    args = parser.parse_args(argv)
    results = build(args.steps)(args.steps)
    print(f"process_pool: requests={len(results)} workers={NUM_WORKERS}")
    print(f"request 0: {results[0]}")
    print(f"pred_total={sum(sum(p) for p in results)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
