"""state.checkpoints: durable checkpoints on any fsspec URL, of both kinds (the state's ``ckpt-N``, and the
directories of files that ``report(checkpoint=...)`` uploads, ``reported/ckpt-N``).

* :mod:`~state.checkpoints.transport`: the one transport (:class:`Location`: an fsspec filesystem and root; fsync,
  atomic small files, conditional create).
* :mod:`~state.checkpoints.sequenced`: the one sequenced writer (claim, files, manifest last, lease-generation
  fence, prune, failed-claim cleanup); :mod:`~state.checkpoints.store` (state trees, ``CheckpointStore``) and
  :mod:`~state.checkpoints.reported` (``ReportedCheckpoints``) are its two payloads and their readers.
* :mod:`~state.checkpoints.background`: the one background writer (one in flight, the newest replaces the waiting
  one, transient errors retried, events to the checkpoint listener); the reported checkpoints' uploads
  (:mod:`~state.checkpoints.uploads`) use it too. :mod:`~state.checkpoints.hooks`: this process's writers together
  (``set_checkpoint_listener``, ``flush_checkpoints``, the flush at exit).
* :mod:`~state.checkpoints.lease` (with ``lease_base``, ``lease_file``, ``lease_object_store``): one live run per
  location.
* :mod:`~state.checkpoints.config` (``CheckpointConfig``, location checks, this process's default),
  :mod:`~state.checkpoints.policy` (pure decisions: names, order, what to prune) and
  :mod:`~state.checkpoints.faults` (which storage errors are retried, and how long).

May import ``elastic_ring`` (logs), torch, fsspec and filelock, and of ``state`` only the leaf modules
:mod:`state.errors` (the public errors) and :mod:`state.snapshot` (host copies of tensor trees); never the core
(``state.state``), the samplers or Ray. Modules named ``_*`` are private to the package.
"""
