"""ResNet-50 image classification with random weights (no download), built from its config.

Run it plain, or profile it without changing it:

    xsp run --report -- examples/resnet50_inference.py --batch-size 1 --iterations 5

On a GPU, with the CUDA API and kernel levels too:

    xsp run --levels model,layer,cuda_api,kernel --report -- examples/resnet50_inference.py --device cuda
"""

from __future__ import annotations

import argparse

import torch
from transformers import ResNetConfig, ResNetForImageClassification


def build_model() -> torch.nn.Module:
    """ResNet-50 (the microsoft/resnet-50 architecture) with random weights, in eval mode."""
    config = ResNetConfig(
        num_channels=3, embedding_size=64, hidden_sizes=[256, 512, 1024, 2048], depths=[3, 4, 6, 3],
        layer_type="bottleneck", hidden_act="relu", downsample_in_first_stage=False, num_labels=1000)
    torch.manual_seed(0)
    return ResNetForImageClassification(config).eval()


def preprocess(batch_size: int, image_size: int, device: str = "cpu") -> torch.Tensor:
    """A batch of random images on ``device``, normalised as ImageNet images would be."""
    images = torch.rand(batch_size, 3, image_size, image_size).to(device)
    mean = torch.tensor([0.485, 0.456, 0.406], device=device).view(1, 3, 1, 1)
    std = torch.tensor([0.229, 0.224, 0.225], device=device).view(1, 3, 1, 1)
    return (images - mean) / std


def main(argv: list[str] | None = None) -> list[int]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--iterations", type=int, default=3)
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--device", default="cpu", help="where the model runs, e.g. cuda")
    args = parser.parse_args(argv)
    model = build_model().to(args.device)
    predictions: list[int] = []
    with torch.inference_mode():
        for _ in range(args.iterations):
            pixels = preprocess(args.batch_size, args.image_size, args.device)
            logits = model(pixel_values=pixels).logits
            predictions.extend(logits.argmax(-1).tolist())
    print(f"resnet50: {args.iterations} batches of {args.batch_size}, first predictions {predictions[:4]}")
    return predictions


if __name__ == "__main__":
    main()
