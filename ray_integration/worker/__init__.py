"""``ray_integration.worker``: the worker side, in each worker actor's process.

It owns the actor that runs the user's ``fn`` (:mod:`.actor`: ``RingWorker``, its heartbeat thread and what
it sends the driver), the elastic loop's rendezvous with the driver (:mod:`.rendezvous`), and the choice of the
worker's CUDA device (:mod:`.devices`).

It may import ``ray_integration.errors``, ``ray_integration.wire`` (what it says to the driver, and how) and
``ray_integration.data`` (the datasets it installs for ``get_dataset_shard``); never the driver.
"""
