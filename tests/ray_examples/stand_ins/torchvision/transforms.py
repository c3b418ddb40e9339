"""``Compose``, ``ToTensor`` and ``Normalize`` as torchvision applies them to a 28x28 uint8 image."""

from __future__ import annotations

import numpy
import torch


class Compose:
    def __init__(self, transforms: list) -> None:
        self.transforms = list(transforms)

    def __call__(self, x):
        for transform in self.transforms:
            x = transform(x)
        return x


class ToTensor:
    """An HxW (or HxWxC) uint8 array as a float CxHxW tensor in [0, 1]."""

    def __call__(self, image: numpy.ndarray) -> torch.Tensor:
        array = numpy.asarray(image)
        if array.ndim == 2:
            array = array[:, :, None]
        return torch.from_numpy(array.transpose(2, 0, 1).copy()).float().div(255.0)


class Normalize:
    def __init__(self, mean: tuple, std: tuple) -> None:
        self.mean, self.std = torch.tensor(mean).view(-1, 1, 1), torch.tensor(std).view(-1, 1, 1)

    def __call__(self, tensor: torch.Tensor) -> torch.Tensor:
        return (tensor - self.mean) / self.std
