"""Toy model server: 3 worker threads take requests from a queue.Queue and run no_grad inference.

One profiler "step" is one request handled by a worker: the forward of a small MLP on a
4 x 64 request batch, a step of the worker's thread (the queue get and storing the result
fall between steps). run_steps(n) serves n requests (default 24).
"""
from __future__ import annotations

import argparse
import queue
import threading

import torch
import torch.nn as nn

DEFAULT_STEPS = 24
NUM_WORKERS = 3


def build(steps: int | None = None):
    """Set up model and request payloads; return run_steps(n) serving n requests with 3 threads."""
    default_n = DEFAULT_STEPS if steps is None else steps
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(64, 128),
        nn.ReLU(),
        nn.Linear(128, 128),
        nn.ReLU(),
        nn.Linear(128, 10),
    ).eval()
    g = torch.Generator().manual_seed(1)
    payloads = [torch.randn(4, 64, generator=g) for _ in range(8)]

    def worker(requests: queue.Queue, results: dict, lock: threading.Lock) -> None:
        while True:
            item = requests.get()
            if item is None:
                requests.task_done()
                return
            req_id, x = item
            with torch.no_grad():
                out = model(x)
            pred = out.argmax(dim=1).tolist()
            with lock:
                results[req_id] = pred
            requests.task_done()

    def run_steps(n: int | None = None) -> list[tuple[int, list[int]]]:
        n = default_n if n is None else n
        requests: queue.Queue = queue.Queue()
        results: dict[int, list[int]] = {}
        lock = threading.Lock()
        threads = [
            threading.Thread(target=worker, args=(requests, results, lock), name=f"worker-{k}")
            for k in range(NUM_WORKERS)
        ]
        for t in threads:
            t.start()
        for req_id in range(n):
            requests.put((req_id, payloads[req_id % len(payloads)]))
        for _ in threads:
            requests.put(None)
        for t in threads:
            t.join()
        return sorted(results.items())

    return run_steps


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=DEFAULT_STEPS)
    args = parser.parse_args(argv)
    run_steps = build(args.steps)
    results = run_steps(args.steps)
    print(f"threaded_server: requests={len(results)} workers={NUM_WORKERS}")
    for req_id, pred in results[:3]:
        print(f"request {req_id}: {pred}")
    print(f"pred_total={sum(sum(p) for _, p in results)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
