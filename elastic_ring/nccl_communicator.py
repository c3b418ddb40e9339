"""The old path of :mod:`elastic_ring.backends.nccl.communicator`, kept as an alias (issue 24).

``import elastic_ring.nccl_communicator`` gives that very module, so ``shared_gpu_env`` and every other
name (and anything patched on it) are the same objects. New code imports the new path.
"""

import sys

from .backends.nccl import communicator as _communicator

sys.modules[__name__] = _communicator
