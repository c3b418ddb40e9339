"""``ray_integration.wire``: the contract between the driver and the workers.

It owns what they say and where (:mod:`.protocol`: the store's queue names, the message kinds as enums), how
they say it (:mod:`.channel`: sealed JSON messages through the rendezvous store, with retries and replay
protection), what the driver hands every worker before ``fn`` runs (:mod:`.settings`: the typed,
validated :class:`~.settings.WorkerSettings`), and what a worker's process environment tells the script
(:mod:`.launch_env`: Horovod's launch variables, from the first ring the worker joins).

It imports nothing of ray_integration (only ``elastic_ring`` and ``state``): the driver and the worker side
both import it, so neither needs the other.
"""
