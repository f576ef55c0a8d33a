"""The `mpilb` command: prepare, data, train, report, bench, doctor, box, ...

Errors a user can fix (bad options, config, data) are one line from rank 0 and exit code 2;
docs/cli.md lists the other exit codes.
"""

from __future__ import annotations

import os
import sys

from mpilb.mpi.launcher import announced_rank, env_world_size, one_blas_thread_per_rank

# Several ranks share a node's cores: one BLAS thread per rank unless the user says otherwise
# (a joiner is a rank of the job it joins, whatever its own launch's size: without this, its
# BLAS threads took the cores of the job's ranks). This must happen before numpy is imported
# (nothing above imports it).
one_blas_thread_per_rank(joins=len(sys.argv) > 1 and sys.argv[1] == "join")

# A preemption signal (SIGTERM/SIGUSR1) while a training rank is still importing must not
# kill it (exit 15, no checkpoint): note it now, `mpilb train` acts on it once running.
if len(sys.argv) > 1 and sys.argv[1] == "train":
    import warnings

    from mpilb.run.signals import catch_early

    catch_early()
    # mpi4py's own warning about another MPI's launcher variables: `train` refuses that
    # job with one line of its own that says what to do (launcher.mismatch)
    warnings.filterwarnings("ignore", message="suspicious MPI execution environment")

import argparse  # noqa: E402
import json  # noqa: E402

from mpilb import __version__  # noqa: E402
from mpilb.clusterbox import main as box_main  # noqa: E402
from mpilb.config.build import OPTIONS, closest, load_toml  # noqa: E402
from mpilb.errors import MpilbError, UsageError  # noqa: E402
from mpilb.simulate.main import add_arguments as simulate_arguments, run_simulate  # noqa: E402


class Parser(argparse.ArgumentParser):
    """argparse that raises UsageError instead of printing from every rank, and whose
    --help shows every option's default."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", argparse.ArgumentDefaultsHelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message):
        if message.startswith("unrecognized arguments:"):
            flags = [o.flag for o in OPTIONS]
            word = next((w for w in message.split(":", 1)[1].split() if w.startswith("--")), None)
            if word:
                message += closest(word.split("=")[0], flags)
        prog = self.prog.split(" ", 1)[1] + ": " if " " in self.prog else ""
        raise UsageError(f"{prog}{message}")


def _add_train_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("config_file", nargs="?", metavar="CONFIG.toml",
                   help="TOML file with the same keys as the options")
    for opt in OPTIONS:
        # defaults are not argparse's (a config file may set the value): shown in the help
        shown = "none" if opt.default is None or opt.default == [] else opt.default
        if opt.type is bool:
            shown = opt.flag if opt.default else "--no-" + opt.flag[2:]
        shown = opt.default_text or shown
        text = opt.help if "default" in opt.help else f"{opt.help} (default: {shown})"
        kw = dict(dest=opt.name, default=argparse.SUPPRESS, help=text.replace("%", "%%"))
        if opt.type is bool:
            p.add_argument(opt.flag, action=argparse.BooleanOptionalAction, **kw)
            continue
        if opt.type is list:
            p.add_argument(opt.flag, action="append", metavar=opt.metavar, **kw)
            continue
        if opt.choices:
            kw["metavar"] = "{" + ",".join(str(c) for c in opt.choices) + "}"
        elif opt.metavar:
            kw["metavar"] = opt.metavar
        p.add_argument(opt.flag, type=str, **kw)


def build_parser() -> Parser:
    parser = Parser(prog="mpilb", description="Load-balanced asynchronous data-parallel training for MPI clusters.")
    parser.add_argument("--version", action="version", version=f"mpilb {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    sub.required = True

    prep = sub.add_parser("prepare", help="make a dataset of HDF5 shards")
    psub = prep.add_subparsers(dest="source", metavar="SOURCE", parser_class=Parser)
    psub.required = True

    def common(p):
        p.add_argument("--shards", type=int, default=8, help="number of training shard files")
        p.add_argument("--test-fraction", type=float, default=0.2, help="share of samples kept for test.h5")
        p.add_argument("--seed", type=int, default=0, help="seed of the shuffle (and of generated data)")

    def scaling(p):
        p.add_argument("--standardize", nargs="?", const="all", choices=("all", "features"),
                       help="scale features (all: and regression targets) to mean 0, std 1 "
                       "with the training shards' statistics, kept in the manifest")

    d = psub.add_parser("digits", help="scikit-learn's bundled 8x8 digits")
    d.add_argument("out")
    common(d)
    s = psub.add_parser("synthetic", help="Gaussian features labelled by a random teacher MLP")
    s.add_argument("out")
    s.add_argument("--samples", type=int, required=True)
    s.add_argument("--features", type=int, required=True)
    s.add_argument("--classes", type=int, required=True)
    s.add_argument("--noise", type=float, default=0.0, help="share of labels replaced at random")
    common(s)
    n = psub.add_parser("npz", help="arrays from a NumPy .npz file")
    n.add_argument("file")
    n.add_argument("out")
    n.add_argument("--x-key", default="x")
    n.add_argument("--y-key", default="y")
    n.add_argument("--task", default="auto", choices=("auto", "classify", "regress"),
                   help="integer y: classes, float y: regression targets (auto), or force one")
    common(n)
    scaling(n)
    h = psub.add_parser("hdf5", help="datasets from existing HDF5 files (concatenated)")
    h.add_argument("inputs", nargs="+", metavar="FILE... OUT")
    h.add_argument("--x-key", required=True)
    h.add_argument("--y-key", required=True)
    h.add_argument("--task", default="auto", choices=("auto", "classify", "regress"))
    common(h)
    scaling(h)
    c = psub.add_parser("csv", help="a CSV file with a header line")
    c.add_argument("file")
    c.add_argument("out")
    c.add_argument("--target", required=True, metavar="COL[,COL...]")
    c.add_argument("--features", metavar="COL,...", help="default: every non-target column")
    c.add_argument("--delimiter", default=",")
    c.add_argument("--task", default="auto", choices=("auto", "classify", "regress"),
                   help="auto: one all-integer target column gives classes, else regression")
    common(c)
    scaling(c)

    data = sub.add_parser("data", help="check or describe a dataset")
    dsub = data.add_subparsers(dest="action", metavar="ACTION", parser_class=Parser)
    dsub.required = True
    dsub.add_parser("verify", help="check manifest, checksums, shapes, dtypes, labels").add_argument("dir")
    dsub.add_parser("info", help="describe a dataset").add_argument("dir")

    train = sub.add_parser("train", help="train (under mpiexec: rank 0 serves, the others work)")
    _add_train_options(train)

    rep = sub.add_parser("report", help="summarise run logs")
    rep.add_argument("logs", nargs="+", metavar="RUN.h5")
    rep.add_argument("--json", action="store_true", help="print the summary object")
    rep.add_argument("--plots", metavar="DIR", help="write PNG figures into DIR")
    rep.add_argument("--compare", action="store_true", help="put several runs side by side")
    rep.add_argument("--csv", metavar="DIR", help="write one CSV file per log group into DIR")

    lv = sub.add_parser("leave", help="let one worker of a running job go (the run goes on)")
    lv.add_argument("log", metavar="RUN.h5", help="the running job's run log")
    lv.add_argument("--rank", type=int, required=True, metavar="R", help="the worker's rank")

    jn = sub.add_parser("join", help="one more worker for a running job (under mpiexec -n 1)")
    jn.add_argument("log", metavar="RUN.h5", help="the running job's run log")

    bench = sub.add_parser("bench", help="benchmarks")
    bsub = bench.add_subparsers(dest="what", metavar="WHAT", parser_class=Parser)
    bsub.required = True
    ps = bsub.add_parser("ps", help="parameter-server throughput vs a bare MPI loop")
    ps.add_argument("--params", type=int, default=1_000_000)
    ps.add_argument("--seconds", type=float, default=2.0, help="length of each timed phase")
    ps.add_argument("--repeats", type=int, default=3, help="alternations of the two loops")
    ps.add_argument("--optimizer", default="sgd", choices=("sgd", "momentum", "adam"))
    ps.add_argument("--servers", default="1", metavar="K|per-node",
                    help="parameter stores, placed by node as `mpilb train --servers` does")
    ps.add_argument("--wire", default="fp32", metavar="fp32|bf16|fp16",
                    help="element type of pushes and replies, as `mpilb train --wire`")
    ps.add_argument("--chunk-kb", type=int, default=128, metavar="KB",
                    help="chunks between nodes, as `mpilb train --chunk-kb` (0: one message)")
    ps.add_argument("--json", action="store_true")

    exp = sub.add_parser("export", help="trained weights out of a checkpoint")
    exp.add_argument("checkpoint", metavar="CKPT.h5")
    exp.add_argument("out", metavar="OUT.pt|OUT.npz")
    exp.add_argument("--model", metavar="SPEC", help="the run's user model (FILE.py:NAME or "
                     "module:NAME); a checkpoint's own model name is never imported")
    exp.add_argument("--overwrite", action="store_true", help="replace an existing OUT")
    ev = sub.add_parser("evaluate", help="test metrics of a checkpoint")
    ev.add_argument("checkpoint", metavar="CKPT.h5")
    ev.add_argument("--data", required=True, metavar="DIR")
    ev.add_argument("--model", metavar="SPEC", help="the run's user model (FILE.py:NAME or "
                    "module:NAME); a checkpoint's own model name is never imported")
    ev.add_argument("--json", action="store_true")

    sub.add_parser("doctor", help="check the MPI, HDF5 and GPU setup")
    # listed here; main() hands every word after `box` to the box's own parser
    sub.add_parser("box", add_help=False, help="a cluster in a box: N emulated nodes on this "
                   "machine to run mpiexec across (root; docs/cluster.md)")

    simulate_arguments(sub.add_parser("simulate", help="replay a run or simulate a cluster "
                                      "under other policies (no MPI)"))
    return parser


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if list(argv[:1]) == ["box"]:   # up, run, down, status, cleanup: mpilb.clusterbox's parser
        return box_main(list(argv[1:]), prog="mpilb box")
    try:
        args = build_parser().parse_args(argv)
        return _dispatch(args)
    except UsageError as exc:
        if announced_rank() == 0:
            print(f"mpilb: error: {exc}", file=sys.stderr, flush=True)
        return 2
    except MpilbError as exc:   # (one write: the lines of several ranks stay whole)
        sys.stderr.write(f"mpilb: error: {exc}\n")
        sys.stderr.flush()
        return exc.exit_code
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:   # e.g. `mpilb report run.h5 | head`
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


def _dispatch(args) -> int:
    # Each command imports its own modules when it runs: `report` or `prepare` never loads
    # mpi4py (importing it starts MPI), `box` and `--help` neither numpy nor h5py.
    if args.command == "prepare":
        return _prepare(args)
    if args.command == "data":
        from mpilb.data.describe import dataset_info
        from mpilb.data.verified import verify_dataset

        if args.action == "verify":
            ds = verify_dataset(args.dir)
            print(f"{args.dir}: OK ({len(ds.shards)} shards, {ds.total_samples} samples, "
                  f"{ds.test_samples} test samples)")
        else:
            print(dataset_info(args.dir))
        return 0
    if args.command == "train":
        from mpilb.cli.launch import train
        from mpilb.mpi.launcher import foreign_mpi

        problem = foreign_mpi()   # before MPI starts: it would fail with a stack in every rank
        if problem:
            if announced_rank() != 0:   # rank 0 says why; mpirun ends the job at the first
                import time             # exit that is not 0, maybe before rank 0 has said it

                time.sleep(3.0)
            raise UsageError(problem)

        cli_values = {k: v for k, v in vars(args).items() if k not in ("command", "config_file")}
        if env_world_size() > 1 and _survive_signals(args.config_file, cli_values):
            from mpilb.run.supervise import supervise

            supervise(announced_rank())   # returns in the rank; its supervisor waits for it
        return train(args.config_file, cli_values)
    if args.command == "report":
        from mpilb.runfiles.report import run_report

        return run_report(args.logs, as_json=args.json, plots=args.plots, compare=args.compare,
                          csv=args.csv)
    if args.command == "join":
        from mpilb.cli.membership import join

        return join(args.log)
    if args.command == "leave":
        from mpilb.cli.membership import leave

        return leave(args.log, args.rank)
    if args.command == "bench":
        from mpilb.cli.bench import bench_ps

        return bench_ps(params=args.params, seconds=args.seconds, optimizer=args.optimizer,
                        as_json=args.json, repeats=args.repeats, servers=args.servers,
                        wire=args.wire, chunk_kb=args.chunk_kb)
    if args.command == "export":
        from mpilb.runfiles.export import export

        print(export(args.checkpoint, args.out, model=args.model, overwrite=args.overwrite))
        return 0
    if args.command == "evaluate":
        from mpilb.runfiles.export import evaluate_checkpoint

        result = evaluate_checkpoint(args.checkpoint, args.data, model=args.model)
        print(json.dumps(result) if args.json else
              f"{args.checkpoint} on {args.data}: " + ", ".join(
                  f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}" for k, v in result.items()))
        return 0
    if args.command == "doctor":
        from mpilb.cli.doctor import doctor

        return doctor()
    if args.command == "simulate":
        return run_simulate(args)
    raise UsageError(f"unknown command {args.command}")


def _survive_signals(config_file, cli_values: dict) -> bool:
    """--survive-signals, from the command line or the config file, known before MPI starts
    (a config file that cannot be read is reported by `train` itself)."""
    if "survive_signals" in cli_values:
        return bool(cli_values["survive_signals"])
    if not config_file:
        return False
    try:
        return load_toml(config_file).get("survive_signals") is True
    except UsageError:
        return False


def _prepare(args) -> int:
    from mpilb.data.ingest import prepare_csv, prepare_hdf5, prepare_npz
    from mpilb.data.prepare import prepare_digits, prepare_synthetic

    common = dict(shards=args.shards, test_fraction=args.test_fraction, seed=args.seed)
    if args.source == "digits":
        ds = prepare_digits(args.out, **common)
    elif args.source == "synthetic":
        ds = prepare_synthetic(args.out, samples=args.samples, features=args.features,
                               classes=args.classes, noise=args.noise, **common)
    elif args.source == "npz":
        ds = prepare_npz(args.file, args.out, x_key=args.x_key, y_key=args.y_key,
                         task=args.task, **common)
    elif args.source == "hdf5":
        if len(args.inputs) < 2:
            raise UsageError("prepare hdf5: give one or more input FILEs, then OUT")
        *files, args.out = args.inputs
        ds = prepare_hdf5(files, args.out, x_key=args.x_key, y_key=args.y_key,
                          task=args.task, **common)
    else:
        ds = prepare_csv(args.file, args.out, target=args.target, features=args.features,
                         delimiter=args.delimiter, task=args.task, **common)
    if args.source in ("npz", "hdf5", "csv"):
        from mpilb.data.standardize import describe, standardize_dataset, unscaled

        if args.standardize:
            ds = standardize_dataset(ds, targets=args.standardize == "all")
            print(describe(ds))
        elif unscaled(ds):   # (a few thousand rows of shard 0: cheap)
            print(f"mpilb: warning: {unscaled(ds)}", file=sys.stderr)
    kind = (f"{ds.num_classes} classes" if ds.num_classes else
            f"float targets of shape {tuple(ds.target_shape)}")
    print(f"{args.out}: {len(ds.shards)} shards, {ds.total_samples} training samples, "
          f"{ds.test_samples} test samples, shape {tuple(ds.sample_shape)}, {kind}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
