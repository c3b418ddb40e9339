"""Ray Train's own example scripts (Apache-2.0, Copyright The Ray Authors), copied as test data with only their
``ray.train`` import lines changed; each file's header names its source.

torchvision cannot be imported on this machine (the wheel pip finds is a CUDA build, which fails against the CPU
torch), and the fashion-MNIST example downloads FashionMNIST with it: importing this package puts a stand-in first on
``sys.path`` (``stand_ins/torchvision``: ``datasets.FashionMNIST`` made locally, in memory, and the three transforms
the script uses), in the driver and in every Ray worker that imports a script from here.
"""

import os
import sys

_STAND_INS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "stand_ins")
if _STAND_INS not in sys.path:
    sys.path.insert(0, _STAND_INS)
