"""Fine-tuning loop for a tiny randomly initialised BertForSequenceClassification.

One profiler "step" is one training iteration on a fixed random batch (8 x 32 tokens):
zero_grad, forward (embeddings, 2 encoder layers, classifier + loss), backward, AdamW step.
"""
from __future__ import annotations

import argparse

import torch
from transformers import BertConfig, BertForSequenceClassification

DEFAULT_STEPS = 6


def build(steps: int | None = None):
    """Set up model, batch and optimizer; return run_steps(n) running n training iterations."""
    default_n = DEFAULT_STEPS if steps is None else steps
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=1000,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=128,
        max_position_embeddings=64,
        num_labels=2,
    )
    model = BertForSequenceClassification(config)
    model.train()
    g = torch.Generator().manual_seed(1)
    input_ids = torch.randint(0, config.vocab_size, (8, 32), generator=g)
    attention_mask = torch.ones_like(input_ids)
    labels = torch.randint(0, 2, (8,), generator=g)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def run_steps(n: int | None = None) -> list[float]:
        n = default_n if n is None else n
        losses = []
        for _ in range(n):
            optimizer.zero_grad()
            out = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels)
            out.loss.backward()
            optimizer.step()
            losses.append(out.loss.item())
        return losses

    return run_steps


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=DEFAULT_STEPS)
    args = parser.parse_args(argv)
    run_steps = build(args.steps)
    losses = run_steps(args.steps)
    print(f"hf_train: steps={len(losses)}")
    print("losses=" + " ".join(f"{v:.4f}" for v in losses))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
