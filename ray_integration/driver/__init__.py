"""``ray_integration.driver``: the membership driver, in the driver's process.

It owns the job's membership: the worker pool and its records (:mod:`.pool`, which creates the worker actors,
keeps one record per worker up to date from their messages and from Ray, and does what it is told), the state
machine (:mod:`.states`: small classes that read a :mod:`.context` and return typed actions, deciding with the
pure functions of :mod:`.decisions` and :mod:`.formation`), the loop that steps the states and is the one place
that acts (:mod:`.loop`), the Ray watcher (:mod:`.watcher`), the workers' mail (:mod:`.mailroom`), stops and
SIGTERM (:mod:`.stopping`), and what a run shows: its events (:mod:`.events`), progress line (:mod:`.progress`)
and timeline file (:mod:`.timeline`).

It may import ``ray_integration.errors``, ``ray_integration.config`` and ``ray_integration.wire``; of the worker
side only the actor class, in :mod:`.pool`, to create the actors. The states import neither the loop nor the
pool. The trainer (the front door) imports it; nothing below it does.
"""
