"""Horovod's launch environment: the variables ``horovodrun`` sets on every worker, from the ring it first joins.

A Horovod script reads them from ``os.environ`` (``elastic_torch_main.py`` reads ``HOROVOD_RANK`` and
``HOROVOD_HOSTNAME`` right after ``hvd.init()``, at module level). Each worker sets them once, when the driver
hands it its first ring (before that ring forms, so before the ``hvd.init()`` or the first ``er`` call that
waits for it returns), with the values of that ring: Horovod's meaning in elastic mode, where a process keeps
the values of the assignment it was spawned for all its life (Horovod's C++ ``setenv`` on a re-form never
reaches Python's ``os.environ``). The live values are ``hvd.rank()``, ``hvd.size()``, ...

=============================== ===========================================================================
``HOROVOD_RANK``, ``_SIZE``       the rank and world size of that first ring
``HOROVOD_LOCAL_RANK``, ``_SIZE`` the rank among that ring's ranks on this node, and how many there are
``HOROVOD_CROSS_RANK``, ``_SIZE`` this node's index among the nodes that have a rank with this local rank,
                                  and how many such nodes there are
``HOROVOD_HOSTNAME``              this node's Ray node id (hex), as Horovod on Ray sets it: the worker's
                                  identity toward the driver, the same for every worker of the node
``HOROVOD_ELASTIC``               ``1``: every job of elastic_ring is elastic
``HOROVOD_CONTROLLER``,           ``gloo``, as ``horovodrun --gloo`` (the collectives of a GPU job run on NCCL)
``HOROVOD_CPU_OPERATIONS``
``HOROVOD_GLOO_RENDEZVOUS_ADDR``, the driver's rendezvous store (elastic_ring's authenticated TCP store, not
``..._PORT``                      Horovod's HTTP server: only elastic_ring talks to it)
=============================== ===========================================================================

Not set: ``HOROVOD_GLOO_IFACE`` and ``NCCL_SOCKET_IFNAME`` (gloo binds the address Ray uses for the node, and
NCCL's own choice of interface is left alone), ``PYTHONUNBUFFERED`` (it would come too late to matter).
"""

from __future__ import annotations

from elastic_ring.core.spec import RingSpec


def horovod_environment(spec: RingSpec) -> dict[str, str]:
    """What ``horovodrun`` would set on the worker that holds ``spec``'s rank (from its own placement: the
    driver's answer carries no node table)."""
    place = spec.placement
    return {
        "HOROVOD_RANK": str(spec.rank),
        "HOROVOD_SIZE": str(spec.world_size),
        "HOROVOD_LOCAL_RANK": str(place.local_rank),
        "HOROVOD_LOCAL_SIZE": str(place.local_size),
        "HOROVOD_CROSS_RANK": str(place.cross_rank),
        "HOROVOD_CROSS_SIZE": str(place.cross_size),
        "HOROVOD_HOSTNAME": place.node_id,
        "HOROVOD_ELASTIC": "1",
        "HOROVOD_CONTROLLER": "gloo",
        "HOROVOD_CPU_OPERATIONS": "gloo",
        "HOROVOD_GLOO_RENDEZVOUS_ADDR": spec.store.host,
        "HOROVOD_GLOO_RENDEZVOUS_PORT": str(spec.store.port),
    }


__all__ = ["horovod_environment"]
