"""Builds the C++/CUDA extension ``fastppo._C`` from ``csrc/``.

Install without build isolation so the build sees the torch you run with::

    pip install --no-build-isolation -e .

* torch importable at build time -> the CPU op is compiled ahead of time, and
  the CUDA op too when torch is a CUDA build and a CUDA toolkit is found;
* torch not importable -> no binary; ``fastppo.kernels`` compiles the op on
  first use (JIT, cached) or falls back to the PyTorch reference.

The sources are also copied into the package (``fastppo/_csrc``) so an installed
wheel can JIT-compile them.
"""
import os
import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).parent
CSRC = ROOT / "csrc"


class BuildPyWithSources(build_py):
    def run(self):
        super().run()
        target = Path(self.build_lib) / "fastppo" / "_csrc"
        target.mkdir(parents=True, exist_ok=True)
        for src in CSRC.iterdir():
            if src.suffix in {".cpp", ".cu", ".h"}:
                shutil.copy2(src, target / src.name)


def extension_build():
    cmdclass = {"build_py": BuildPyWithSources}
    try:
        import torch
        from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension
    except ImportError:
        print("fastppo: torch is not importable at build time; the C++ op will be compiled on first use")
        return [], cmdclass

    sources = ["csrc/truncate_at_stop.cpp"]
    cxx_flags = ["-O3", "-std=c++17"]
    want_cuda = torch.version.cuda is not None and CUDA_HOME is not None and os.environ.get("FASTPPO_NO_CUDA") != "1"
    if want_cuda:
        ext = CUDAExtension(
            "fastppo._C",
            sources + ["csrc/truncate_at_stop_cuda.cu"],
            extra_compile_args={"cxx": cxx_flags, "nvcc": ["-O3", "-std=c++17"]},
        )
    else:
        ext = CppExtension("fastppo._C", sources, extra_compile_args={"cxx": cxx_flags})
    cmdclass["build_ext"] = BuildExtension.with_options(no_python_abi_suffix=False)
    return [ext], cmdclass


ext_modules, cmdclass = extension_build()
setup(ext_modules=ext_modules, cmdclass=cmdclass)
