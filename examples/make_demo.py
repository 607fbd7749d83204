"""Writes the demo's TorchScript model and data (Debian's python3-torch).

    /usr/bin/python3 examples/make_demo.py --out DIR [--samples N] [--seed S]

model.pt: a small CNN with Conv/BatchNorm/Linear layers (torch.jit.script).
data.pt:  {'inputs': (N, 3, 16, 16) float32, 'targets': (N,) int64}: noisy
          images around 10 class prototypes, so the loss visibly falls.
"""
import argparse
import os

import torch
from torch import nn


class DemoNet(nn.Module):
    def __init__(self, classes: int = 10):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
            nn.MaxPool2d(2))
        self.head = nn.Sequential(
            nn.Flatten(), nn.Linear(32 * 4 * 4, 64), nn.BatchNorm1d(64),
            nn.ReLU(), nn.Linear(64, classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--samples", type=int, default=3000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    torch.manual_seed(args.seed)
    prototypes = torch.randn(10, 3, 16, 16)
    targets = torch.randint(0, 10, (args.samples,))
    inputs = prototypes[targets] + 3.0 * torch.randn(args.samples, 3, 16, 16)
    torch.jit.save(torch.jit.script(DemoNet()), os.path.join(args.out, "model.pt"))
    torch.save({"inputs": inputs, "targets": targets}, os.path.join(args.out, "data.pt"))
    print(f"wrote {args.out}/model.pt and {args.out}/data.pt ({args.samples} samples)")


if __name__ == "__main__":
    main()
