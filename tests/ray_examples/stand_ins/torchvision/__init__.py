"""A test-only stand-in for the few torchvision names Ray Train's fashion-MNIST example uses (``datasets.FashionMNIST``,
``transforms.Compose``, ``ToTensor``, ``Normalize``): the real package cannot be imported on this machine and the
example would download the data. Not torchvision: nothing else of it exists here."""

from . import datasets, transforms

__all__ = ["datasets", "transforms"]
