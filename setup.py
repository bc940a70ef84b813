"""Build of megatron_ext: the CPU extension always, the CUDA sources when a CUDA toolchain is usable.

Knobs (environment variables):
  FORCE_CUDA=1              compile the CUDA sources even if torch sees no GPU
  MEGATRON_EXT_FORCE_CPU=1  never compile the CUDA sources
  TORCH_CUDA_ARCH_LIST      target archs; defaults to "8.0;9.0+PTX" when no GPU is visible
  MAX_JOBS                  parallel compile jobs (ninja)
  MEGATRON_EXT_WERROR=1     warnings are errors (host compiler: -Wall -Werror; nvcc:
                            -Werror=all-warnings), as CI builds
  MEGATRON_EXT_DEBUG=1      keep debug info in the C++ objects (left out by default: -g0)

The extension builds against the torch already installed (``--no-build-isolation``); it needs at
least MIN_TORCH and records the version it was built with (``megatron_ext.build_info()``).
"""

import glob
import json
import os
import platform
import shutil


def _locate_cuda_home() -> None:
    # torch takes CUDA_HOME from the folder above ``which nvcc``; when nvcc is a symlink or a
    # wrapper script (/usr/local/bin/nvcc) that folder holds no CUDA headers or libraries.
    if "CUDA_HOME" in os.environ or "CUDA_PATH" in os.environ:
        return
    nvcc = shutil.which("nvcc")
    candidates = [os.path.dirname(os.path.dirname(os.path.realpath(nvcc)))] if nvcc else []
    candidates.append("/usr/local/cuda")
    for home in candidates:
        if os.path.exists(os.path.join(home, "include", "cuda_runtime.h")):
            os.environ["CUDA_HOME"] = home
            return


_locate_cuda_home()

import torch  # noqa: E402
from setuptools import find_packages, setup  # noqa: E402
from torch.utils.cpp_extension import (  # noqa: E402
    CUDA_HOME,
    BuildExtension,
    CppExtension,
    CUDAExtension,
    include_paths,
)

DEFAULT_CUDA_ARCHS = "8.0;9.0+PTX"
# The oldest torch whose full test suite has passed with this extension; newer ones are accepted.
MIN_TORCH = "2.11"
TESTED_TORCH = "2.11.0, 2.12.1, 2.13.0 and 2.14.1"


def _check_torch_version() -> None:
    """Refuses, before compiling anything, a torch older than MIN_TORCH."""
    have = tuple(int(part) for part in torch.__version__.split(".")[:2])
    need = tuple(int(part) for part in MIN_TORCH.split("."))
    if have < need:
        raise RuntimeError(
            f"megatron_ext builds against torch {MIN_TORCH} or newer (tested with {TESTED_TORCH}); "
            f"this python has torch {torch.__version__}"
        )


def _flag(name: str) -> bool:
    return os.environ.get(name, "0").lower() in ("1", "true", "yes", "on")


def _want_cuda() -> bool:
    if _flag("MEGATRON_EXT_FORCE_CPU"):
        return False
    nvcc_found = CUDA_HOME is not None or shutil.which("nvcc") is not None
    if _flag("FORCE_CUDA"):
        if not nvcc_found:
            raise RuntimeError("FORCE_CUDA=1 but no nvcc was found (set CUDA_HOME or put nvcc on PATH)")
        return True
    return torch.version.cuda is not None and nvcc_found


def _write_build_config(cuda: bool) -> str:
    """Writes the facts ``megatron_ext.build_info()`` reports into a generated header."""
    here = os.path.dirname(os.path.abspath(__file__))
    generated = os.path.join(here, "build", "generated")
    os.makedirs(generated, exist_ok=True)
    archs = os.environ.get("TORCH_CUDA_ARCH_LIST", "") if cuda else ""
    if cuda and not archs:  # torch builds for the visible GPUs
        archs = ";".join(sorted({"%d.%d" % torch.cuda.get_device_capability(i)
                                 for i in range(torch.cuda.device_count())}))
    header = (
        "#pragma once\n"
        f"#define MEGATRON_EXT_BUILT_WITH_TORCH {json.dumps(torch.__version__)}\n"
        f"#define MEGATRON_EXT_CUDA_ARCHS {json.dumps(archs)}\n"
        f"#define MEGATRON_EXT_CUDA_VERSION {json.dumps((torch.version.cuda or '') if cuda else '')}\n"
    )
    path = os.path.join(generated, "megatron_ext_build_config.h")
    if not os.path.exists(path) or open(path).read() != header:
        with open(path, "w") as f:
            f.write(header)
    return generated


# Instruction sets the CPU kernel files (csrc/kernels/cpu/*.cpp) are compiled for besides the
# baseline, as ATen builds its own kernels: name, CPU_CAPABILITY macro, compiler flags.
# kernels/cpu_capability.cpp picks the best one the running CPU supports.
CPU_CAPABILITIES = [
    ("AVX2", ["-mavx2", "-mfma", "-mf16c", "-mbmi", "-mbmi2"]),
    ("AVX512", ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-mf16c", "-mbmi", "-mbmi2"]),
]
CPU_KERNEL_SOURCES = sorted(glob.glob(os.path.join("csrc", "kernels", "cpu", "*.cpp")))


def _build_cpu_capabilities() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64") and os.name == "posix"


class _BuildExtension(BuildExtension):
    """Compiles each CPU kernel file once more per instruction set (its own objects, flags and
    ``CPU_CAPABILITY`` namespace) and links those objects after the others, so that the linker
    keeps the baseline copy of any inline function they share."""

    def build_extension(self, ext) -> None:
        if _build_cpu_capabilities():
            base_flags = ext.extra_compile_args["cxx"] if isinstance(ext.extra_compile_args, dict) else []
            for name, flags in CPU_CAPABILITIES:
                macros = [m for m in ext.define_macros if m[0] != "MEGATRON_EXT_WITH_CUDA"]
                macros += [("CPU_CAPABILITY", name), (f"CPU_CAPABILITY_{name}", None)]
                ext.extra_objects += self.compiler.compile(
                    CPU_KERNEL_SOURCES,
                    output_dir=os.path.join(self.build_temp, f"cpu_{name.lower()}"),
                    macros=macros,
                    include_dirs=ext.include_dirs,
                    extra_postargs={"cxx": base_flags + flags} if self.use_ninja else base_flags + flags,
                    depends=ext.depends,
                )
        super().build_extension(ext)


def _cuda_translation_unit(generated: str, cuda_sources: list[str]) -> str:
    """One generated source that includes every CUDA source: nvcc parses torch's headers for the
    device and the host pass of each translation unit (about 45 s of a 2-core machine's time
    each, against 2 s for a kernel alone), so the kernels compile as one."""
    text = "".join(f'#include "{os.path.relpath(f, "csrc")}"\n' for f in cuda_sources)
    path = os.path.join(generated, "megatron_ext_cuda_kernels.cu")
    if not os.path.exists(path) or open(path).read() != text:
        with open(path, "w") as f:
            f.write(text)
    return path


def _pip_cuda_include_dirs() -> list[str]:
    """Headers of the CUDA libraries torch's wheel depends on (cuSPARSE, cuBLAS, ...), which a
    toolkit holding only the compiler lacks."""
    try:
        import nvidia
    except ImportError:
        return []
    return sorted(d for root in nvidia.__path__ for d in glob.glob(os.path.join(root, "*", "include")))


def _extension():
    _check_torch_version()
    here = os.path.dirname(os.path.abspath(__file__))
    cpp_sources = sorted(glob.glob(os.path.join("csrc", "**", "*.cpp"), recursive=True))
    cuda_sources = sorted(glob.glob(os.path.join("csrc", "**", "*.cu"), recursive=True))
    cuda = _want_cuda()
    if cuda and not torch.cuda.is_available() and not os.environ.get("TORCH_CUDA_ARCH_LIST"):
        # torch's arch detection queries a device; without one it fails.
        os.environ["TORCH_CUDA_ARCH_LIST"] = DEFAULT_CUDA_ARCHS
    generated = _write_build_config(cuda)
    include_dirs = [os.path.join(here, "csrc"), generated]
    isa_macros = (
        [(f"MEGATRON_EXT_CPU_{name}", None) for name, _ in CPU_CAPABILITIES]
        if _build_cpu_capabilities()
        else []
    )
    # No floating-point contraction: a CPU kernel rounds each product its source writes, as the torch
    # ops it is compared with do (a fused multiply-add appears only where written out).
    # torch's headers take the per-operator <ATen/ops/*.h> instead of all operators' declarations
    # (as PyTorch builds itself), so a source pays only for the headers it includes (compile time).
    # -g0: Python's build flags ask for debug info, which for torch's templates costs a third of each
    # C++ source's compile time; MEGATRON_EXT_DEBUG=1 keeps it.
    cxx_flags = ["-O3", "-std=c++20", "-ffp-contract=off", "-DAT_PER_OPERATOR_HEADERS"]
    if not _flag("MEGATRON_EXT_DEBUG"):
        cxx_flags.append("-g0")
    werror = _flag("MEGATRON_EXT_WERROR")
    # torch's headers as system headers, so that warnings-as-errors judges this project's code only.
    torch_includes = include_paths(device_type="cuda" if cuda else "cpu")
    system_includes = [flag for d in torch_includes for flag in ("-isystem", d)]
    if werror:
        # GCC 12 reports the AVX-512 intrinsics' own _mm512_undefined_* results as
        # maybe-uninitialized once ATen's Vectorized code is inlined into ours: a false positive
        # it raises inside its own headers, so it stays a warning.
        cxx_flags += system_includes + ["-Wall", "-Werror", "-Wno-error=maybe-uninitialized"]
    if not cuda:
        return CppExtension(
            "megatron_ext._C",
            cpp_sources,
            include_dirs=include_dirs,
            define_macros=isa_macros,
            extra_compile_args={"cxx": cxx_flags},
        )
    nvcc_flags = [
        "-O3",
        "-std=c++20",
        "--expt-relaxed-constexpr",
        "-DMEGATRON_EXT_WITH_CUDA",
        "-DAT_PER_OPERATOR_HEADERS",
    ]
    if werror:
        nvcc_flags += system_includes + ["-Werror=all-warnings", "-Xcompiler=-Wall,-Werror"]
    return CUDAExtension(
        "megatron_ext._C",
        cpp_sources + [_cuda_translation_unit(generated, cuda_sources)],
        include_dirs=include_dirs + _pip_cuda_include_dirs(),
        define_macros=[("MEGATRON_EXT_WITH_CUDA", None)] + isa_macros,
        extra_compile_args={"cxx": cxx_flags, "nvcc": nvcc_flags},
    )


setup(
    name="megatron_ext",
    version="0.1.0",
    packages=find_packages(include=["megatron_ext", "megatron_ext.*"]),
    package_data={"megatron_ext.training": ["megatron_lm_flags.txt"]},
    entry_points={"console_scripts": ["megatron-ext-train = megatron_ext.training.training:run"]},
    ext_modules=[_extension()],
    cmdclass={"build_ext": _BuildExtension.with_options(use_ninja=True)},
    python_requires=">=3.10",
    install_requires=[f"torch>={MIN_TORCH}"],
)
