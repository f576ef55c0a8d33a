"""A human-readable summary of a dataset on disk (``mpilb dataset info``).

Kept importable as ``mpilb.data.dataset.dataset_info``.
"""

from __future__ import annotations

from mpilb.data.dataset import _all_files, open_dataset


def _human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"  # pragma: no cover


def dataset_info(root) -> str:
    """A human-readable multi-line summary of a dataset (manifest plus file sizes)."""
    ds = open_dataset(root, check_files=False)
    sizes = ds.shard_sizes
    file_bytes = []
    for name, _, _ in _all_files(ds):
        path = ds.root / name
        file_bytes.append(path.stat().st_size if path.exists() else 0)
    gen = ds.generator
    gen_text = ", ".join(f"{k}={v}" for k, v in gen.items()) if gen else "unknown"
    lines = [
        f"dataset:        {ds.root}",
        f"format version: {ds.format_version}",
        f"generator:      {gen_text}",
        f"created:        {ds.created or 'unknown'}",
        f"sample shape:   {ds.sample_shape} {ds.dtype}, labels {ds.label_dtype}",
        (f"classes:        {ds.num_classes}" if not ds.regression else
         f"targets:        float32, shape {ds.target_shape} per sample (regression)"),
        f"shards:         {len(ds.shards)} ({ds.shards[0].file} .. {ds.shards[-1].file})",
        f"train samples:  {ds.total_samples} (per shard min {min(sizes)}, max {max(sizes)}, "
        f"mean {ds.total_samples / len(sizes):.1f})",
        f"test samples:   {ds.test_samples} ({ds.test_file})",
        f"bytes:          {_human_bytes(ds.total_samples * ds.row_nbytes)} train data "
        f"({_human_bytes(ds.shard_nbytes(0))} per shard), "
        f"{_human_bytes(sum(file_bytes))} on disk",
    ]
    return "\n".join(lines)
