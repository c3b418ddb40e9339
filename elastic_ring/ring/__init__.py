"""One ring per round: the process's current communicator and what runs on top of it.

Forming, re-forming and aborting rounds (``runtime``: ``er.init``, ``er.shutdown``), the rendezvous
store server (``store``), the elastic loop (``elastic``: ``@er.elastic.run``), sub-rings of some of
the ring's ranks (``process_sets``), keeping torch's ``DistributedSampler`` right across resizes
(``distributed_samplers``) and ``er.report`` (``report``). Imports ``core`` and ``backends``.
"""
