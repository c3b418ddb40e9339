"""The lowest layer: what every other layer uses, knowing nothing of communicators or rings.

The exceptions (``errors``), the tunables and the only reader of environment variables (``constants``),
option checks (``validation``), reduce ops (``ops``), a round's ring spec (``spec``), authentication of
store values and payloads (``auth``), this process's identity, logs, progress and timeline, and the
allocator tuning. Imports nothing of elastic_ring outside ``core``.
"""
