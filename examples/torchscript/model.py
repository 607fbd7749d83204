#!/usr/bin/python3
"""The Python side of the TorchScript example: a Fashion-MNIST classifier
pretrained in PyTorch and saved as TorchScript for concord-finetune (C++)
to fine-tune, and the check of what C++ wrote back.

    python3 examples/torchscript/model.py export DATA model.pt
    concord-run ... -- concord-finetune --model model.pt --data DATA \
        --out finetuned.pt
    python3 examples/torchscript/model.py evaluate DATA finetuned.pt \
        --base model.pt

DATA holds the idx files that examples/mnist/prepare_data.py writes.
`export` trains the classifier on the first five classes only (T-shirt,
trouser, pullover, dress, coat), so its head has never seen the other
five; concord-finetune freezes the convolutional features and trains the
head on all ten. `evaluate` prints the model's test accuracy over all ten
classes and, with --base, checks that the features are bit-identical to
the base model's and that the head changed. Exit status 1 when a check
fails, 2 on a bad file.
"""

import argparse
import os
import struct
import sys

import torch
from torch import nn


class Classifier(nn.Module):
    """Two convolutions (the features) and a two-layer head."""

    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 16, 5), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 5), nn.ReLU(), nn.MaxPool2d(2),
            nn.Flatten())
        self.head = nn.Sequential(nn.Linear(512, 64), nn.ReLU(),
                                  nn.Linear(64, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log_softmax(self.head(self.features(x)), dim=1)


def read_idx(path, magic):
    with open(path, "rb") as f:
        data = f.read()
    if len(data) < 8 or struct.unpack(">i", data[:4])[0] != magic:
        raise ValueError("%s: not an idx file" % path)
    count = struct.unpack(">i", data[4:8])[0]
    if magic == 2051:
        rows, cols = struct.unpack(">ii", data[8:16])
        t = torch.frombuffer(bytearray(data[16:]), dtype=torch.uint8)
        return t.view(count, 1, rows, cols).float().div(255)
    return torch.frombuffer(bytearray(data[8:]), dtype=torch.uint8).long()


def load(data, split):
    """Images normalised as torch::data::transforms::Normalize(0.1307,
    0.3081) does in the C++ side, and labels."""
    prefix = "train" if split == "train" else "t10k"
    images = read_idx(os.path.join(data, prefix + "-images-idx3-ubyte"), 2051)
    labels = read_idx(os.path.join(data, prefix + "-labels-idx1-ubyte"), 2049)
    return (images - 0.1307) / 0.3081, labels


def accuracy(model, images, labels):
    with torch.no_grad():
        return (model(images).argmax(1) == labels).float().mean().item()


def export(args):
    torch.manual_seed(0)
    images, labels = load(args.data, "train")
    keep = labels < 5
    images, labels = images[keep][:args.samples], labels[keep][:args.samples]
    model = Classifier()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for _ in range(args.epochs):
        for begin in range(0, len(images), 64):
            opt.zero_grad()
            loss = nn.functional.nll_loss(model(images[begin:begin + 64]),
                                          labels[begin:begin + 64])
            loss.backward()
            opt.step()
    model.eval()
    test_images, test_labels = load(args.data, "test")
    print("model.py: pretrained on classes 0-4: test accuracy %.4f (all ten "
          "classes)" % accuracy(model, test_images, test_labels))
    torch.jit.script(model).save(args.model)
    print("model.py: wrote %s" % args.model)
    return 0


def evaluate(args):
    model = torch.jit.load(args.model, map_location="cpu")
    model.eval()
    images, labels = load(args.data, "test")
    acc = accuracy(model, images[:args.samples], labels[:args.samples])
    print("model.py: %s: test accuracy %.4f" % (args.model, acc))
    if not args.base:
        return 0
    base = dict(torch.jit.load(args.base, map_location="cpu")
                .named_parameters())
    failed = 0
    for name, p in model.named_parameters():
        same = torch.equal(p, base[name])
        if name.startswith("features.") and not same:
            print("model.py: FAIL: frozen %s changed" % name)
            failed += 1
        if name.startswith("head.") and same:
            print("model.py: FAIL: %s did not change" % name)
            failed += 1
    print("model.py: features bit-identical to %s, head changed: %s" %
          (args.base, "no" if failed else "yes"))
    return 1 if failed else 0


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    e = sub.add_parser("export", help="pretrain and save as TorchScript")
    e.add_argument("data")
    e.add_argument("model")
    e.add_argument("--samples", type=int, default=3000)
    e.add_argument("--epochs", type=int, default=2)
    v = sub.add_parser("evaluate", help="test accuracy of a saved model")
    v.add_argument("data")
    v.add_argument("model")
    v.add_argument("--base", help="the exported model it was fine-tuned from")
    v.add_argument("--samples", type=int, default=10000)
    args = parser.parse_args()
    try:
        return export(args) if args.command == "export" else evaluate(args)
    except (OSError, ValueError, RuntimeError) as e:
        sys.stderr.write("model.py: %s\n" % str(e).splitlines()[0])
        return 2


if __name__ == "__main__":
    sys.exit(main())
