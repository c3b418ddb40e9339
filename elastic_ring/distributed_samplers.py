"""Keep torch's ``DistributedSampler`` right across resizes inside an elastic loop.

A ``DistributedSampler(ds, num_replicas=er.size(), rank=er.rank())`` built once splits the data for
the ring it was built in; after a resize it would keep splitting for the old one (ranks overlap or
skip samples, silently). Before every run of the training function, the elastic loop finds the
``DistributedSampler`` objects the function can reach (its arguments, its closure and the globals
it names, and the samplers of DataLoaders among those, one level deep) and points them at the
current ring. A ``DistributedSampler`` does not know how far an epoch got, so after a failure or a
resize its epoch restarts (samples are seen twice): a log line says so once per sampler, and names
the fix for training data (``state.ElasticSampler`` keeps each sample of an epoch exactly once).
Only samplers split for the ring the loop last ran in follow (one built with another split on
purpose, such as ``num_replicas=1`` for an evaluation on rank 0, is left alone). A sampler the
loop cannot reach (built and used by an evaluation function the loop never names, or held by an
object) is not seen: build it where it is used, from ``er.size()`` and ``er.rank()``.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Iterable

import torch

from .log import get_logger

_log = get_logger(__name__)

_warned: set[int] = set()


def _candidates(func: Callable[..., Any], args: Iterable[Any], kwargs: dict[str, Any]) -> list[Any]:
    found: list[Any] = [*args, *kwargs.values()]
    code = getattr(func, "__code__", None)
    if code is not None:
        for cell in getattr(func, "__closure__", None) or ():
            try:
                found.append(cell.cell_contents)
            except ValueError:  # an empty cell
                continue
        module_globals = getattr(func, "__globals__", {})
        found.extend(module_globals[name] for name in code.co_names if name in module_globals)
    return found


def _samplers(objects: Iterable[Any]) -> list[torch.utils.data.DistributedSampler]:
    out: dict[int, torch.utils.data.DistributedSampler] = {}
    for obj in objects:
        if isinstance(obj, torch.utils.data.DataLoader):
            obj = obj.sampler if not isinstance(obj.sampler, torch.utils.data.SequentialSampler) else \
                getattr(obj.batch_sampler, "sampler", None)
        if isinstance(obj, torch.utils.data.BatchSampler):
            obj = obj.sampler
        if isinstance(obj, torch.utils.data.DistributedSampler):
            out[id(obj)] = obj
    return list(out.values())


def retarget(sampler: torch.utils.data.DistributedSampler, rank: int, size: int) -> bool:
    """Point ``sampler`` at ring ``(rank, size)`` the way its constructor would; True if it changed."""
    if sampler.num_replicas == size and sampler.rank == rank:
        return False
    sampler.num_replicas, sampler.rank = size, rank
    n = len(sampler.dataset)  # type: ignore[arg-type]
    if sampler.drop_last and n % size != 0:
        sampler.num_samples = math.ceil((n - size) / size)
    else:
        sampler.num_samples = math.ceil(n / size)
    sampler.total_size = sampler.num_samples * size
    return True


def retarget_reachable(func: Callable[..., Any], args: Iterable[Any], kwargs: dict[str, Any], rank: int,
                       size: int, previous: tuple[int, int] | None = None) -> int:
    """Point the DistributedSamplers ``func`` can reach at ring ``(rank, size)``; return how many changed.
    With ``previous`` (this process's ``(rank, size)`` in the ring the loop last ran in), only samplers split for
    that ring follow: one built for another split on purpose (``num_replicas=1`` for a rank-0 evaluation, a
    sub-group) is left alone."""
    changed = 0
    for sampler in _samplers(_candidates(func, args, kwargs)):
        if previous is not None and (sampler.rank, sampler.num_replicas) != previous:
            continue
        if retarget(sampler, rank, size):
            changed += 1
            if id(sampler) not in _warned:
                _warned.add(id(sampler))
                _log.info(
                    "a torch DistributedSampler the elastic loop uses now splits its data over the ring of %d "
                    "ranks (as it will after every resize); it cannot know how far an epoch got, so an epoch it "
                    "was in restarts on the new ring: right for evaluation; for training data use "
                    "state.ElasticSampler (each sample of an epoch exactly once)", size)
    return changed
