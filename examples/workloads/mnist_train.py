"""Small CNN trained on a synthetic MNIST-like dataset (512 x 1x28x28, 10 classes).

One profiler "step" is one training iteration: wait for the next DataLoader batch
(num_workers=2), zero_grad, forward, CrossEntropyLoss, backward, SGD optimizer step.
"""
from __future__ import annotations

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

DEFAULT_STEPS = 16


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 8, 3, 1)
        self.conv2 = nn.Conv2d(8, 16, 3, 1)
        self.fc1 = nn.Linear(16 * 12 * 12, 64)
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.conv1(x))
        x = F.relu(self.conv2(x))
        x = F.max_pool2d(x, 2)
        x = torch.flatten(x, 1)
        x = F.relu(self.fc1(x))
        return self.fc2(x)


def build(steps: int | None = None, device: str = "cpu"):
    """Set up model, data and optimizer on ``device``; return run_steps(n) running n training iterations."""
    default_n = DEFAULT_STEPS if steps is None else steps
    torch.manual_seed(0)
    images = torch.randn(512, 1, 28, 28)
    labels = torch.randint(0, 10, (512,))
    dataset = TensorDataset(images, labels)
    loader = DataLoader(
        dataset,
        batch_size=32,
        shuffle=True,
        num_workers=2,
        generator=torch.Generator().manual_seed(0),
    )
    model = Net().to(device)
    criterion = nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    model.train()

    def run_steps(n: int | None = None) -> list[float]:
        n = default_n if n is None else n
        losses: list[float] = []
        while len(losses) < n:  # epochs, stopped after n iterations as a max_steps would
            for x, y in loader:
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                optimizer.zero_grad()
                out = model(x)
                loss = criterion(out, y)
                loss.backward()
                optimizer.step()
                losses.append(loss.item())
                if len(losses) == n:
                    break
        return losses

    return run_steps


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=DEFAULT_STEPS)
    parser.add_argument("--device", default="cpu", help="where the model trains, e.g. cuda")
    args = parser.parse_args(argv)
    run_steps = build(args.steps, args.device)
    losses = run_steps(args.steps)
    print(f"mnist_train: steps={len(losses)}")
    print(f"first_loss={losses[0]:.4f} last_loss={losses[-1]:.4f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
