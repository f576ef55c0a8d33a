from setuptools import find_packages, setup

setup(
    name="mpilb",
    version="0.1.0",
    description="Load-balanced asynchronous data-parallel training for MPI clusters",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.9",
    packages=find_packages(include=["mpilb", "mpilb.*"]),
    install_requires=[
        "numpy>=1.22",
        "h5py>=3.6",
        "mpi4py>=3.1",
        "tqdm>=4.60",
        "matplotlib>=3.5",
        "tomli>=1.1; python_version<'3.11'",
    ],
    extras_require={
        "mpi": ["mpich"],
        "gpu": ["cupy-cuda12x"],
        # PyPI's default torch is the CUDA build (several GB); CPU-only nodes install
        # torch first: pip install torch --index-url https://download.pytorch.org/whl/cpu
        "torch": ["torch>=2.0"],
        "test": ["pytest>=7", "pytest-timeout>=2", "scikit-learn>=1.0", "hypothesis>=6",
                 "pandas>=1.5", "tensorboardX>=2.5", "tensorboard>=2.10"],
        "tensorboard": ["tensorboardX>=2.5"],
    },
    entry_points={"console_scripts": ["mpilb=mpilb.cli.main:main"]},
)
