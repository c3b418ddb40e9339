"""Instruments an unmodified Ray Train training function run by the drop-in ``TorchTrainer`` (importable by the
Ray workers): a SIGKILL of one rank right after one of its optimizer steps, the time of each entry's first
optimizer step, and every rank's final parameters.

``Instrumented`` replaces a script's ``TorchTrainer`` name from outside (``monkeypatch.setattr(script,
"TorchTrainer", Instrumented.configured(...))``): the script's text and its training function run as they are;
when the function returns, every rank writes its ring, a digest of its model's final parameters (the model the
script's ``prepare_model`` returned last) and the metrics it reported last into ``marks_dir/final-<rank>.json``.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import pathlib
import signal
import time

from torch.optim.optimizer import register_optimizer_step_post_hook

import elastic_ring as er
import ray_integration.train
from ray_integration.train._dropin import takes_config
from ray_integration.train.torch import TorchTrainer


def probed(fn, probe: dict, config: dict):
    """Run ``fn(config)`` on this worker with the probe's hooks (module docstring)."""
    entered = time.time()
    steps = [0]
    kill_file, marks = probe["kill_file"], pathlib.Path(probe["marks_dir"])

    def after_step(optimizer, args, kwargs) -> None:
        steps[0] += 1
        if steps[0] == 1:  # this entry's first step: when, in which ring
            (marks / f"{os.getpid()}-{entered}.json").write_text(json.dumps(
                {"pid": os.getpid(), "entered": entered, "first_step": time.time(), "rank": er.rank(),
                 "world": er.size(), "round": er.round_id()}))
        if (er.round_id() == 1 and er.rank() == probe["victim_rank"] and steps[0] == probe["kill_step"]
                and not os.path.exists(kill_file)):
            pathlib.Path(kill_file).write_text(repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
        if er.size() < probe.get("slow_below_size", 0):  # hold the run open until the replacement joins
            time.sleep(probe.get("slow_step_s", 0.1))

    models, last = [], {}
    prepare, report = ray_integration.train.torch.prepare_model, ray_integration.train.report

    def prepare_model(model, *args, **kwargs):  # the script's model, as prepare_model returns it
        models.append(prepare(model, *args, **kwargs))
        return models[-1]

    def recording_report(metrics, *args, **kwargs):
        last.clear()
        last.update(metrics)
        return report(metrics, *args, **kwargs)

    hook = register_optimizer_step_post_hook(after_step)
    ray_integration.train.torch.prepare_model, ray_integration.train.report = prepare_model, recording_report
    try:
        value = fn(config) if takes_config(fn) else fn()
    finally:
        hook.remove()
        ray_integration.train.torch.prepare_model, ray_integration.train.report = prepare, report
    digest = hashlib.sha256()
    for p in models[-1].parameters() if models else ():
        digest.update(p.detach().cpu().numpy().tobytes())
    final = {"rank": er.rank(), "world": er.size(), "round": er.round_id(), "params": digest.hexdigest(),
             "metrics": last, "wrapped": type(models[-1]).__name__ if models else None}
    (marks / f"final-{er.rank()}.json").write_text(json.dumps(final))  # the ranks of the ring that returned
    return value


class Instrumented(TorchTrainer):
    """``TorchTrainer`` whose training function runs under :func:`probed` with ``probe``."""

    probe: dict = {}
    config_added: dict = {}

    def __init__(self, train_loop_per_worker, *, train_loop_config=None, run_config=None, **kwargs) -> None:
        config = {**(train_loop_config or {}), **self.config_added}
        if run_config is None and self.probe.get("storage_path"):  # not Ray's default ~/ray_results in a test
            run_config = ray_integration.train.RunConfig(storage_path=self.probe["storage_path"])
        kwargs["run_config"] = run_config
        super().__init__(functools.partial(probed, train_loop_per_worker, self.probe), train_loop_config=config,
                         **kwargs)

    @classmethod
    def configured(cls, config_added: dict | None = None, **probe) -> type:
        """A TorchTrainer class probing with ``probe``, adding ``config_added`` to the script's config."""
        return type("Instrumented", (cls,), {"probe": probe, "config_added": dict(config_added or {})})
