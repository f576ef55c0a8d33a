"""What a run log's root attributes say, decoded: JSON attributes, the parameter-store
ranks and every rank's node (with the defaults of logs written before they were recorded),
and the layout lines the report ends with."""

from __future__ import annotations

import json
from typing import Optional

from mpilb.core.topology import crowded, default_stores, layout_lines, number_nodes


def json_attr(attrs: dict, key: str, default):
    value = attrs.get(key)
    if value is None:
        return default
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except (TypeError, ValueError):
        return default


def store_ranks(attrs: dict, config: Optional[dict] = None) -> list[int]:
    """The run's parameter-store ranks: root attribute `stores`, else (a log written before
    stores were placed by node) ranks 0..K-1 of --servers K."""
    stores = json_attr(attrs, "stores", None)
    if stores:
        return [int(r) for r in stores]
    config = json_attr(attrs, "config", {}) if config is None else config
    return default_stores(config.get("servers") or 1)


def node_layout(attrs: dict) -> list[int]:
    """Node index of every rank: root attribute `nodes`, else numbered from `hostnames`
    (a log written before nodes were recorded), else one node."""
    nodes = json_attr(attrs, "nodes", None)
    if nodes:
        return [int(n) for n in nodes]
    hosts = json_attr(attrs, "hostnames", None)
    world = int(attrs.get("world_size", 1))
    return number_nodes(hosts) if hosts and len(hosts) == world else [0] * world


def format_layout(attrs: dict) -> list[str]:
    """The report's layout lines (nodes, stores, shared memory vs network) and warnings;
    none for a one-rank run."""
    nodes = node_layout(attrs)
    if len(nodes) < 2:
        return []
    stores = [r for r in store_ranks(attrs) if r < len(nodes)]
    hosts = json_attr(attrs, "hostnames", None)
    lines = ["  layout: " + line for line in layout_lines(nodes, stores, hosts)[:1]]
    lines += ["    " + line for line in layout_lines(nodes, stores, hosts)[1:]]
    return lines + [f"  warning: {w}" for w in crowded(nodes, stores)]
