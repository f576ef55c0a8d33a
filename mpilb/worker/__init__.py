"""A worker rank (ranks 1..P-1): the loop (loop.Worker) and its parts: pushes, replies,
assignments, device buffers, the shard rows it sends and receives (row_exchange) and the
node-local copies it checks (node_copies).
"""
