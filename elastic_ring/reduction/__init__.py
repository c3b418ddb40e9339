"""Gradient reduction: ``DistributedOptimizer`` and everything its step runs.

Wire compression, tensor fusion, bucket-size autotuning, the cross-rank signature check, the step's
verdict and the trailer carried in its last bucket, the gradient buckets (``buckets``), the reducer that
launches them during backward (``reducer``) with its mixins: the step's agreement (``agreement``), step
accounting (``step_accounting``) and answering a joined rank (``joinable``), and the optimizer wrapper
(``optimizer``). Imports
``core``, ``backends`` and ``ring``.
"""
