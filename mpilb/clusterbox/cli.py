"""`python -m mpilb.clusterbox up|run|down|status|cleanup` (docs/cluster.md)."""

from __future__ import annotations

import argparse
import subprocess
import sys

from mpilb.errors import MpilbError, UsageError
import mpilb.clusterbox.registry as registry
from mpilb.clusterbox.box import ClusterBox
from mpilb.clusterbox.system import netns_pids, require

PROG = "python -m mpilb.clusterbox"


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise UsageError(message)


def build_parser(prog: str = PROG) -> argparse.ArgumentParser:
    p = _Parser(prog=prog, description="A cluster in a box: N emulated nodes on this machine "
                "(needs root, iproute2 and util-linux).")
    sub = p.add_subparsers(dest="action", required=True, parser_class=_Parser)

    def shape_options(q):
        q.add_argument("--nodes", type=int, default=2, help="nodes n0 ... n<N-1> (default 2)")
        q.add_argument("--link-rate", default=None, metavar="RATE",
                       help="tc rate of every link (1gbit, 100mbit) or one per node, "
                            "comma-separated (default: unshaped)")
        q.add_argument("--tcp", default="loss", metavar="CC",
                       help="the nodes' TCP congestion control: loss (default: cubic where "
                            "the kernel allows it in a namespace, else reno), host (this "
                            "machine's own default) or a name the kernel allows")

    up = sub.add_parser("up", help="build a box that stays up until `down`")
    shape_options(up)
    up.add_argument("--name", help="the box's name (default: b<pid><random>)")

    run = sub.add_parser("run", help="run a command on a node of a box (a temporary box when "
                         "--box is not given); `mpiexec` as the command launches into the box")
    run.add_argument("--box", metavar="NAME", help="a box made by `up`")
    shape_options(run)
    run.add_argument("--node", type=int, default=0, help="the node to run on (default 0)")
    run.add_argument("--timeout", type=float, default=None, help="seconds before the command "
                     "is killed (exit 124)")
    run.add_argument("cmd", nargs=argparse.REMAINDER, help="the command (after --)")

    down = sub.add_parser("down", help="tear boxes down (and what their runs left)")
    down.add_argument("names", nargs="*", metavar="NAME")
    down.add_argument("--all", action="store_true", help="every box on this machine")

    status = sub.add_parser("status", help="the boxes on this machine")
    status.add_argument("names", nargs="*", metavar="NAME")

    clean = sub.add_parser("cleanup", help="`cleanup stale`: tear down the boxes whose "
                           "maker died")
    clean.add_argument("what", choices=["stale"])
    return p


def main(argv=None, prog: str = PROG) -> int:
    """The command line; returns the exit code (2: usage or a missing tool, 1: a failing
    command, else the exit code of the command `run` ran)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        args = build_parser(prog).parse_args(argv)
        require()
        return _dispatch(args, prog)
    except MpilbError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr, flush=True)
        return exc.exit_code
    except KeyboardInterrupt:
        return 130


def _rates(text: str | None):
    if text is None or "," not in text:
        return text
    return [r.strip() for r in text.split(",")]


def _dispatch(args, prog: str) -> int:
    if args.action == "up":
        box = ClusterBox(args.nodes, _rates(args.link_rate), name=args.name, keep=True,
                         tcp=args.tcp).up()
        print(f"box {box.name} is up: nodes {', '.join(box.hosts)} (TCP {box.tcp}); "
              f"`{prog} run --box {box.name} -- CMD` runs on n0, `{prog} down {box.name}` "
              "removes it")
        return 0
    if args.action == "run":
        return _run(args, prog)
    if args.action == "down":
        names = registry.boxes() if args.all else args.names
        if not names:
            raise UsageError("down: name a box (or --all)")
        for name in names:
            removed = registry.teardown(registry.check_name(name))
            for what in removed:
                print(f"removed {what}")
            if not removed:
                print(f"no box {name}")
        return 0
    if args.action == "status":
        return _status(args.names)
    for name in registry.stale():
        registry.teardown(name)
        print(f"removed stale box {name}")
    return 0


def _run(args, prog: str = PROG) -> int:
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not cmd:
        raise UsageError("run: give the command to run, after --")
    if args.box:
        return _run_in(ClusterBox.attach(args.box), args.node, cmd, args.timeout, prog)
    with ClusterBox(args.nodes, _rates(args.link_rate), tcp=args.tcp) as box:
        return _run_in(box, args.node, cmd, args.timeout, prog)


def _run_in(box: ClusterBox, node: int, cmd: list, timeout: float | None,
            prog: str = PROG) -> int:
    if not 0 <= node < box.nodes:
        raise UsageError(f"--node {node}: box {box.name} has nodes 0-{box.nodes - 1}")
    if cmd[0] == "mpiexec":
        cmd = box.mpiexec_cmd(cmd[1:])
    proc = subprocess.Popen(box.command(node, cmd), env=box.env())
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        print(f"{prog} run: killed after {timeout:g} s", file=sys.stderr)
        return 124
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _status(names: list) -> int:
    names = [registry.check_name(n) for n in names] or registry.boxes()
    if not names:
        print("no boxes")
    for name in names:
        state = registry.read_state(name) or {}
        spaces = registry.namespaces(name)
        holders = state.get("holders") or []
        alive = sum(1 for k, pid in enumerate(holders)
                    if pid in netns_pids(f"{registry.PREFIX}{name}-n{k}"))
        print(f"{name}: {state.get('nodes', '?')} nodes ({alive} up), links "
              f"{state.get('rates', '?')}, TCP {state.get('tcp') or '?'}, made {_made(state)}, "
              f"{len(spaces)} namespaces, ssh stand-in {registry.box_dir(name) / 'ssh'}")
    return 0


def _made(state: dict) -> str:
    if not state:
        return "by an unrecorded process (stale)"
    owner = state.get("owner")
    if owner is None:
        return "by `up`"
    return f"by pid {owner['pid']}" + ("" if registry.owner_alive(state) else " (dead: stale)")
