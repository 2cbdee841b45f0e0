"""Builds the C++ extension ``fusekit._core``; all other metadata lives in pyproject.toml.

Flags are portable by default (no -march=native) so a built wheel runs on any x86-64 or
ARM machine; hot kernels get wider vector units through function multi-versioning.
Set FUSEKIT_NATIVE=1 to build for the local CPU only. OpenMP is used when the compiler
accepts it. NPY_NUM_BUILD_JOBS=N compiles the sources N at a time (one by default).
"""

import os
import sys
import tempfile
from glob import glob

from pybind11.setup_helpers import ParallelCompile, Pybind11Extension, build_ext
from setuptools import setup

ParallelCompile("NPY_NUM_BUILD_JOBS", default=1).install()


def _compiler_accepts(compiler, flag: str) -> bool:
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "probe.cpp")
        with open(src, "w") as f:
            f.write("#include <omp.h>\nint main() { return omp_get_max_threads() > 0 ? 0 : 1; }\n")
        try:
            compiler.compile([src], output_dir=tmp, extra_postargs=[flag])
        except Exception:
            return False
    return True


class BuildExt(build_ext):
    def build_extensions(self):
        ext = self.extensions[0]
        if sys.platform != "win32":
            ext.extra_compile_args += [
                "-O3",
                "-fno-math-errno",
                "-fvisibility=hidden",
                # FMA contraction in the cost kernels; results stay within rounding.
                "-ffp-contract=fast",
            ]
            if _compiler_accepts(self.compiler, "-fopenmp-simd"):
                ext.extra_compile_args.append("-fopenmp-simd")
            if os.environ.get("FUSEKIT_NATIVE") == "1":
                ext.extra_compile_args.append("-march=native")
            if _compiler_accepts(self.compiler, "-fopenmp"):
                ext.extra_compile_args.append("-fopenmp")
                ext.extra_link_args.append("-fopenmp")
                ext.define_macros.append(("FUSEKIT_OPENMP", "1"))
        super().build_extensions()


setup(
    ext_modules=[
        Pybind11Extension(
            "fusekit._core",
            sorted(glob("csrc/*.cpp")),
            include_dirs=["csrc"],
            cxx_std=17,
        )
    ],
    cmdclass={"build_ext": BuildExt},
)
