"""``TorchTrainer``: Ray Train 2.60's ``ray.train.torch.TorchTrainer``, run by ``ElasticTrainer``.

``fit()`` follows Ray Train V2: it returns a ``ray.train.Result`` (``metrics`` and ``checkpoint`` of the newest
reported checkpoint, ``None`` when no report carried one; ``best_checkpoints`` every kept one with its metrics;
``metrics_dataframe`` their metrics; ``return_value`` rank 0's return value; ``path`` the run's directory
``storage_path/name``), and raises ``ray.train.WorkerGroupError`` when the training function raised past the
failure budget (``worker_failures`` maps the rank to what the function raised, with its remote traceback, as Ray's) or when the workers
failed more often than ``FailureConfig(max_failures)`` allows, ``ray.train.ControllerError`` when the run could not
start or its driver failed. What the workers run is :func:`ray_integration.train._dropin.run_training_function`.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

from state import CheckpointError
from state.checkpoints.reported import ReportedCheckpoints

from ...errors import RunFailed, WorkerError
from ...trainer import ElasticTrainer
from .. import _dropin
from .._checkpoint import as_ray_checkpoint
from .._config import translate_dropin

#: Characters of a worker's traceback kept in WorkerGroupError's message (Ray Train truncates to 1000 too).
ERROR_SNIPPET_CHARS = 1000


def _worker(fn: Callable[..., Any], options: _dropin.Options, config: dict) -> Any:
    """What each worker runs (defined here so that a worker imports ``ray_integration.train.torch`` before the
    training function runs: a script's ``train.torch.prepare_model`` needs the attribute)."""
    return _dropin.run_training_function(fn, options, config)


class TorchTrainer:
    """Ray Train's ``TorchTrainer(train_loop_per_worker, *, train_loop_config=None, torch_config=None,
    scaling_config=None, run_config=None, datasets=None, dataset_config=None, validation_config=None, metadata=None,
    resume_from_checkpoint=None)``; :meth:`fit` runs it (module docstring, docs/ray_train.md)."""

    def __init__(self, train_loop_per_worker: Callable[..., Any], *, train_loop_config: dict | None = None,
                 torch_config: Any = None, scaling_config: Any = None, run_config: Any = None,
                 datasets: dict | None = None, dataset_config: Any = None, validation_config: Any = None,
                 metadata: dict | None = None, resume_from_checkpoint: Any = None) -> None:
        if resume_from_checkpoint is not None:
            raise DeprecationWarning("TorchTrainer(resume_from_checkpoint=...) is deprecated in Ray Train V2 (and "
                                     "here): the training function resumes with ray_integration.train.get_checkpoint(), "
                                     "which finds the newest checkpoint under RunConfig(storage_path, name)")
        if metadata is not None:
            raise DeprecationWarning("TorchTrainer(metadata=...) is deprecated in Ray Train V2 (and here): pass what "
                                     "the workers need in train_loop_config")
        if validation_config is not None:
            raise ValueError("TorchTrainer(validation_config=...) is not supported: validate inside the training "
                             "function and report the result as a metric")
        if train_loop_config is not None and not isinstance(train_loop_config, dict):
            raise TypeError(f"TorchTrainer train_loop_config must be a dict or None, got "
                            f"{type(train_loop_config).__name__}")
        self.train_loop_per_worker = train_loop_per_worker
        self.train_loop_config = train_loop_config
        options, max_failures = translate_dropin(scaling_config, run_config)
        _check_torch_config(torch_config, options.get("use_gpu", False))
        _check_dataset_config(dataset_config)
        self._datasets = _check_datasets(datasets)
        self._worker_options = _dropin.Options(_dropin.takes_config(train_loop_per_worker), max_failures,
                                               options["max_workers"])
        self._options = options

    def fit(self) -> Any:
        """Run the training function on every worker; the ``ray.train.Result`` (module docstring)."""
        datasets = None if self._datasets is None else {
            name: ds() if callable(ds) and not _is_dataset(ds) else ds for name, ds in self._datasets.items()}
        trainer = ElasticTrainer(datasets=datasets, **self._options)
        fn = functools.partial(_worker, self.train_loop_per_worker, self._worker_options)
        try:
            result = trainer.run(fn, config=dict(self.train_loop_config or {}))
        except WorkerError as exc:
            raise _worker_group_error({exc.rank if exc.rank is not None else -1: _as_ray_failure(exc)},
                                      exc.remote_traceback) from exc
        except RunFailed as exc:
            if "max_failures=" in str(exc):  # the driver's count of failed rings exceeded the budget
                raise _worker_group_error({}, str(exc)) from exc
            from ray.train import ControllerError

            raise ControllerError(exc) from exc
        return _ray_result(trainer.config.checkpoint_uri, result.value)

    @classmethod
    def restore(cls, *args: Any, **kwargs: Any) -> None:
        raise DeprecationWarning("TorchTrainer.restore is deprecated in Ray Train V2 (and here): construct the "
                                 "trainer again with the same RunConfig(storage_path, name); the training function "
                                 "resumes with get_checkpoint()")

    @classmethod
    def can_restore(cls, *args: Any, **kwargs: Any) -> None:
        cls.restore()


def _as_ray_failure(error: WorkerError) -> BaseException:
    """A rank's entry of ``WorkerGroupError.worker_failures`` as Ray Train 2.60 makes it: what the function raised,
    wrapped with its remote traceback (``UserExceptionWithTraceback``: ``str()`` is the traceback, ``_base_exc`` the
    exception); the ``WorkerError`` itself when that exception could not be pickled or the worker failed outside it."""
    if error.cause is None:
        return error
    try:
        from ray.train.v2._internal.exceptions import UserExceptionWithTraceback
    except ImportError:  # another Ray: the exception itself
        return error.cause
    return UserExceptionWithTraceback(error.cause, traceback_str=error.remote_traceback)


def _worker_group_error(failures: dict, text: str) -> Exception:
    from ray.train import WorkerGroupError

    ranks = ",".join(str(r) for r in sorted(failures)) or "?"
    snippet = text if len(text) <= ERROR_SNIPPET_CHARS else "...\n" + text[-ERROR_SNIPPET_CHARS:]
    return WorkerGroupError(f"[Rank {ranks} Error Snippet]:\n{snippet}", failures)


def _ray_result(uri: str, value: Any) -> Any:
    """Ray Train V2's ``Result`` of the run at ``uri`` (module docstring)."""
    import pandas
    from ray.train import Result

    best = []
    store = ReportedCheckpoints(uri)
    for seq in store.complete():
        try:
            metrics = store.manifest(seq).get("metrics") or {}
        except (CheckpointError, OSError):  # pruned or damaged since it was listed: not one of the kept ones
            continue
        best.append((as_ray_checkpoint(store.files_url(seq)), dict(metrics)))
    checkpoint, metrics = best[-1] if best else (None, None)
    return Result(metrics=metrics, checkpoint=checkpoint, error=None, path=uri,
                  metrics_dataframe=pandas.DataFrame([m for _, m in best]) if best else None, best_checkpoints=best,
                  _storage_filesystem=as_ray_checkpoint(uri).filesystem, return_value=value)


def _check_torch_config(torch_config: Any, use_gpu: bool) -> None:
    if torch_config is None:
        return
    from ray.train.torch import TorchConfig

    if not isinstance(torch_config, TorchConfig):
        raise TypeError(f"TorchTrainer torch_config={torch_config!r} must be a ray.train.torch.TorchConfig or None")
    backend = "nccl" if use_gpu else "gloo"
    if torch_config.backend not in (None, backend):
        raise ValueError(f"TorchTrainer torch_config=TorchConfig(backend={torch_config.backend!r}) is not supported "
                         f"with use_gpu={use_gpu}: the ring uses {backend}; drop backend")
    if torch_config.init_method != "env" or torch_config.timeout_s != TorchConfig().timeout_s:
        raise ValueError(f"TorchTrainer torch_config={torch_config!r}: init_method and timeout_s are not used (the "
                         "ring is formed by the driver; its collectives time out after collective_timeout_s); drop "
                         "them")


def _check_dataset_config(dataset_config: Any) -> None:
    if dataset_config is None:
        return
    from ray.train import DataConfig

    if not isinstance(dataset_config, DataConfig):
        raise TypeError(f"TorchTrainer dataset_config={dataset_config!r} must be a ray.train.DataConfig or None")
    split = getattr(dataset_config, "_datasets_to_split", "all")
    if split != "all":
        raise ValueError(f"TorchTrainer dataset_config=DataConfig(datasets_to_split={split!r}) is not supported: every "
                         "dataset is split over the ring (each sample once per epoch); drop dataset_config")


def _is_dataset(value: Any) -> bool:
    from ray.data import Dataset

    return isinstance(value, Dataset)


def _check_datasets(datasets: Any) -> dict | None:
    if datasets is None:
        return None
    if not isinstance(datasets, dict) or not all(isinstance(k, str) and k and (callable(v) or _is_dataset(v))
                                                 for k, v in datasets.items()):
        raise TypeError(f"TorchTrainer datasets={datasets!r} must be a dict of name -> ray.data.Dataset (or a "
                        "function returning one)")
    return dict(datasets)
