"""The communicators: the contract every backend implements and what gloo and NCCL share.

``base`` (``Communicator``, ``Work``), interruptible formation (``formation``), the reaper that tears an
old gloo group down off the caller's thread (``reaper``), byte strings over a communicator
(``byte_collectives``), gloo through ``torch.distributed`` (``gloo``) and NCCL through libnccl by ctypes
(the ``nccl`` sub-package). Imports ``core`` only.
"""
