"""The collectives API, Horovod-style, over the current ring: the top layer.

Tensor collectives (``tensors``: allreduce, allgather, broadcast, barrier and their grouped forms), the
``_async`` handles (``handles``), run in call order on one queue per communicator (``ordered``) or paired by name
(``negotiation``, Horovod's), reducescatter and alltoall (``scatter``), pickled object collectives
(``objects``), ``SyncBatchNorm`` and the broadcast of parameters and optimizer state. May import every
other layer; ``elastic_ring/__init__.py`` re-exports its public names.
"""
