"""Build braid: the torch-free C++ core plus its torch binding as braid.comm._C.

CUDA sources (csrc/cuda/*.cu) join the build only when torch has CUDA and nvcc is found.
Knobs: BRAID_FORCE_CPU=1 (skip CUDA), BRAID_NO_EXTENSION=1 (the Python package only), MAX_JOBS
(parallel compile jobs, read by ninja),
TORCH_CUDA_ARCH_LIST (defaults to csrc/flags.txt's cuda_arch when no GPU is visible), BRAID_MARCH
(-march value for the CPU kernels, default csrc/flags.txt's march; "" for a portable build),
BRAID_CORE_LIB (a static library of the core built by CMakeLists.txt with the same flags, which the
extension then links instead of compiling csrc/core; the Makefile passes it), BRAID_DEBUG_INFO=1
(keep the debugging information Python's flags ask for with -g: without it the
build drops it, which takes a third off the compile time of the torch-heavy binding files and
most of the library's size; symbols stay).
"""
import glob
import os
import shutil

from setuptools import setup

import torch
from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension, CUDA_HOME

ROOT = os.path.dirname(os.path.abspath(__file__))


def sources(pattern):
    return sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, pattern), recursive=True))


def build_settings():
    """csrc/flags.txt, which every build of braid reads (it says why each setting): the C++ flags
    (lines starting with '-') and the name=value settings."""
    flags, settings = [], {}
    with open(os.path.join(ROOT, "csrc", "flags.txt")) as f:
        for line in (raw.strip() for raw in f):
            if line.startswith("-"):
                flags.append(line)
            elif "=" in line and not line.startswith("#"):
                name, value = line.split("=", 1)
                settings[name.strip()] = value.strip()
    return flags, settings


def want_cuda():
    if os.environ.get("BRAID_FORCE_CPU", "0") not in ("", "0"):
        return False
    nvcc = shutil.which("nvcc") or (CUDA_HOME and os.path.join(CUDA_HOME, "bin", "nvcc"))
    return torch.version.cuda is not None and bool(nvcc) and os.path.exists(nvcc)


def cxx_runtime():
    """Link arguments that make the extension use the shared C++ runtime this process runs with
    (the libstdc++ torch loaded), named by its path, where the compiler driver would otherwise
    link a static copy into the extension (a toolchain wrapper adding -static-libstdc++, as one
    GPU machine's did). A private copy's stream code met the process's locale there and crashed
    formatting a number into an error message. Named by path, not -lstdc++: that driver turned
    -lstdc++ into its static archive too. Empty where no libstdc++ is mapped (another C++ runtime)."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "/libstdc++.so" in line}
    except OSError:
        return []
    found = sorted(p for p in paths if os.path.isfile(p))
    return [f"-Wl,-Bdynamic,{found[0]}"] if found else []


def extension():
    flags, settings = build_settings()
    march = os.environ.get("BRAID_MARCH", settings["march"])
    # -fopenmp: at::parallel_for (the optimizer steps' threads, optim_binding.cpp) is inline in
    # torch's headers and runs on one thread in code compiled without OpenMP; the link resolves to
    # the libgomp torch has already loaded (same soname).
    # -Wno-c++20-extensions: torch's headers (c10/core/AutogradState.h) use C++20 bit-field
    # initializers, which GCC reports in every binding file under -std=c++17.
    cxx = ["-O3", *flags, "-fopenmp", "-Wno-c++20-extensions"]
    link = ["-fopenmp", *cxx_runtime()]
    if os.environ.get("BRAID_DEBUG_INFO", "0") in ("", "0"):
        cxx.append("-g0")  # after Python's -g, which it overrides
    if march:
        cxx.append(f"-march={march}")
    core = sources("csrc/core/**/*.cc")
    linked = []
    core_lib = os.environ.get("BRAID_CORE_LIB", "")
    if core_lib:
        if not os.path.isfile(core_lib):
            raise SystemExit(f"BRAID_CORE_LIB={core_lib!r} is not a file "
                             "(build CMakeLists.txt's braid_core first)")
        core, linked = [], [os.path.abspath(core_lib)]
    binding = sources("csrc/binding/*.cpp")
    cuda = sources("csrc/cuda/**/*.cu")
    if want_cuda() and cuda:
        if not os.environ.get("TORCH_CUDA_ARCH_LIST") and not torch.cuda.is_available():
            arch = settings["cuda_arch"]
            os.environ["TORCH_CUDA_ARCH_LIST"] = f"{arch[:-1]}.{arch[-1]}"  # 90 -> 9.0
        return CUDAExtension(
            "braid.comm._C",
            core + binding + cuda,
            define_macros=[("BRAID_WITH_CUDA", "1")],
            extra_compile_args={"cxx": cxx, "nvcc": ["-O3", *(f for f in flags if f.startswith("-std="))]},
            extra_objects=linked,
            extra_link_args=link,
            depends=linked,
        )
    return CppExtension("braid.comm._C", core + binding, extra_compile_args={"cxx": cxx},
                        extra_objects=linked, extra_link_args=link, depends=linked)


setup(
    name="braid",
    version="0.1.0",
    description="Collective communication and kernels for PyTorch training",
    python_requires=">=3.9",
    package_dir={"braid.comm": "comm", "braid.kernels": "kernels", "braid.bench": "bench",
                 "braid.trace": "trace", "braid.optim": "optim", "braid.ft": "ft",
                 "braid.plan": "plan"},
    packages=["braid.comm", "braid.comm.core", "braid.comm.compression", "braid.comm.compression.adaptive",
              "braid.comm.zero", "braid.comm.tp", "braid.comm.moe", "braid.kernels", "braid.bench",
              "braid.trace", "braid.optim", "braid.ft", "braid.plan"],
    # BRAID_NO_EXTENSION=1: the package alone (the Makefile installs it editable once, then builds
    # the extension in place with a persistent build tree, so rebuilds are incremental).
    ext_modules=[] if os.environ.get("BRAID_NO_EXTENSION", "0") not in ("", "0") else [extension()],
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
    entry_points={"console_scripts": ["braid-bench=braid.bench.__main__:main"]},
    zip_safe=False,
)
