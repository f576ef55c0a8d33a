"""Shared pytest fixtures (additive: each block belongs to the module it serves)."""

import pytest

# ---------------------------------------------------------------- datasets (mpilb.dataset)


@pytest.fixture
def small_dataset(tmp_path):
    """A synthetic dataset of 2000 x 16, 4 classes, 4 shards (1600 train, 400 test)."""
    from mpilb.dataset import prepare_synthetic

    return prepare_synthetic(tmp_path / "small", samples=2000, features=16, classes=4, shards=4, seed=0)
