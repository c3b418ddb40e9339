"""The NCCL backend: libnccl through ctypes, importable without CUDA or libnccl.

The bindings (``lib``), the life of one communicator handle (``handle``), the watchdog that aborts a
hung communicator (``watchdog``), re-forming a ring from the previous round's communicator (``reform``)
and the ``Communicator`` itself (``communicator``).
"""
