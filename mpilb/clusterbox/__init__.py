"""A cluster in a box: N emulated nodes on one Linux machine (network and mount namespaces
joined by shaped veth links), for tests, benchmarks and trying a layout. See docs/cluster.md."""

from mpilb.clusterbox.box import ClusterBox
from mpilb.clusterbox.cli import main
from mpilb.clusterbox.system import BoxError, missing

__all__ = ["BoxError", "ClusterBox", "main", "missing"]
