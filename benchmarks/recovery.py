"""Recovery and join: a SIGKILLed worker, ours vs Ray Train's TorchTrainer, on one host and on many.

For each of ``--runs`` runs, 3 gloo CPU workers train a small MLP with the loop people write: after
every ``opt.step()`` it allreduces its loss for the log (rank 0 ``er.report``s it), and it commits only
at epoch ends (``--commit-every N``: also every N steps). Rank 2 SIGKILLs itself at step 20 right after
``opt.step()`` and before that loss allreduce (writing the time first); a replacement worker then joins
the 2 survivors, mid-epoch (where in the epoch is printed). Per run and as medians / worst cases:

  recovery      seconds from the kill to the survivors' first completed step in the new ring
  redone        steps applied before the kill that the new ring trained again (expected 0, at most 1;
                Ray Train checkpoints every step and restarts its workers from the last checkpoint)
  join latency  in the joiner's own process (one clock, time.monotonic): from its training function
                starting (actor ready) to its first completed step; also in steps (/ the median step)
    setup       of which: fn start -> the elastic loop starts (model, optimizer, state built; in a fresh
                process torch.optim's first use imports torch._dynamo: about 1 s of it)
    wait+form   of which: -> the last reset callback (asking the driver for a ring, waiting, forming it)
    sync        of which: last reset callback -> first step starts (the state transfer, state.sync())
    first step  of which: the joiner's first step itself (it includes the survivors' catching up)
  from ask      join latency - setup: from the loop asking for its first ring, in steps
  beyond sync   join latency - setup - sync, in steps (the issue's goal: <= 2 steps)
  join pause    seconds the survivors pause at the join (the gap between the last step of the old ring
                and the first of the new one, minus one median step; goal: <= the sync)
  waited_s      the driver's worker_joined event: the joiner asking for its first ring -> the driver
                forming the ring with it (driver clock)

for ElasticTrainer on one Ray node ("one host") and on a ray.cluster_utils.Cluster with one worker
slot per node ("many hosts", all on this machine); and, on one node, one Ray Train script (a checkpoint
from rank 0 every step, rank 2 SIGKILLed at step 20, FailureConfig(max_failures=1)) run twice: by the
drop-in ``ray_integration.train`` (only the imported module differs: the survivors re-enter the function
in their processes from the checkpoint in memory) and by Ray Train's TorchTrainer (v2), the reference
(restarts every worker from the persisted checkpoint; needs ray.train, checked before anything runs;
--skip-ray-train skips it). Their rows: recovery (kill -> the first step logged after the re-entry /
restart), steps redone, and of the recovery the function's own set-up (entered -> that first step).
Every run's numbers are printed as measured, and each part's summary as it ends; if a later part
fails, what was measured before it is printed with the failure (exit status 1).

    python -m benchmarks.recovery [--runs 5] [--skip-ray-train] [--skip-many-hosts] [--skip-ours] [--commit-every N]

(--skip-ray-train also skips the drop-in: it runs Ray's own ScalingConfig / RunConfig / Result from ray.train.)
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import pathlib
import signal
import statistics
import tempfile
import time

import ray
import torch

import elastic_ring as er
from benchmarks._needs import INSTALL, Results, require
from ray_integration import ElasticTrainer
from state import ElasticSampler, TorchState

ROOT = str(pathlib.Path(__file__).resolve().parents[1])
KILL_STEP, VICTIM_RANK, SAMPLES, BATCH, EPOCHS = 20, 2, 24576, 16, 2


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1))


def _data():
    g = torch.Generator().manual_seed(1)
    return torch.randn(SAMPLES, 64, generator=g), torch.randn(SAMPLES, 1, generator=g)


def ours_train(config: dict):
    started = time.monotonic()  # this process's actor is ready and its training function starts
    torch.set_num_threads(1)
    xs, ys = _data()
    model = _model()
    opt = er.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01), model.named_parameters())
    sampler = ElasticSampler(SAMPLES, batch_size=BATCH, seed=0)
    state = TorchState(model=model, optimizer=opt, sampler=sampler, epoch=0)
    marks: dict = {"started": started, "reset": None, "step_start": None, "written": False}
    state.register_reset_callbacks([lambda: marks.update(reset=time.monotonic(), step_start=None)])

    @er.elastic.run
    def loop(state):
        while state.epoch < config["epochs"]:
            for batch in state.sampler:
                if marks["step_start"] is None:
                    marks["step_start"] = time.monotonic()
                idx = torch.tensor(batch, dtype=torch.long)
                opt.zero_grad()
                loss = torch.nn.functional.mse_loss(model(xs[idx]), ys[idx])
                loss.backward()
                opt.step()
                if er.round_id() == 1 and er.rank() == VICTIM_RANK and state.sampler.step == KILL_STEP:
                    pathlib.Path(config["kill_file"]).write_text(f"{time.time()!r} {state.sampler.step}")
                    os.kill(os.getpid(), signal.SIGKILL)  # after the apply, before the loop's own collective
                logged = er.allreduce(loss.detach(), name="loss for the log")
                state.sampler.record_batch()
                if er.rank() == 0:
                    er.report(loss=float(logged), step=state.sampler.step, position=state.sampler.processed,
                              epoch=state.epoch)
                if not marks["written"]:  # this process's first completed step
                    marks.update(written=True, done=time.monotonic(), round=er.round_id())
                    path = os.path.join(config["tmp"], f"first-{os.getpid()}.json")
                    pathlib.Path(path).write_text(json.dumps({k: v for k, v in marks.items() if k != "written"}))
                if config["commit_every"] and state.sampler.step % config["commit_every"] == 0:
                    state.commit()
                time.sleep(config["step_delay_s"])
            state.epoch += 1
            state.sampler.set_epoch(state.epoch)
            state.commit()
        return state.sampler.step

    marks["loop"] = time.monotonic()  # setup done: the elastic loop asks for its first ring now
    return loop(state)


def ray_train_loop(config: dict):
    """A Ray Train script's loop (a checkpoint every step from rank 0). ``config["api"]`` names the module it
    imports as ``ray.train``: Ray Train's own, or ``ray_integration.train`` (the drop-in: only the import differs)."""
    import importlib

    train = importlib.import_module(config["api"])
    train_torch = importlib.import_module(config["api"] + ".torch")
    entered = time.time()
    torch.set_num_threads(1)
    xs, ys = _data()
    model = train_torch.prepare_model(_model())
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    ctx = train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    start = 0
    checkpoint = train.get_checkpoint()
    if checkpoint:
        with checkpoint.as_directory() as d:
            saved = torch.load(os.path.join(d, "state.pt"))
        model.module.load_state_dict(saved["model"])
        opt.load_state_dict(saved["opt"])
        start = saved["step"]
    log = pathlib.Path(config["log_file"])
    for step in range(start, config["steps"]):
        if rank == VICTIM_RANK and step == KILL_STEP and not pathlib.Path(config["kill_file"]).exists():
            pathlib.Path(config["kill_file"]).write_text(repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
        lo = (step * world + rank) * BATCH % SAMPLES
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(xs[lo:lo + BATCH]), ys[lo:lo + BATCH]).backward()
        opt.step()
        with tempfile.TemporaryDirectory() as d:
            if rank == 0:
                torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "step": step + 1},
                           os.path.join(d, "state.pt"))
            train.report({"step": step + 1}, checkpoint=train.Checkpoint.from_directory(d) if rank == 0 else None)
        if rank == 0:
            with log.open("a") as f:
                f.write(f"{time.time()} {step + 1} {checkpoint is not None} {entered}\n")
        time.sleep(config["step_delay_s"])


def measure_ours(step_delay_s: float, commit_every: int, trainer_kwargs: dict) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        kill_file = os.path.join(tmp, "killed")
        result = ElasticTrainer(min_workers=2, max_workers=3, progress=False, **trainer_kwargs).run(
            ours_train, config={"epochs": EPOCHS, "kill_file": kill_file, "step_delay_s": step_delay_s,
                                "commit_every": commit_every, "tmp": tmp})
        killed_text, killed_step = pathlib.Path(kill_file).read_text().split()
        firsts = [json.loads(pathlib.Path(p).read_text()) for p in glob.glob(os.path.join(tmp, "first-*.json"))]
    by_round: dict[int, list[dict]] = {}
    for m in result.metrics_history:
        if "position" in m:
            by_round.setdefault(m["round"], []).append(m)
    gaps = [b["time"] - a["time"] for ms in by_round.values() for a, b in zip(ms, ms[1:])]
    step_s = statistics.median(gaps)
    out = {"recovery": by_round[2][0]["time"] - float(killed_text),
           "redone": int(killed_step) - (by_round[2][0]["step"] - 1), "step_s": step_s}
    joined = [e for e in result.events if e.kind == "worker_joined" and (e.round_id or 0) > 2]
    joiners = [f for f in firsts if f["round"] > 1]
    if joined and joined[0].round_id in by_round and joiners:
        r = joined[0].round_id
        first, last_before = by_round[r][0], max(m["time"] for k, ms in by_round.items() if k < r for m in ms)
        j = joiners[0]
        out.update(pause=first["time"] - last_before - step_s, waited=joined[0].detail.get("waited_s"),
                   latency=j["done"] - j["started"], setup=j["loop"] - j["started"], form=j["reset"] - j["loop"],
                   sync=j["step_start"] - j["reset"], first_step=j["done"] - j["step_start"],
                   where=(first["epoch"], first["position"]),
                   mid_epoch=first["position"] > 3 * BATCH)  # not the first step of an epoch (a commit)
        out["ask_steps"] = (out["latency"] - out["setup"]) / step_s
        out["beyond_sync_steps"] = out["ask_steps"] - out["sync"] / step_s
    return out


def measure_ray_train(step_delay_s: float, api: str = "ray.train") -> tuple[float, int, float]:
    """Ray Train's TorchTrainer (``api="ray.train"``) or the drop-in (``"ray_integration.train"``) on the same
    script: (kill -> the first step logged after the restart or re-entry, steps redone, that entry's own set-up:
    the function entered -> its first step logged)."""
    import importlib

    train = importlib.import_module(api)
    TorchTrainer = importlib.import_module(api + ".torch").TorchTrainer
    with tempfile.TemporaryDirectory() as tmp:
        config = {"steps": KILL_STEP + 15, "kill_file": os.path.join(tmp, "killed"), "api": api,
                  "log_file": os.path.join(tmp, "log"), "step_delay_s": step_delay_s}
        TorchTrainer(ray_train_loop, train_loop_config=config,
                     scaling_config=train.ScalingConfig(num_workers=3, use_gpu=False),
                     run_config=train.RunConfig(storage_path=tmp, name="bench",
                                                failure_config=train.FailureConfig(max_failures=1)),
                     ).fit()
        killed_at = float(pathlib.Path(config["kill_file"]).read_text())
        lines = [line.split() for line in pathlib.Path(config["log_file"]).read_text().splitlines()]
    # rank 0 may log its last step of the first entry just after the kill: the entry tells the two apart
    before = [int(step) for t, step, resumed, _ in lines if resumed == "False"]
    after = [(float(t), int(step), float(entered)) for t, step, resumed, entered in lines if resumed == "True"]
    first = min(after)
    return first[0] - killed_at, max(before) - (first[1] - 1), first[0] - first[2]


def describe(name: str, run: dict) -> str:
    line = f"  {name}: recovery {run['recovery']:.3f} s, redone {run['redone']}, step {run['step_s'] * 1e3:.1f} ms"
    if "latency" not in run:
        return line + "; no join measured"
    epoch, position = run["where"]
    waited = "-" if run["waited"] is None else f"{run['waited']:.3f}"
    return (line + f"\n    join latency {run['latency']:.3f} s = {run['latency'] / run['step_s']:.1f} steps "
            f"(setup {run['setup']:.3f}, wait+form {run['form']:.3f}, sync {run['sync']:.3f}, first step {run['first_step']:.3f}; "
            f"from ask {run['ask_steps']:.1f} steps, beyond sync {run['beyond_sync_steps']:.1f} steps), pause {run['pause']:.3f} s, driver waited_s "
            f"{waited}; joined at epoch {epoch} sample {position}/{SAMPLES} "
            f"({'mid-epoch' if run['mid_epoch'] else 'AT AN EPOCH START'})")


def summary(name: str, values: list, unit: str = "s", fmt: str = "7.3f") -> str:
    values = [v for v in values if v is not None]
    if not values:
        return f"{name:<46} (no value)"
    return (f"{name:<46} median {statistics.median(values):{fmt}} {unit:<5} worst {max(values):{fmt}} {unit:<5} "
            f"(n={len(values)})")


def ours_lines(label: str, runs: list[dict]) -> list[str]:
    get = lambda key: [r.get(key) for r in runs]  # noqa: E731
    return [summary(f"ours, {label}: recovery", get("recovery")),
            summary(f"ours, {label}: steps redone", get("redone"), "steps", "7.1f"),
            summary(f"ours, {label}: step time", [r["step_s"] * 1e3 for r in runs], "ms"),
            summary(f"ours, {label}: join latency", get("latency")),
            summary(f"ours, {label}: join latency in steps", [r["latency"] / r["step_s"] for r in runs if "latency" in r],
                    "steps", "7.1f"),
            summary(f"ours, {label}:   of which setup", get("setup")),
            summary(f"ours, {label}:   of which wait+form", get("form")),
            summary(f"ours, {label}:   of which sync (transfer)", get("sync")),
            summary(f"ours, {label}:   of which first step", get("first_step")),
            summary(f"ours, {label}: join latency from ask", get("ask_steps"), "steps", "7.1f"),
            summary(f"ours, {label}: from ask - sync (goal <= 2)", get("beyond_sync_steps"), "steps", "7.1f"),
            summary(f"ours, {label}: survivors' join pause", get("pause")),
            summary(f"ours, {label}: driver waited_s", get("waited")),
            f"{'ours, ' + label + ': joins mid-epoch':<46} {sum(bool(r.get('mid_epoch')) for r in runs)}/{len(runs)}"]


def run_ours(label: str, args, trainer_kwargs: dict) -> list[dict]:
    runs = []
    for i in range(args.runs):
        runs.append(measure_ours(args.step_delay_s, args.commit_every, trainer_kwargs))
        print(describe(f"{label} run {i + 1}", runs[-1]), flush=True)
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--step-delay-s", type=float, default=0.01)
    parser.add_argument("--skip-ray-train", action="store_true")
    parser.add_argument("--commit-every", type=int, default=0, help="ours: also commit every N steps (0: only at epoch ends)")
    parser.add_argument("--skip-many-hosts", action="store_true")
    parser.add_argument("--skip-ours", action="store_true", help="only the Ray Train script: drop-in and Ray Train")
    args = parser.parse_args()
    if not args.skip_ray_train:
        require("ray.train.torch", benchmark="benchmarks.recovery", why="the Ray Train comparison",
                install=INSTALL["ray.train"], skip="--skip-ray-train")
    env = {"env_vars": {"PYTHONPATH": ROOT}}
    results = Results("benchmarks.recovery")  # printed as measured: a later failure keeps what was measured before it
    print(f"3 gloo CPU workers, rank {VICTIM_RANK} SIGKILLed at step {KILL_STEP} after opt.step(), before the "
          f"loss allreduce; {args.runs} runs each; {EPOCHS} epochs of {SAMPLES} samples, batch {BATCH}; ours commit "
          f"{'every %d steps and at epoch ends' % args.commit_every if args.commit_every else 'only at epoch ends'}",
          flush=True)

    ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False, runtime_env=env)
    recovery: dict[str, float] = {}
    try:
        if not args.skip_ours:
            with results.part("ours, one host"):
                results.extend(ours_lines("one host", run_ours("one host", args, {})))
        for api, label in (() if args.skip_ray_train else (("ray_integration.train", "drop-in ray_integration.train"),
                                                             ("ray.train", "Ray Train TorchTrainer"))):
            with results.part(label):
                runs = []
                for i in range(args.runs):
                    runs.append(measure_ray_train(args.step_delay_s, api))
                    print(f"  {label} run {i + 1}: recovery {runs[-1][0]:.3f} s, redone {runs[-1][1]}, of which the "
                          f"re-entered function's own set-up {runs[-1][2]:.3f} s", flush=True)
                results.add(summary(f"{label}: recovery", [r for r, _, _ in runs]))
                results.add(summary(f"{label}: steps redone", [d for _, d, _ in runs], "steps", "7.1f"))
                results.add(summary(f"{label}:   of which its set-up", [s for _, _, s in runs]))
                recovery[label] = statistics.median(r for r, _, _ in runs)
        if len(recovery) == 2:
            ratio = recovery["Ray Train TorchTrainer"] / recovery["drop-in ray_integration.train"]
            results.add(f"{'Ray Train / drop-in, median recovery':<46} {ratio:7.1f} x")
    finally:
        ray.shutdown()
    if not args.skip_many_hosts and not args.skip_ours:
        from ray.cluster_utils import Cluster

        with results.part("ours, many hosts"):
            cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
            try:
                for _ in range(4):
                    cluster.add_node(num_cpus=1, resources={"slot": 1})
                cluster.wait_for_nodes()
                ray.init(address=cluster.address, log_to_driver=False, runtime_env=env)
                results.extend(ours_lines("many hosts", run_ours("many hosts", args, {"resources_per_worker": {"slot": 1}})))
            finally:
                ray.shutdown()
                cluster.shutdown()
    print("\n" + "\n".join(results.lines))


if __name__ == "__main__":
    main()
