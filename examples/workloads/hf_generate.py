"""Greedy text generation with a tiny randomly initialised GPT2LMHeadModel.

One profiler "step" is one model.generate() call (greedy, 6 new tokens) on a fixed
batch of 2 prompts: 6 decoder forward passes with KV cache (the prefill, then 5 decode
steps, each with its token index) plus token selection.
"""
from __future__ import annotations

import argparse

import torch
from transformers import GPT2Config, GPT2LMHeadModel

DEFAULT_STEPS = 3


def build(steps: int | None = None):
    """Set up model and prompts; return run_steps(n) doing n generate() calls."""
    default_n = DEFAULT_STEPS if steps is None else steps
    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=1000,
        n_positions=64,
        n_embd=64,
        n_layer=2,
        n_head=2,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    model = GPT2LMHeadModel(config)
    model.eval()
    g = torch.Generator().manual_seed(1)
    input_ids = torch.randint(3, config.vocab_size, (2, 8), generator=g)
    attention_mask = torch.ones_like(input_ids)

    def run_steps(n: int | None = None) -> list[list[list[int]]]:
        n = default_n if n is None else n
        results = []
        for _ in range(n):
            out = model.generate(
                input_ids,
                attention_mask=attention_mask,
                max_new_tokens=6,
                do_sample=False,
                pad_token_id=0,
            )
            results.append(out[:, input_ids.shape[1]:].tolist())
        return results

    return run_steps


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=DEFAULT_STEPS)
    args = parser.parse_args(argv)
    run_steps = build(args.steps)
    results = run_steps(args.steps)
    print(f"hf_generate: calls={len(results)}")
    print(f"generated={results[-1]}")
    print(f"all_calls_identical={all(r == results[0] for r in results)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
