"""torch's ``DistributedSampler`` inside an elastic loop: followed for evaluation, refused for training.

A ``DistributedSampler(ds, num_replicas=er.size(), rank=er.rank())`` built once splits the data for
the ring it was built in; after a resize it would keep splitting for the old one (ranks overlap or
skip samples, silently). Before the training function runs in a new ring, the elastic loop finds the
``DistributedSampler`` objects the function can reach (its arguments, its closure and the globals it
names, one level into the containers and objects among those, and the samplers of DataLoaders among
all of them) and points the ones split for the ring the loop last ran in at the current ring (one
built with another split on purpose, such as ``num_replicas=1`` for an evaluation on rank 0, is left
alone).

A ``DistributedSampler`` does not know how far an epoch got, so after a re-form its epoch starts again
from the beginning. For evaluation data that is harmless (the evaluation is simply run again on the new
split), and such samplers are re-pointed quietly (one log line). For training data it trains samples of
the epoch twice, which the elastic loop promises never to do, so it is **refused**: a re-pointed sampler
is watched, and as soon as an optimizer step runs between two of its batches (it feeds training steps)
its next batch raises :class:`DistributedSamplerInTraining`, which ends the run with the fix: an
``ElasticSampler`` (``DataLoader(ds, batch_sampler=ElasticSampler(ds, batch_size=B))``, kept in the
state), which keeps each sample of an epoch exactly once across failures and resizes. Two exceptions:

* a script written for Horovod (the loop's module imports ``ray_integration.horovod``, as every script
  run by ``python -m ray_integration.launch`` with only its import changed does) keeps Horovod's
  behaviour: the epoch restarts (a warning says so once per sampler, with the fix);
* a sampler passed to :func:`allow_epoch_restart` (an evaluation stream drawn between training steps,
  whose repeats do no harm).

A sampler the loop cannot reach (built and used by a function the loop never names, or held deeper
inside an object) is not seen, so it is neither re-pointed nor refused: build it where it is used, from
``er.size()`` and ``er.rank()``.
"""

from __future__ import annotations

import math
import types
import weakref
from typing import Any, Callable, Iterable, Iterator

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from ..core.log import get_logger

_log = get_logger(__name__)

_warned: "weakref.WeakSet[Any]" = weakref.WeakSet()

#: How many optimizer steps this process ran (any optimizer; counted once a sampler is watched).
_optimizer_steps = 0
_step_hook: Any = None

#: Objects looked into, one level below the loop's arguments, closure and globals (per container / object).
_MAX_MEMBERS = 256
_OPAQUE = (str, bytes, bytearray, int, float, complex, bool, type(None), torch.Tensor, types.ModuleType, type,
           types.FunctionType, types.BuiltinFunctionType, types.MethodType, torch.utils.data.Dataset)


class DistributedSamplerInTraining(RuntimeError):
    """A torch ``DistributedSampler`` feeds the training steps of an elastic loop whose ring changed: its epoch
    restarted, so samples of it would be trained twice. Use ``state.ElasticSampler`` for training data."""


def allow_epoch_restart(sampler: torch.utils.data.DistributedSampler) -> torch.utils.data.DistributedSampler:
    """Let ``sampler`` restart its epoch after a re-form even if optimizer steps run between its batches (an
    evaluation stream drawn between training steps: repeats do no harm). Returns ``sampler``."""
    if not isinstance(sampler, torch.utils.data.DistributedSampler):
        raise TypeError(f"allow_epoch_restart takes a torch DistributedSampler, got {type(sampler).__name__}")
    sampler._elastic_ring_restart_ok = True  # type: ignore[attr-defined]
    return sampler


def _members(obj: Any) -> list[Any]:
    """The values one level inside ``obj``: a container's items, an object's attributes."""
    if isinstance(obj, _OPAQUE) or isinstance(obj, (torch.utils.data.DataLoader, torch.utils.data.Sampler)):
        return []
    try:
        if isinstance(obj, dict):
            values: Iterable[Any] = obj.values()
        elif isinstance(obj, (list, tuple, set, frozenset)):
            values = obj
        else:
            attributes = getattr(obj, "__dict__", None)
            if not isinstance(attributes, dict):
                return []
            values = attributes.values()
        out = []
        for value in values:
            if len(out) >= _MAX_MEMBERS:
                break
            out.append(value)
        return out
    except Exception:  # an object whose attributes cannot be read, a container changed by another thread
        return []


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
    self = getattr(func, "__self__", None)  # a bound method: its object
    if self is not None:
        found.append(self)
    return found + [member for obj in found for member in _members(obj)]


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


def _horovod_script(func: Callable[..., Any]) -> bool:
    """Whether ``func``'s module imports the Horovod compatibility layer (``import ray_integration.horovod``)."""
    module_globals = getattr(func, "__globals__", None) or {}
    return any(isinstance(value, types.ModuleType)
               and str(getattr(value, "__name__", "")).startswith("ray_integration.horovod")
               for value in list(module_globals.values()))


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


# ---------------------------------------------------------------------------------------------- the watch
def _count_step(optimizer: Any, args: Any, kwargs: Any) -> None:
    global _optimizer_steps
    _optimizer_steps += 1


def _plain_copy(cls: type, attributes: dict[str, Any]) -> Any:
    """Rebuild a watched sampler as its own class (a copy or a pickle is not watched)."""
    obj = cls.__new__(cls)
    obj.__dict__.update(attributes)
    return obj


def _refusal(sampler: Any) -> DistributedSamplerInTraining:
    return DistributedSamplerInTraining(
        f"a torch DistributedSampler feeds the training steps of this elastic loop (an optimizer step ran "
        f"between two of its batches), and the ring re-formed (now {sampler.num_replicas} ranks): a "
        "DistributedSampler cannot know how far an epoch got, so its epoch started again and samples of it "
        "would be trained twice. Use state.ElasticSampler for training data: sampler = ElasticSampler(dataset, "
        "batch_size=B); loader = DataLoader(dataset, batch_sampler=sampler) (no batch_size, shuffle or sampler "
        "there); keep it in the state, TorchState(..., sampler=sampler); it keeps each sample of an epoch "
        "exactly once across failures and resizes. DistributedSamplers stay right for evaluation data (no "
        "optimizer step between its batches); for an evaluation stream drawn between training steps, pass it "
        "to elastic_ring.allow_epoch_restart(sampler)")


def _watched_iter(self: Any) -> Iterator[int]:
    indices = self._elastic_ring_plain_class.__iter__(self)
    return _watch(self, indices)


def _watch(sampler: Any, indices: Iterator[int]) -> Iterator[int]:
    seen = None
    for index in indices:
        if seen is not None and _optimizer_steps != seen and not getattr(sampler, "_elastic_ring_restart_ok", False):
            raise _refusal(sampler)
        seen = _optimizer_steps
        yield index


def _watched_reduce_ex(self: Any, protocol: Any) -> tuple[Any, ...]:
    return _plain_copy, (self._elastic_ring_plain_class, dict(self.__dict__))


_watched_classes: dict[type, type] = {}


def _watch_sampler(sampler: Any) -> None:
    """From now on, refuse ``sampler`` at its next batch after an optimizer step ran between two of its batches."""
    global _step_hook
    cls = type(sampler)
    if getattr(cls, "_elastic_ring_plain_class", None) is not None:  # watched already
        return
    if _step_hook is None:
        _step_hook = register_optimizer_step_post_hook(_count_step)
    watched = _watched_classes.get(cls)
    if watched is None:
        watched = _watched_classes[cls] = type(cls.__name__, (cls,), {
            "__iter__": _watched_iter, "__reduce_ex__": _watched_reduce_ex, "_elastic_ring_plain_class": cls,
            "__module__": cls.__module__, "__qualname__": cls.__qualname__})
    sampler.__class__ = watched


def retarget_reachable(func: Callable[..., Any], args: Iterable[Any], kwargs: dict[str, Any], rank: int,
                       size: int, previous: tuple[int, int] | None = None) -> int:
    """Point the DistributedSamplers ``func`` can reach at ring ``(rank, size)``; return how many changed.
    With ``previous`` (this process's ``(rank, size)`` in the ring the loop last ran in), only samplers split for
    that ring follow: one built for another split on purpose (``num_replicas=1`` for a rank-0 evaluation, a
    sub-group) is left alone. Each sampler that follows the ring (changed, or split for ``previous`` when that is
    also the new ring: the loop re-enters after a re-form all the same) is watched from now on: if it feeds
    training steps, its next batch raises :class:`DistributedSamplerInTraining` (unless ``func`` is a Horovod
    script's, or the sampler was passed to :func:`allow_epoch_restart`)."""
    changed = 0
    horovod = None
    for sampler in _samplers(_candidates(func, args, kwargs)):
        if previous is not None and (sampler.rank, sampler.num_replicas) != previous:
            continue
        if retarget(sampler, rank, size):
            changed += 1
        elif previous is None:  # already split for this ring, and nothing says it follows the ring
            continue
        if horovod is None:
            horovod = _horovod_script(func)
        if not horovod:
            _watch_sampler(sampler)
        if sampler in _warned:
            continue
        _warned.add(sampler)
        if horovod:
            _log.warning(
                "a torch DistributedSampler the elastic loop uses now splits its data over the ring of %d ranks; "
                "as in Horovod, an epoch it was in starts again (samples of it are trained twice if it feeds "
                "training). ElasticSampler keeps each sample of an epoch exactly once: "
                "DataLoader(dataset, batch_sampler=hvd.elastic.ElasticSampler(dataset, batch_size=B))", size)
        else:
            _log.info(
                "a torch DistributedSampler the elastic loop uses now splits its data over the ring of %d ranks; "
                "an epoch it was in starts again: right for evaluation data; if it feeds training steps, its next "
                "batch after a step raises DistributedSamplerInTraining (use state.ElasticSampler)", size)
    return changed
