"""HDF5 shard datasets: the manifest and its checks (dataset, verified), the writers
(prepare, ingest, standardize), `data info` (describe) and the cached reader with its
per-epoch permutations and placement of node-local copies (shards).
"""
