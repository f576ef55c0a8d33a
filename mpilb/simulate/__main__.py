"""``python -m mpilb.simulate ARGS``: the same as ``mpilb simulate ARGS``."""

import sys

from mpilb.cli.main import main

raise SystemExit(main(["simulate", *sys.argv[1:]]))
