"""state.samplers: the positions a ``State`` keeps in the data, exactly once across failures and resizes.

Owns :class:`~state.samplers.sampler.ElasticSampler` (a batch sampler over an indexable dataset),
:class:`~state.samplers.stream.ElasticStream` (an iterable dataset with ``state_dict()``) and their pure layout
(:mod:`~state.samplers.sampler_layout`: how an epoch's rest is cut over a ring, and a global batch into steps).

May import ``elastic_ring`` and torch; nothing else of ``state`` (the core imports the samplers, never the other
way: a ``State`` links them to its optimizer, :mod:`state.step_link`).
"""
