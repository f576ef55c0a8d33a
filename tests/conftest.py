"""Shared pytest fixtures (additive: each block belongs to the module it serves)."""

import pytest

# ---------------------------------------------------------------- datasets (mpilb.dataset)


@pytest.fixture
def small_dataset(tmp_path):
    """A synthetic dataset of 2000 x 16, 4 classes, 4 shards (1600 train, 400 test)."""
    from mpilb.dataset import prepare_synthetic

    return prepare_synthetic(tmp_path / "small", samples=2000, features=16, classes=4, shards=4, seed=0)


# ---------------------------------------------------------------- engine (mpilb.server/worker)


@pytest.fixture(scope="session")
def digits_dir(tmp_path_factory):
    """scikit-learn's digits as an mpilb dataset (8 shards), made once per session."""
    from mpilb.dataset import prepare_digits

    root = tmp_path_factory.mktemp("digits") / "digits"
    prepare_digits(root, shards=8, seed=0)
    return str(root)


@pytest.fixture(scope="session")
def synth_dir(tmp_path_factory):
    """A 12000 x 32 synthetic dataset with 12 shards, made once per session."""
    from mpilb.dataset import prepare_synthetic

    root = tmp_path_factory.mktemp("synth") / "synth"
    prepare_synthetic(root, samples=12000, features=32, classes=10, shards=12, seed=0)
    return str(root)
