"""Run an unmodified, module-level training script on every worker, as ``horovodrun`` and ``torchrun`` do.

    python -m ray_integration.launch [--min-workers N] [--max-workers M] [--use-gpu] [--address ADDR]
                                     [--checkpoint-uri URI] [--max-failures K] [--worker-errors replace|fail]
                                     script.py [script args ...]

Every worker runs the script as ``__main__`` with ``sys.argv = [script.py, args...]``
inside :meth:`ElasticTrainer.run`, so ``hvd.init()`` / ``er.size()`` join the
ring and the script's elastic loop (``@hvd.elastic.run`` / ``@er.elastic.run``)
recovers from lost workers and takes in joiners. The driver reads the script
once and ships its text to the workers (with its directory on ``sys.path``
where that directory exists on the worker's node), so it needs no shared file
system for the script itself. Each worker's environment holds what ``horovodrun`` sets (``HOROVOD_RANK``,
``HOROVOD_SIZE``, ``HOROVOD_HOSTNAME``, ...: :mod:`ray_integration.wire.launch_env`), from the first ring it
joins, before the script's ``hvd.init()`` returns. As in Horovod's elastic mode (``--worker-errors replace``,
the default), a worker whose script raises is a failed worker: it is replaced and the others go on, and the run
fails, naming the error and its rank, when every worker of a ring failed (``--worker-errors fail``: the first
error ends the run, as ``ElasticTrainer``'s default). Ray: ``--address`` connects to a running cluster
(``auto`` for the local one); without it a private local instance is started
and stopped. Exit codes: 0 when rank 0 finished the script, 75 when a SIGTERM
stopped the run (unfinished: run it again to resume from the checkpoint), 1 when
the run failed (the error is printed).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

EXIT_STOPPED = 75


def run_script(config: dict[str, Any]) -> Any:
    """On a worker: run the script's text as ``__main__`` with its arguments; return its ``result`` global, if any."""
    source, path, argv = config["source"], config["path"], list(config["argv"])
    directory = os.path.dirname(path)
    saved_argv, saved_path = sys.argv, list(sys.path)
    sys.argv = [path, *argv]
    if directory and os.path.isdir(directory) and directory not in sys.path:
        sys.path.insert(0, directory)
    namespace: dict[str, Any] = {"__name__": "__main__", "__file__": path, "__builtins__": __builtins__}
    try:
        exec(compile(source, path, "exec"), namespace)  # noqa: S102 - the user's own script, as runpy would
    except SystemExit as exc:  # the script's sys.exit(0) ends it normally; anything else is its failure
        if exc.code not in (None, 0):
            raise RuntimeError(f"{os.path.basename(path)} exited with sys.exit({exc.code!r})") from None
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path
    return namespace.get("result")


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m ray_integration.launch", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-np", "--num-proc", type=int, default=None, help="a fixed number of workers (min = max)")
    parser.add_argument("--min-workers", "--min-np", type=int, default=None, help="fewest workers to train with")
    parser.add_argument("--max-workers", "--max-np", type=int, default=None, help="most workers to train with")
    parser.add_argument("--use-gpu", action="store_true", help="one GPU per worker, NCCL")
    parser.add_argument("--cpus-per-worker", type=float, default=1.0)
    parser.add_argument("--address", default=None, help="a running Ray cluster ('auto': the local one)")
    parser.add_argument("--num-cpus", type=int, default=None, help="CPUs of the private local Ray instance")
    parser.add_argument("--checkpoint-uri", default=None, help="durable checkpoints (resume after a lost cluster)")
    parser.add_argument("--max-failures", type=int, default=10)
    parser.add_argument("--worker-errors", choices=("replace", "fail"), default="replace",
                        help="a worker whose script raises: replace it and go on, failing when every worker of a ring "
                             "failed (Horovod's elastic mode, the default), or end the run with its error")
    parser.add_argument("script", help="the training script")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="the script's own arguments")
    args = parser.parse_args(argv)
    if args.num_proc is not None and (args.min_workers is not None or args.max_workers is not None):
        parser.error("give -np/--num-proc, or --min-workers/--max-workers, not both")
    if args.num_proc is not None:
        args.min_workers = args.max_workers = args.num_proc
    args.max_workers = args.max_workers or args.min_workers or 1
    args.min_workers = args.min_workers or 1
    if not os.path.isfile(args.script):
        parser.error(f"script {args.script!r} is not a file")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    import ray

    from .trainer import ElasticTrainer

    path = os.path.abspath(args.script)
    with open(path, encoding="utf-8") as f:
        source = f.read()
    started = not ray.is_initialized()
    if started:
        ray.init(address=args.address or "local", include_dashboard=False,
                 **({"num_cpus": args.num_cpus} if args.num_cpus and not args.address else {}))
    try:
        trainer = ElasticTrainer(min_workers=args.min_workers, max_workers=args.max_workers, use_gpu=args.use_gpu,
                                 cpus_per_worker=args.cpus_per_worker, checkpoint_uri=args.checkpoint_uri,
                                 max_failures=args.max_failures, worker_errors=args.worker_errors)
        try:
            result = trainer.run(run_script, {"source": source, "path": path, "argv": args.args})
        except Exception as exc:  # noqa: BLE001 - a launcher reports the failure and returns its exit code
            print(f"launch: the run failed: {type(exc).__name__}: {exc}", file=sys.stderr)
            return 1
        for lost in (e for e in result.events if e.kind == "worker_lost"):
            print(f"launch: lost worker {lost.detail.get('worker')} in round {lost.round_id}: "
                  f"{lost.detail.get('cause')}", file=sys.stderr)
        kinds = [e.kind for e in result.events]
        print(f"launch: {'finished' if result.completed else 'stopped'} on {args.max_workers} worker slots: "
              f"{kinds.count('worker_lost')} workers lost, {kinds.count('worker_joined')} joined, "
              f"{kinds.count('recovered')} recoveries", file=sys.stderr)
        if not result.completed:
            print(f"launch: stopped ({result.stop_reason}) before the script finished; the last commit is "
                  f"saved{' as ' + str(result.checkpoint_uri) if result.checkpoint_uri else ''}: run it again to resume",
                  file=sys.stderr)
            return EXIT_STOPPED
        return 0
    finally:
        if started:
            ray.shutdown()


if __name__ == "__main__":
    sys.exit(main())
