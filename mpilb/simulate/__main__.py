"""``python -m mpilb.simulate ARGS``: the same as ``mpilb simulate ARGS``."""

import sys

from ..cli import main

raise SystemExit(main(["simulate", *sys.argv[1:]]))
