"""Ray Train's configs (``ScalingConfig``, ``RunConfig`` with ``FailureConfig`` / ``CheckpointConfig``) read as
:class:`~ray_integration.config.TrainerConfig` options.

:func:`translate` turns the objects into option values; :func:`merge` adds them to the options given as
keywords, refusing an option given both ways. Each Ray Train field is honoured, or refused with an error
naming it, its value and what to do instead; docs/ray_train.md lists them.
"""

from __future__ import annotations

import os
import re
import warnings
from typing import Any

#: RunConfig's generated name (Ray Train 2.x fills ``ray_train_run-<date>`` in when none is given): a new one per
#: run, so a rerun would not find the last run's checkpoints.
_GENERATED_NAME = re.compile(r"^ray_train_run-\d{4}-\d{2}-\d{2}_\d{2}-\d{2}-\d{2}")


def _classes(name: str) -> tuple[type, ...]:
    """Ray Train's class ``name``: the one ``ray.train`` exports (Train V2 when enabled) and ``ray.air``'s (V1)."""
    import ray.air.config as v1
    import ray.train

    found = {getattr(ray.train, name), getattr(v1, name)}
    return tuple(found)


def _check_type(value: Any, name: str, what: str) -> None:
    if value is not None and not isinstance(value, _classes(name)):
        raise TypeError(f"ElasticTrainer {what}={value!r} must be a ray.train.{name} (or None)")


def translate(scaling_config: Any = None, run_config: Any = None) -> dict[str, tuple[Any, str]]:
    """The TrainerConfig options that ``scaling_config`` and ``run_config`` set: option -> (value, where it came
    from, e.g. ``"scaling_config.num_workers=(1, 2)"``)."""
    _check_type(scaling_config, "ScalingConfig", "scaling_config")
    _check_type(run_config, "RunConfig", "run_config")
    out: dict[str, tuple[Any, str]] = {}
    if scaling_config is not None:
        _scaling(scaling_config, out)
    if run_config is not None:
        _run(run_config, out)
    return out


def _scaling(sc: Any, out: dict) -> None:
    n = sc.num_workers
    said = f"scaling_config.num_workers={n!r}"
    if isinstance(n, tuple):
        out["min_workers"], out["max_workers"] = (n[0], said), (n[1], said)
    else:
        out["min_workers"], out["max_workers"] = (n, said), (n, said)
    if isinstance(n, int) and n == 0 or isinstance(n, tuple) and n[0] == 0:
        raise ValueError(f"ElasticTrainer {said}: elastic_ring needs at least one worker actor (Ray Train's "
                         "num_workers=0 runs in the driver's process); use num_workers >= 1")
    out["use_gpu"] = (bool(sc.use_gpu), f"scaling_config.use_gpu={sc.use_gpu!r}")
    resources = dict(sc.resources_per_worker or {})
    said = f"scaling_config.resources_per_worker={sc.resources_per_worker!r}"
    if "CPU" in resources:
        out["cpus_per_worker"] = (float(resources.pop("CPU")), said)
    if "GPU" in resources:
        gpus = float(resources.pop("GPU"))
        if gpus > 0 and not sc.use_gpu:
            raise ValueError(f"ElasticTrainer {said} asks for GPUs but scaling_config.use_gpu=False; set "
                             "use_gpu=True or drop 'GPU'")
        if sc.use_gpu:
            out["gpus_per_worker"] = (gpus, said)
    if "memory" in resources:
        raise ValueError(f"ElasticTrainer {said}: 'memory' is not supported for worker actors yet; drop it (Ray "
                         "schedules the workers by CPU, GPU and custom resources)")
    accelerator = getattr(sc, "accelerator_type", None)
    if accelerator:  # Ray's own encoding of an accelerator constraint: a sliver of the node's accelerator_type
        resources[f"accelerator_type:{accelerator}"] = 0.001
    if resources:
        out["resources_per_worker"] = (resources, said)
    strategy = getattr(sc, "placement_strategy", "PACK")
    if strategy != "PACK":
        raise ValueError(f"ElasticTrainer scaling_config.placement_strategy={strategy!r} is not supported: workers "
                         "are plain Ray actors placed as capacity comes (no placement group); drop it")
    for field, default in (("trainer_resources", None), ("label_selector", None), ("use_tpu", False),
                           ("topology", None)):
        value = getattr(sc, field, default)
        if value is not None and value is not False:
            raise ValueError(f"ElasticTrainer scaling_config.{field}={value!r} is not supported; drop it "
                             "(docs/ray_train.md lists what maps to what)")


def _run(rc: Any, out: dict) -> None:
    _location(rc, out)
    _run_options(rc, out)


def _location(rc: Any, out: dict) -> None:
    storage, name = rc.storage_path, rc.name
    _no_filesystem(rc)
    generated = name is None or bool(_GENERATED_NAME.match(str(name)))
    if storage is not None and not generated and _is_default_storage(storage):
        warnings.warn(f"ElasticTrainer run_config=RunConfig(name={name!r}) without storage_path: checkpoints go to "
                      f"{os.path.join(os.path.expanduser(str(storage)), name)} on the disk of the process that writes "
                      "them (rank 0, on any node), which a rerun on another node does not see; on more than one node "
                      "set RunConfig(storage_path=...) to shared storage (s3://..., gs://..., an NFS path)",
                      UserWarning, stacklevel=4)
    if storage is not None and not generated:
        storage = os.fspath(storage)
        if "://" not in storage:  # a local path: absolute on the driver, as Ray Train resolves it
            storage = os.path.abspath(os.path.expanduser(storage))
        uri = f"{storage.rstrip('/')}/{name}"
        out["checkpoint_uri"] = (uri, f"run_config=RunConfig(storage_path={rc.storage_path!r}, name={name!r})")
    elif storage is not None and not _is_default_storage(storage):
        raise ValueError(f"ElasticTrainer run_config=RunConfig(storage_path={storage!r}) needs a name too "
                         f"(got {name!r}{', which Ray generated' if name else ''}): checkpoints go to storage_path/name "
                         "and a rerun resumes from them only under the same name; set RunConfig(name='my-job')")


def _no_filesystem(rc: Any) -> None:
    if getattr(rc, "storage_filesystem", None) is not None:
        raise ValueError("ElasticTrainer run_config.storage_filesystem is not supported: checkpoints go through "
                         "fsspec; give the location as a URL in storage_path (e.g. 's3://bucket/path') and drop "
                         "storage_filesystem")


def _run_options(rc: Any, out: dict) -> None:
    if rc.failure_config is not None:
        _failure(rc.failure_config, out)
    checkpoint = rc.checkpoint_config
    if checkpoint is not None:
        if checkpoint.num_to_keep is not None:
            out["checkpoint_keep_last"] = (checkpoint.num_to_keep,
                                           f"run_config.checkpoint_config.num_to_keep={checkpoint.num_to_keep!r}")
        if checkpoint.checkpoint_score_attribute is not None:
            raise ValueError(f"ElasticTrainer run_config.checkpoint_config.checkpoint_score_attribute="
                             f"{checkpoint.checkpoint_score_attribute!r} is not supported: the newest checkpoints are "
                             "kept (num_to_keep of them); drop checkpoint_score_attribute")
    if getattr(rc, "callbacks", None):
        raise ValueError(f"ElasticTrainer run_config.callbacks={rc.callbacks!r} are not supported; pass "
                         "ElasticTrainer.run(fn, on_report=..., on_event=...) instead")
    worker_env = getattr(rc, "worker_runtime_env", None)
    if worker_env:
        out["runtime_env"] = (dict(worker_env), f"run_config.worker_runtime_env={worker_env!r}")
    logging = getattr(rc, "logging_config", None)
    if logging is not None and logging != type(logging)():
        warnings.warn(f"ElasticTrainer ignores run_config.logging_config={logging!r}: workers log through Ray's "
                      "worker logs (docs/troubleshooting.md)", UserWarning, stacklevel=4)


#: FailureConfig's fields beside max_failures: (Ray's default, why elastic_ring ignores a value other than it).
_FAILURE_IGNORED = {
    "controller_failure_limit": (-1, "the driver is not restarted: a failure of the driver process ends the run "
                                     "(run the same script again to resume from the newest checkpoint)"),
    "max_preemption_failures": (-1, "a preempted (drained) node's workers leave at a commit and the ring re-forms "
                                    "without them; that never counts as a failure, and there is no limit on it"),
    "relax_collectives_on_preemption": (False, "the ring re-forms without the workers of a preempted node: no "
                                               "collective waits for them"),
    "preemption_grace_s": (0.0, "the workers of a preempted node leave at their next commit; the others go on"),
}
#: Ray's default FailureConfig().max_failures (Ray Train: no retries).
_RAY_DEFAULT_MAX_FAILURES = 0


def _failure(failure: Any, out: dict) -> None:
    """``max_failures`` unless it is Ray's default 0, which RunConfig fills in when no FailureConfig is given and
    which cannot be told from an explicit ``FailureConfig(max_failures=0)`` (docs/ray_train.md); V1's ``fail_fast``
    is ``max_failures=0``; a warning names each other field set to a value other than Ray's default."""
    k = failure.max_failures
    fail_fast = getattr(failure, "fail_fast", False)
    if fail_fast is True or isinstance(fail_fast, str) and fail_fast.upper() == "RAISE":
        out["max_failures"] = (0, f"run_config.failure_config.fail_fast={fail_fast!r}")
    elif k != _RAY_DEFAULT_MAX_FAILURES:
        out["max_failures"] = (k, f"run_config.failure_config.max_failures={k!r}")
    for name, (default, why) in _FAILURE_IGNORED.items():
        value = getattr(failure, name, default)
        if value != default:
            warnings.warn(f"ElasticTrainer ignores run_config.failure_config.{name}={value!r}: {why}; drop it (only "
                          "max_failures is used, docs/ray_train.md)", UserWarning, stacklevel=5)


def default_storage_location(run_config: Any) -> str | None:
    """The location a ``RunConfig(name=...)`` without ``storage_path`` puts checkpoints at (``~/ray_results/name``,
    on the local disk of whichever process writes), else None."""
    if run_config is None or getattr(run_config, "storage_filesystem", None) is not None:
        return None
    storage, name = run_config.storage_path, run_config.name
    if storage is None or name is None or _GENERATED_NAME.match(str(name)) or not _is_default_storage(storage):
        return None
    return f"{os.path.abspath(os.path.expanduser(os.fspath(storage))).rstrip('/')}/{name}"


def _is_default_storage(storage: str) -> bool:
    try:
        from ray.train.constants import DEFAULT_STORAGE_PATH
    except ImportError:  # an older Ray without it
        return False
    return os.path.abspath(os.path.expanduser(str(storage))) == os.path.abspath(os.path.expanduser(DEFAULT_STORAGE_PATH))


#: FailureConfig(max_failures=K) counts over the whole run in Ray Train: the drop-in's window (a century).
WHOLE_RUN_S = 100 * 365 * 86400.0


def translate_dropin(scaling_config: Any = None, run_config: Any = None) -> tuple[dict[str, Any], int]:
    """The ``ElasticTrainer`` options of the drop-in ``TorchTrainer`` (``ray_integration.train.torch``), and Ray's
    ``FailureConfig(max_failures)``. Where Ray Train's own semantics differ from :func:`translate`'s:

    * ``ScalingConfig(num_workers=N)``: the first ring waits for N workers; after a loss the survivors go on at once
      (no restart, no wait: ``min_workers=1``) and a replacement joins at the next report with a checkpoint.
      ``num_workers=(lo, hi)`` as in :func:`translate`. Ray's default ``ScalingConfig()`` is one worker.
    * ``RunConfig``: the location is always ``storage_path/name``, as Ray Train's run directory, Ray's defaults
      included (``~/ray_results``, the generated ``ray_train_run-<date>``, a new one per run, as in Ray Train).
    * ``FailureConfig(max_failures=K)``, K other than Ray's default 0: K failures over the whole run (lost workers
      and exceptions of the training function alike, one per failed ring), -1 without limit. With 0 (Ray's default,
      which cannot be told from no FailureConfig), an exception of the function ends the run as in Ray Train, and a
      lost worker is recovered within ElasticTrainer's default budget (docs/ray_train.md)."""
    from ray.train import RunConfig, ScalingConfig

    _check_type(scaling_config, "ScalingConfig", "scaling_config")
    _check_type(run_config, "RunConfig", "run_config")
    scaling_config = ScalingConfig() if scaling_config is None else scaling_config
    run_config = RunConfig() if run_config is None else run_config
    out: dict[str, tuple[Any, str]] = {}
    _scaling(scaling_config, out)
    n = scaling_config.num_workers
    if not isinstance(n, tuple) and n > 1:
        out["min_workers"], out["start_workers"] = (1, f"scaling_config.num_workers={n!r}"), out["max_workers"]
    _no_filesystem(run_config)
    storage = os.fspath(run_config.storage_path)
    if "://" not in storage:  # a local path: absolute on the driver, as Ray Train resolves it
        storage = os.path.abspath(os.path.expanduser(storage))
    out["checkpoint_uri"] = (f"{storage.rstrip('/')}/{run_config.name}", "run_config (storage_path/name)")
    # Ray Train's state is the checkpoints the script reports: at a preemption notice the leavers hand the ring over
    # at the next report, or go, and the job resumes from the newest reported checkpoint (no just-in-time write).
    out["write_on_notice"] = (False, "TorchTrainer (a Ray Train script's state is its reported checkpoints)")
    _run_options(run_config, out)
    failure = run_config.failure_config
    k = failure.max_failures if failure is not None else _RAY_DEFAULT_MAX_FAILURES
    if k != _RAY_DEFAULT_MAX_FAILURES:
        out["failure_window_s"] = (WHOLE_RUN_S, f"run_config.failure_config.max_failures={k!r} (the whole run)")
    return {key: value for key, (value, _) in out.items()}, k


def merge(options: dict[str, Any], translated: dict[str, tuple[Any, str]]) -> dict[str, Any]:
    """``options`` plus the translated ones; ValueError naming both when an option is given both ways with two
    different values."""
    for key, (value, said) in translated.items():
        if key in options and options[key] != value:
            raise ValueError(f"ElasticTrainer got {key}={options[key]!r} and {said}; give one")
    return {**options, **{key: value for key, (value, _) in translated.items()}}
