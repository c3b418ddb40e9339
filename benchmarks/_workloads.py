"""The models the step benchmarks train (``benchmarks.step``, ``benchmarks.allocator``, ...)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch


def mlp(depth: int, width: int) -> torch.nn.Module:
    layers: list[torch.nn.Module] = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(width, 10))


class _Block(torch.nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = torch.nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = torch.nn.BatchNorm2d(cout)
        self.conv2 = torch.nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = torch.nn.BatchNorm2d(cout)
        self.shortcut = torch.nn.Sequential()
        if stride != 1 or cin != cout:
            self.shortcut = torch.nn.Sequential(torch.nn.Conv2d(cin, cout, 1, stride, bias=False), torch.nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(y)) + self.shortcut(x))


def resnet18(width: int) -> torch.nn.Module:
    """ResNet-18 for 32x32 inputs (CIFAR layout: 3x3 stem, no max-pool), ``width`` channels in its first stage."""
    layers: list[torch.nn.Module] = [torch.nn.Conv2d(3, width, 3, 1, 1, bias=False), torch.nn.BatchNorm2d(width), torch.nn.ReLU()]
    cin = width
    for cout, stride in ((width, 1), (2 * width, 2), (4 * width, 2), (8 * width, 2)):
        layers += [_Block(cin, cout, stride), _Block(cout, cout, 1)]
        cin = cout
    return torch.nn.Sequential(*layers, torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(cin, 10))


@dataclass(frozen=True)
class Workload:
    label: str
    make: Callable[[], torch.nn.Module]
    input_shape: tuple[int, ...]
    batch: int


WORKLOADS = {
    "mlp4x1024": Workload("MLP 4x1024", lambda: mlp(4, 1024), (1024,), 64),
    "mlp10x2048": Workload("MLP 10x2048", lambda: mlp(10, 2048), (2048,), 64),
    # 62 small parameters, little compute: the step is mostly per-parameter overhead (hooks, launches)
    "mlp30x64": Workload("MLP 30x64 (62 params, overhead-bound)", lambda: mlp(30, 64), (64,), 32),
    "resnet18": Workload("ResNet-18-like (width 32), 32x32", lambda: resnet18(32), (3, 32, 32), 32),
}


def model_of(workload: Workload) -> torch.nn.Module:
    """The workload's model, with the same weights every time."""
    torch.manual_seed(0)
    return workload.make()
