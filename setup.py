"""Source build of zero_kernels and its extension ``zero_kernels._C``.

    pip install torch==2.13.0            # any torch >= 2.4 that is already installed
    pip install --no-build-isolation .   # builds against that torch, never downloads one

CPU kernels are always built. CUDA kernels are built when torch is a CUDA build and nvcc is found;
ZERO_KERNELS_NO_CUDA=1 skips them, ZERO_KERNELS_CUDA_ARCH (default "80;90") picks the GPUs: machine
code (sm_XY) for each, and PTX for the newest (compute_XY), which the driver compiles once for GPUs
newer than any listed (sm_100, sm_120...). The extension's ``cuda_archs()`` lists what it holds;
backend "auto" uses Triton on a GPU none of it runs on (zero_kernels/ops/backends.py).
"""

import os
import shutil
import sys

from setuptools import find_packages, setup

try:
    import torch
    from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension
except ImportError as e:  # pragma: no cover - build-time message
    sys.exit(
        "zero_kernels builds against an installed torch: install it first "
        "(e.g. `pip install torch==2.13.0`), then `pip install --no-build-isolation .` "
        f"({e})"
    )

here = os.path.dirname(os.path.abspath(__file__))
torch_pin = "torch==" + torch.__version__.split("+")[0]
integrations = [
    "transformers>=5.3,<=5.25.0",
    "accelerate>=1.0,<=1.16.0",
    "lightning>=2.4,<=2.6.6",
    "pytorch-lightning>=2.4,<=2.6.6",
]
cpu_sources = [
    "csrc/bindings.cpp",
    "csrc/bindings_host.cpp",
    "csrc/adam_cpu_scalar.cpp",
    "csrc/adam_cpu_avx2.cpp",
    "csrc/adam_cpu_avx512.cpp",
    "csrc/quant_cpu_scalar.cpp",
    "csrc/quant_cpu_avx2.cpp",
    "csrc/quant_cpu_avx512.cpp",
    "csrc/flat_copy.cpp",
    "csrc/shm_sync.cpp",
    "csrc/block_cache.cpp",
    "csrc/aio.cpp",
]
cxx_flags = ["-O3", "-std=c++17", "-fopenmp", "-Wall", "-Wno-unknown-pragmas"]


def want_cuda() -> bool:
    if os.environ.get("ZERO_KERNELS_NO_CUDA", "0") not in ("", "0"):
        print("zero_kernels: ZERO_KERNELS_NO_CUDA set, building CPU kernels only")
        return False
    if torch.version.cuda is None:
        print("zero_kernels: torch is a CPU build, building CPU kernels only")
        return False
    from torch.utils.cpp_extension import CUDA_HOME

    if CUDA_HOME is None and shutil.which("nvcc") is None:
        print("zero_kernels: nvcc not found, building CPU kernels only")
        return False
    return True


def cuda_images(spec: str) -> list[str]:
    """``"80;90"`` -> ``["sm_80", "sm_90", "compute_90"]``: machine code for every arch listed,
    and PTX for the newest, without a suffix (``90a``'s PTX would run on sm_90 only)."""
    archs = [a.strip() for a in spec.replace(",", ";").split(";") if a.strip()]
    nums = ["".join(c for c in a if c.isdigit()) for a in archs]
    if not archs or not all(nums):
        sys.exit(f"ZERO_KERNELS_CUDA_ARCH must list architectures such as 80;90, got {spec!r}")
    return [f"sm_{a}" for a in archs] + [f"compute_{max(nums, key=int)}"]


if want_cuda():
    images = cuda_images(os.environ.get("ZERO_KERNELS_CUDA_ARCH", "80;90"))
    gencode = [f"-gencode=arch=compute_{i.split('_', 1)[1]},code={i}" for i in images]
    ext = CUDAExtension(
        "zero_kernels._C",
        cpu_sources + ["csrc/adam_cuda.cu", "csrc/adam_lowbit_cuda.cu", "csrc/quant_cuda.cu"],
        define_macros=[("ZK_WITH_CUDA", "1")],
        extra_compile_args={
            # the images, for cuda_archs() (bindings.cpp); on the host compiler only (nvcc's -D
            # would split the list at its commas)
            "cxx": [*cxx_flags, "-DZK_CUDA_ARCHS=" + ",".join(images)],
            "nvcc": ["-O3", "-std=c++17", *gencode],
        },
        extra_link_args=["-fopenmp"],
    )
else:
    ext = CppExtension(
        "zero_kernels._C",
        cpu_sources,
        extra_compile_args={"cxx": cxx_flags},
        extra_link_args=["-fopenmp"],
    )

setup(
    name="zero_kernels",
    version="0.1.0",
    description="ZeRO (Zero Redundancy Optimizer) for PyTorch with fused sharded optimizer kernels",
    long_description=open(os.path.join(here, "README.md")).read()
    if os.path.exists(os.path.join(here, "README.md"))
    else "",
    long_description_content_type="text/markdown",
    packages=find_packages(include=["zero_kernels", "zero_kernels.*"]),
    package_data={"zero_kernels": ["data/*.txt", "data/*.md"]},
    python_requires=">=3.10",
    # torch is not listed: a requirement would let pip replace the installed build with another
    # (a multi-GB CUDA wheel on a CPU machine); setup.py checks for it at build time instead.
    # matplotlib draws the report.png that `zero-kernels demo` (the quickstart's first line) saves;
    # safetensors holds checkpoint tensors (zero_kernels.checkpoint: no pickle at load).
    install_requires=["numpy", "matplotlib", "safetensors"],
    # The integrations' frameworks (zero_kernels.integrations) are optional; the test extra holds
    # the versions the integrations are tested with, and pins torch to the installed build in the
    # same pip command, so that none of them can replace it.
    extras_require={
        # peft: LoRA over a frozen base, for stage 3's shard_frozen tests
        "test": [
            "pytest",
            "pytest-benchmark",
            "triton",
            *integrations,
            "peft>=0.13,<=0.18.0",
            torch_pin,
        ],
        "transformers": [integrations[0], integrations[1], torch_pin],
        "accelerate": [integrations[1], torch_pin],
        "lightning": [integrations[2], torch_pin],
    },
    ext_modules=[ext],
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
    entry_points={"console_scripts": ["zero-kernels = zero_kernels.cli.main:main"]},
)
