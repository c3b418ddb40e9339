"""``FashionMNIST`` made locally: 10 classes of 28x28 uint8 images, each a fixed random template of its class plus
noise (seeded: the same on every process), ``TRAIN_SIZE`` / ``TEST_SIZE`` samples. ``root`` and ``download`` are
accepted and not used: nothing is read or written."""

from __future__ import annotations

import numpy

TRAIN_SIZE, TEST_SIZE, CLASSES = 1024, 256, 10


class FashionMNIST:
    def __init__(self, root: str, train: bool = True, download: bool = False, transform=None,
                 target_transform=None) -> None:
        rng = numpy.random.default_rng(7)
        templates = rng.integers(0, 256, size=(CLASSES, 28, 28))
        size = TRAIN_SIZE if train else TEST_SIZE
        data_rng = numpy.random.default_rng(11 if train else 13)
        self.targets = data_rng.integers(0, CLASSES, size=size)
        noise = data_rng.normal(0.0, 40.0, size=(size, 28, 28))
        self.data = numpy.clip(templates[self.targets] + noise, 0, 255).astype(numpy.uint8)
        self.transform, self.target_transform = transform, target_transform

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, index: int):
        image, target = self.data[index], int(self.targets[index])
        if self.transform is not None:
            image = self.transform(image)
        if self.target_transform is not None:
            target = self.target_transform(target)
        return image, target
