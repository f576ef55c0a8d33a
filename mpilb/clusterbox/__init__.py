"""A cluster in a box: N emulated nodes on one Linux machine (network and mount namespaces
joined by shaped veth links), for tests, benchmarks and trying a layout. See docs/cluster.md."""

from .box import ClusterBox
from .cli import main
from .system import BoxError, missing

__all__ = ["BoxError", "ClusterBox", "main", "missing"]
