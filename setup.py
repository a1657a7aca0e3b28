"""Packaging for mecheval: the kernel library (Triton ops with PyTorch fallbacks; folder kernels/,
imported as `mecheval_kernels`, a name no other distribution takes) and the `mecheval` package
(tasks, models, training, interventions). CPU-only machines install everything but the `gpu` extra;
nothing here needs a CUDA toolchain."""

from pathlib import Path

from setuptools import find_packages, setup

setup(
    name="mecheval",
    version="0.1.0",
    description="Fast mechanistic evaluation of Transformers and state space models",
    long_description=Path(__file__).with_name("README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=[
        *find_packages(include=["mecheval", "mecheval.*"]),
        *(f"mecheval_{name}" for name in find_packages(include=["kernels", "kernels.*"])),
    ],
    package_dir={"mecheval_kernels": "kernels"},
    # The main job's default, configs/quickstart.yaml, ships inside the package (through the
    # link mecheval/quickstart.yaml), so that an installed mecheval finds it too.
    package_data={"mecheval": ["quickstart.yaml", "evaluation/*.csv"]},
    install_requires=[
        "torch>=2.4",
        "triton>=3.0; platform_system == 'Linux'",
        "numpy>=1.24",
        "pandas>=2.0",
        "pyarrow>=14",
        "safetensors>=0.4",
        "pyyaml>=6",
        "tqdm>=4.60",
        "matplotlib>=3.7",
    ],
    extras_require={
        # CUDA peers, compared against in benchmarks; they need a CUDA toolchain to build.
        "gpu": ["causal-conv1d>=1.4", "mamba-ssm>=2.2", "flash-attn>=2.5"],
        # pyvene: DAS's swap is checked against its rotated-space intervention.
        "test": [
            "pytest>=7",
            "pytest-xdist>=3",
            "pytest-benchmark>=4",
            "hypothesis>=6",
            "pyvene>=0.1.8",
            "transformers>=4.45",
            # Its naive references (pure PyTorch, CPU) are the oracles of the delta-rule family.
            "flash-linear-attention==0.6.0",
        ],
        # mecheval.models.from_pretrained: Hugging Face checkpoints, read by transformers,
        # downloaded by huggingface_hub (fla's families also need flash-linear-attention).
        "pretrained": ["transformers>=4.56", "huggingface_hub>=0.24"],
        "dist": ["ray>=2.9"],
        "dev": ["ruff>=0.5"],
    },
    entry_points={"console_scripts": ["mecheval=mecheval.cli:main"]},
)
