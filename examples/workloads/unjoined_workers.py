"""Batch scoring whose main thread never waits: it starts 2 worker threads over a queue.Queue
of requests and a reporter thread that joins them and prints the totals, then returns.

Python waits for these (non-daemon) threads before the process exits, so the scoring all
happens after the main thread has ended. One profiler "step" is one request scored by a worker:
the no_grad forward of a small MLP on a 4 x 32 batch, a step of the worker's thread. The workers
begin once the main thread has ended (they join it), so every request is scored after it.
--steps n scores n requests (default 10).
"""
from __future__ import annotations

import argparse
import queue
import threading

import torch
import torch.nn as nn

DEFAULT_STEPS = 10
NUM_WORKERS = 2


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=DEFAULT_STEPS)
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4)).eval()
    g = torch.Generator().manual_seed(1)
    requests: queue.Queue = queue.Queue()
    for req_id in range(args.steps):
        requests.put((req_id, torch.randn(4, 32, generator=g)))
    for _ in range(NUM_WORKERS):
        requests.put(None)
    results: dict[int, int] = {}
    lock = threading.Lock()

    def worker() -> None:
        threading.main_thread().join()  # Python ends the main thread as it begins to exit
        while (item := requests.get()) is not None:
            req_id, x = item
            with torch.no_grad():
                label_sum = int(model(x).argmax(dim=1).sum())
            with lock:
                results[req_id] = label_sum

    workers = [threading.Thread(target=worker, name=f"scorer-{k}") for k in range(NUM_WORKERS)]

    def reporter() -> None:
        for thread in workers:
            thread.join()
        print(f"unjoined_workers: requests={len(results)} workers={NUM_WORKERS}")
        print(f"label_total={sum(results.values())}")

    for thread in [*workers, threading.Thread(target=reporter, name="reporter")]:
        thread.start()
    print("main thread returns")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
