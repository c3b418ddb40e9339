"""ray_integration: the membership driver, the worker actors and ``ElasticTrainer``.

Uses ``elastic_ring`` and ``state``. Its contents arrive with the Ray issue;
this package exists now so that the distribution's layout is final.
"""
