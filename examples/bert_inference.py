"""BERT-base sequence classification with random weights (no download), built from its config.

Token ids are random, so no tokenizer has to be fetched. Profile it with:

    xsp run --report -- examples/bert_inference.py --batch-size 2 --seq-len 128
"""

from __future__ import annotations

import argparse

import torch
from transformers import BertConfig, BertForSequenceClassification


def build_model(layers: int = 12) -> torch.nn.Module:
    """BERT-base (bert-base-uncased's shape) with random weights, in eval mode."""
    config = BertConfig(vocab_size=30522, hidden_size=768, num_hidden_layers=layers, num_attention_heads=12,
                        intermediate_size=3072, max_position_embeddings=512, num_labels=2)
    torch.manual_seed(0)
    return BertForSequenceClassification(config).eval()


def make_batch(batch_size: int, seq_len: int, vocab_size: int) -> dict[str, torch.Tensor]:
    """Random token ids with a full attention mask, as a tokenizer would return them."""
    return {
        "input_ids": torch.randint(0, vocab_size, (batch_size, seq_len)),
        "attention_mask": torch.ones(batch_size, seq_len, dtype=torch.long),
    }


def main(argv: list[str] | None = None) -> list[int]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--iterations", type=int, default=3)
    parser.add_argument("--layers", type=int, default=12, help="encoder layers (12 is BERT-base)")
    args = parser.parse_args(argv)
    model = build_model(args.layers)
    labels: list[int] = []
    with torch.inference_mode():
        for _ in range(args.iterations):
            batch = make_batch(args.batch_size, args.seq_len, model.config.vocab_size)
            labels.extend(model(**batch).logits.argmax(-1).tolist())
    print(f"bert: {args.iterations} batches of {args.batch_size}x{args.seq_len}, labels {labels[:4]}")
    return labels


if __name__ == "__main__":
    main()
