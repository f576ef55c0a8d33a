import sys

from mpilb.clusterbox.cli import main

sys.exit(main())
