"""The GPU benchmarks' models, written as fixtures the way
tests/reference/fixtures.py writes them (model.pt: torch.jit.save of the
scripted model in training mode; data.pt: torch.save of {'inputs',
'targets'}), so that concord-train and tests/reference/torch_ddp_train.py
train them unchanged.

  resnet50   ResNet-50 (bottleneck blocks 3-4-6-3, 1000 classes, 25.6 M
             parameters, ~98 MiB of fp32 gradients, 53 BatchNorm layers) on
             3 x S x S images (S = --image-size, 64 by default: the
             gradient traffic is ResNet-50's at any S; compute grows with S^2).
  mlp-350m   7 Linear layers, 1024 -> 8192 x 6 -> 1024 with ReLU, 352 M
             parameters (1.3 GiB of fp32 gradients): a step dominated by
             the allreduce.
"""

import os

import torch
from torch import nn
import torch.nn.functional as F

KINDS = ("resnet50", "mlp-350m")
LOSS = {"resnet50": "cross_entropy", "mlp-350m": "mse"}

MLP_IN, MLP_WIDTH, MLP_HIDDEN, MLP_OUT = 1024, 8192, 5, 1024
CLASSES = 1000


class Bottleneck(nn.Module):
    def __init__(self, cin, width, stride):
        super().__init__()
        cout = 4 * width
        self.conv1 = nn.Conv2d(cin, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, cout, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(cout)
        self.project = stride != 1 or cin != cout
        self.down_conv = nn.Conv2d(cin, cout, 1, stride=stride, bias=False) \
            if self.project else nn.Identity()
        self.down_bn = nn.BatchNorm2d(cout) if self.project else nn.Identity()

    def forward(self, x):
        y = F.relu(self.bn1(self.conv1(x)))
        y = F.relu(self.bn2(self.conv2(y)))
        y = self.bn3(self.conv3(y))
        return F.relu(y + self.down_bn(self.down_conv(x)))


class ResNet50(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 64, 7, stride=2, padding=3, bias=False)
        self.stem_bn = nn.BatchNorm2d(64)
        blocks = []
        cin = 64
        for width, count, stride in ((64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)):
            for i in range(count):
                blocks.append(Bottleneck(cin, width, stride if i == 0 else 1))
                cin = 4 * width
        self.blocks = nn.Sequential(*blocks)
        self.fc = nn.Linear(cin, CLASSES)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.stem_bn(self.stem(x))), 3, stride=2, padding=1)
        x = self.blocks(x)
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


def mlp_350m():
    layers = [nn.Linear(MLP_IN, MLP_WIDTH), nn.ReLU()]
    for _ in range(MLP_HIDDEN):
        layers += [nn.Linear(MLP_WIDTH, MLP_WIDTH), nn.ReLU()]
    layers.append(nn.Linear(MLP_WIDTH, MLP_OUT))
    return nn.Sequential(*layers)


def build_model(kind):
    if kind == "resnet50":
        return ResNet50()
    if kind == "mlp-350m":
        return mlp_350m()
    raise ValueError("unknown benchmark model %r (expected one of %s)" % (kind, ", ".join(KINDS)))


def make_data(kind, n_samples, seed, image_size):
    g = torch.Generator().manual_seed(seed * 7919 + 17)
    if kind == "resnet50":
        inputs = torch.randn(n_samples, 3, image_size, image_size, generator=g)
        targets = torch.randint(0, CLASSES, (n_samples,), generator=g, dtype=torch.int64)
    else:
        inputs = torch.randn(n_samples, MLP_IN, generator=g)
        targets = torch.randn(n_samples, MLP_OUT, generator=g)
    return inputs.contiguous(), targets.contiguous()


def make_fixture(directory, kind, n_samples, seed, image_size=64):
    """Writes <directory>/model.pt and data.pt; returns their paths."""
    os.makedirs(directory, exist_ok=True)
    torch.manual_seed(seed)
    model = build_model(kind)
    model.train()
    model_path = os.path.join(directory, "model.pt")
    data_path = os.path.join(directory, "data.pt")
    torch.jit.save(torch.jit.script(model), model_path)
    inputs, targets = make_data(kind, n_samples, seed, image_size)
    torch.save({"inputs": inputs, "targets": targets}, data_path)
    return model_path, data_path
