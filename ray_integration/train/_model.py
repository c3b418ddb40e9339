"""``ray.train.torch.prepare_model``: the model on the worker's device, in a data-parallel wrapper that reduces its
gradients with elastic_ring's fused, overlapped buckets.

:class:`ElasticDataParallel` is what Ray Train's ``DistributedDataParallel`` is to a script: ``model.module`` is the
model, ``state_dict()`` keys carry ``module.``, ``no_sync()`` skips the reduction of the backward passes inside it,
and ``isinstance(model, DistributedDataParallel)`` holds (it subclasses torch's class for its interface, without
its process group: it never calls ``DistributedDataParallel.__init__``). Its gradients are reduced by a
:class:`~elastic_ring.reduction.reducer.GradReducer` over the current ring (whatever ring: it follows re-forms):
buckets go out while backward runs, and the reduction completes at the end of ``loss.backward()`` (an autograd
engine callback, as torch's DDP does), so the user's plain optimizer steps on averaged gradients. The parameters
and buffers are broadcast from rank 0 when the model is wrapped (as DDP does), and the buffers before every
training forward (DDP's ``broadcast_buffers=True``).

A script that also wraps its optimizer in ``er.DistributedOptimizer`` (the state API's step-exact level) has its
gradients reduced by that optimizer: the wrapper notices at the next training forward and steps aside.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

import elastic_ring as er
from elastic_ring.core.constants import AUTOTUNE, FIRST_BUCKET_BYTES, OPTIMIZER_BUCKET_BYTES
from elastic_ring.core.log import get_logger
from elastic_ring.core.ops import ReduceOp
from elastic_ring.reduction import joinable
from elastic_ring.reduction.compression import Compression
from elastic_ring.reduction.reducer import GradReducer
from elastic_ring.ring import runtime

from . import _dropin
from ._devices import get_device, ring_place

_log = get_logger(__name__)

#: DistributedDataParallel's keyword arguments that mean nothing here, accepted as Ray Train passes them through.
_DDP_ACCEPTED = {"device_ids", "output_device", "dim", "find_unused_parameters", "gradient_as_bucket_view",
                 "static_graph", "check_reduction"}
_wrapped: "weakref.WeakKeyDictionary[torch.nn.Module, ElasticDataParallel]" = weakref.WeakKeyDictionary()


class ElasticDataParallel(DistributedDataParallel):
    """The data-parallel wrapper :func:`prepare_model` returns (module docstring)."""

    def __init__(self, module: torch.nn.Module, *, broadcast_buffers: bool = True, bucket_bytes: int | None = None,
                 sync_states: bool = True) -> None:  # noqa: D107 - not DistributedDataParallel.__init__
        torch.nn.Module.__init__(self)
        self.module = module
        self.require_backward_grad_sync = True   # DistributedDataParallel.no_sync() toggles it
        self.require_forward_param_sync = True
        self.forward_sync_buffers = broadcast_buffers  # DistributedDataParallel.broadcast_buffers reads it
        self._sync_backward = True
        self._queued = False
        self._reducers_seen = 0  # how many reducers this process had at the last look for an optimizer's
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        size = OPTIMIZER_BUCKET_BYTES if bucket_bytes is None else bucket_bytes
        self._reducer: GradReducer | None = GradReducer(
            named, ReduceOp.AVERAGE, Compression.none, size, 1, first_bucket_bytes=FIRST_BUCKET_BYTES,
            autotune=AUTOTUNE and bucket_bytes is None)
        self._reducer.remove_hooks()  # its hooks are ours below: they skip the passes inside no_sync()
        self._gates = [p.register_post_accumulate_grad_hook(self._on_grad) for _, p in named]
        if sync_states and ring_place()[1] > 1:
            er.broadcast_parameters(module, root_rank=0)  # DDP's init: every rank starts from rank 0's model

    # ---------------------------------------------------------------- forward
    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        grad = torch.is_grad_enabled()
        if self._reducer is not None and grad and self.training and self._covered_by_an_optimizer():
            self.release("an er.DistributedOptimizer reduces these parameters")
        self._sync_backward = self.require_backward_grad_sync and grad
        if self.training and self.forward_sync_buffers:
            buffers = [b for b in self.module.buffers()]
            comm = runtime.current_or_none()
            if buffers and comm is not None and comm.size > 1:
                er.grouped_broadcast_(buffers, 0, name=[f"buffer{i}" for i in range(len(buffers))])
        return self.module(*inputs, **kwargs)

    def _covered_by_an_optimizer(self) -> bool:
        """Another live reducer (an ``er.DistributedOptimizer``'s) has hooks on one of these parameters (looked at
        again only when the process's number of reducers changed)."""
        if len(joinable._live) == self._reducers_seen:
            return False
        self._reducers_seen = len(joinable._live)
        mine = self._reducer
        ids = {id(p) for p in mine._params}
        return any(r is not mine and r._hooks and any(id(p) in ids for p in r._params) for r in list(joinable._live))

    # ---------------------------------------------------------------- backward
    def _on_grad(self, param: torch.Tensor) -> None:
        reducer = self._reducer
        if reducer is None or not self._sync_backward:
            return
        reducer._on_grad_ready(param)
        if not self._queued:
            comm = runtime.current_or_none()
            if comm is not None and comm.size > 1:
                self._queued = True
                torch.autograd.Variable._execution_engine.queue_callback(self._finish)

    def _finish(self) -> None:
        """At the end of backward: wait for every bucket (the gradients are the ring's averages now)."""
        self._queued = False
        if self._reducer is not None:
            self._reducer.synchronize()

    def release(self, why: str) -> None:
        """Stop reducing (this wrapper's gradient hooks are removed)."""
        for handle in self._gates:
            handle.remove()
        self._gates, self._reducer = [], None
        _log.info("prepare_model's wrapper no longer reduces gradients: %s", why)

    # ---------------------------------------------------------------- copies
    def __getstate__(self) -> dict:
        """A copy (``copy.deepcopy(model)``, ``torch.save(model)``) holds the module only: it reduces nothing."""
        attrs = dict(self.__dict__)
        attrs.update(_reducer=None, _gates=[], _queued=False, _reducers_seen=0)
        return attrs

    def __setstate__(self, state: dict) -> None:
        torch.nn.Module.__setstate__(self, state)


def prepare_model(model: torch.nn.Module, move_to_device: bool | torch.device = True,
                  parallel_strategy: str | None = "ddp", parallel_strategy_kwargs: dict | None = None) -> torch.nn.Module:
    """Ray Train's ``prepare_model``: ``model`` on this worker's device (``move_to_device``: True, False or a
    ``torch.device``) and, with ``parallel_strategy="ddp"``, in an :class:`ElasticDataParallel` whenever the job
    may have more than one worker (Ray wraps only when it has more than one now: here the ring may grow later).
    ``parallel_strategy=None`` only moves it. ``parallel_strategy_kwargs``: DistributedDataParallel's
    ``broadcast_buffers`` and ``bucket_cap_mb`` are honoured, ``device_ids``, ``output_device``,
    ``find_unused_parameters``, ``gradient_as_bucket_view``, ``static_graph`` accepted (a parameter without a
    gradient contributes zeros; gradients always live in the buckets); any other is refused."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"prepare_model expects a torch.nn.Module, got {type(model).__name__}")
    if parallel_strategy not in ("ddp", None):
        raise ValueError(f"prepare_model(parallel_strategy={parallel_strategy!r}) is not supported: use 'ddp' (the "
                         "ring's fused gradient reduction) or None (only move the model); FSDP shards the model, which "
                         "this drop-in does not")
    if not isinstance(move_to_device, (bool, torch.device)):
        raise TypeError(f"prepare_model(move_to_device={move_to_device!r}) must be True, False or a torch.device")
    device = move_to_device if isinstance(move_to_device, torch.device) else get_device()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if move_to_device is not False:
        model = model.to(device)
    kwargs = _ddp_options(parallel_strategy_kwargs)
    session = _dropin.current()
    world = ring_place()[1]
    if parallel_strategy is None or (world == 1 and (session is None or session.options.max_workers == 1)):
        return model
    previous = _wrapped.get(model)
    if previous is not None and previous._reducer is not None:  # prepared again (a re-entry): one reducer per model
        previous.release("the model was prepared again")
    wrapper = ElasticDataParallel(model, sync_states=session is None or session.all_entering, **kwargs)
    _wrapped[model] = wrapper
    return wrapper


def _ddp_options(kwargs: dict | None) -> dict:
    if kwargs is None:
        return {}
    if not isinstance(kwargs, dict):
        raise TypeError(f"prepare_model(parallel_strategy_kwargs={kwargs!r}) must be a dict or None")
    out: dict = {}
    for key, value in kwargs.items():
        if key == "broadcast_buffers":
            out["broadcast_buffers"] = bool(value)
        elif key == "bucket_cap_mb":
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"prepare_model parallel_strategy_kwargs bucket_cap_mb={value!r} must be > 0")
            out["bucket_bytes"] = max(1, int(value * 2**20))
        elif key == "dim" and value != 0:
            raise ValueError(f"prepare_model parallel_strategy_kwargs dim={value!r}: only dim=0 is supported")
        elif key not in _DDP_ACCEPTED:
            raise ValueError(f"prepare_model parallel_strategy_kwargs {key}={value!r} is not supported by "
                             "ray_integration.train's data-parallel wrapper; drop it (accepted: broadcast_buffers, "
                             f"bucket_cap_mb, {', '.join(sorted(_DDP_ACCEPTED))})")
    return out
