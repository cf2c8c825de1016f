"""Builds kernel_api's optional native module; the project's metadata is in pyproject.toml.

`kernel_api.native._launch_table` (launch_table.cc + python_entry.cc) is compiled against the
headers of the tvm_ffi found at build time. It is not linked to libtvm_ffi: a build-isolated
install finds tvm_ffi in a temporary environment that is gone at run time, so the module leaves
the TVM-FFI symbols unresolved and kernel_api.native imports tvm_ffi first (which loads
libtvm_ffi with RTLD_GLOBAL). Where the module cannot be built (no compiler, no tvm_ffi, no
Python headers) the install still succeeds, with a warning, and kernel_api runs its Python paths.

`kernel_api.native._torch_reads` (torch_reads.cc) reads what the call key needs of torch through
torch's C++ API. It is built against the headers and libraries of the torch importable at build
time, and only then (an install without build isolation, as scripts/install.sh does); it records
that torch's version, and kernel_api.native uses it only with that torch.
"""

from __future__ import annotations

import os
import runpy
import shutil
import sys
import tempfile
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

NATIVE = Path("kernel_api", "native")


def _source_digest(names: str) -> tuple[str, str]:
    """The macro a module is built with: the digest of its sources (``sources.<names>``), which
    kernel_api.native compares with the sources beside the module."""
    sources = runpy.run_path(str(NATIVE / "sources.py"))
    return "KERNEL_API_SOURCE_DIGEST", f'"{sources["digest"](NATIVE, sources[names])}"'


class BuildNativeIfPossible(build_ext):
    """build_ext that turns any failure to build the native module into a warning."""

    def build_extension(self, ext: Extension) -> None:
        if ext.name.endswith("_torch_reads"):
            self._build_torch_reads(ext)
            return
        if ext.name.endswith("_front_door"):
            try:
                ext.define_macros += [_source_digest("FRONT_DOOR_NAMES")]
                super().build_extension(ext)
            except Exception as exc:  # noqa: BLE001 - the module is optional
                self.warn(f"kernel_api: {ext.name} was not built ({type(exc).__name__}: {exc}); "
                          "kernel_api.ops' front doors stay Python functions")
            return
        try:
            import tvm_ffi
            from tvm_ffi import libinfo

            ext.include_dirs += dict.fromkeys([libinfo.find_include_path(), libinfo.find_dlpack_include_path()])
            # Checked by kernel_api.native at import: a module built for other sources or another
            # TVM-FFI is refused rather than trusted.
            ext.define_macros += [("KERNEL_API_TVM_FFI_VERSION", f'"{tvm_ffi.__version__}"'),
                                  _source_digest("NAMES")]
            super().build_extension(ext)
        except Exception as exc:  # noqa: BLE001 - whatever stops the build, the install goes on
            self.warn(f"kernel_api: the native module {ext.name} was not built ({type(exc).__name__}: {exc}); "
                      "kernel_api will run its Python paths. Reinstall with a C++ compiler and tvm_ffi "
                      "available for the fast path.")

    def _build_torch_reads(self, ext: Extension) -> None:
        try:
            import torch
            from torch.utils.cpp_extension import include_paths, library_paths

            libraries = library_paths()
            ext.include_dirs += include_paths()
            ext.library_dirs += libraries
            ext.runtime_library_dirs += libraries
            ext.define_macros += [("KERNEL_API_TORCH_VERSION", f'"{torch.__version__}"'),
                                  _source_digest("TORCH_READS_NAMES"),
                                  ("_GLIBCXX_USE_CXX11_ABI", str(int(torch._C._GLIBCXX_USE_CXX11_ABI)))]
            super().build_extension(ext)
        except Exception as exc:  # noqa: BLE001 - the module is optional
            self.warn(f"kernel_api: {ext.name} was not built ({type(exc).__name__}: {exc}); the call key reads "
                      "torch through its Python functions (about 0.3 us more per repeated ops call)")

    def copy_file(self, infile: str, outfile: str, *args, **kwargs):
        """Copies a built module into the source tree (editable installs) atomically: a process
        that has the old file mapped keeps it whole instead of dying with SIGBUS."""
        if not os.path.exists(infile):  # the build failed and warned
            return outfile, False
        folder, name = os.path.split(outfile)
        with tempfile.NamedTemporaryFile(dir=folder or ".", prefix=name + ".", suffix=".part", delete=False) as partial:
            with open(infile, "rb") as source:
                shutil.copyfileobj(source, partial)
        shutil.copymode(infile, partial.name)
        os.replace(partial.name, outfile)
        return outfile, True


native = Extension(
    "kernel_api.native._launch_table",
    sources=[str(NATIVE / "launch_table.cc"), str(NATIVE / "python_entry.cc")],
    depends=[str(NATIVE / "launch_table.h")],
    language="c++",
    extra_compile_args=["-std=c++17", "-O2", "-fvisibility=hidden"],
    # The TVM-FFI symbols stay unresolved until import (see above); macOS links only when told so.
    extra_link_args=["-undefined", "dynamic_lookup"] if sys.platform == "darwin" else [],
    optional=True,
)

torch_reads = Extension(
    "kernel_api.native._torch_reads",
    sources=[str(NATIVE / "torch_reads.cc")],
    depends=[str(NATIVE / "torch_reads.h")],
    language="c++",
    # torch's headers need C++17 (2.4-2.12) or take C++20 (2.13 warns under 17): 20 serves both
    extra_compile_args=["-std=c++20", "-O2", "-fvisibility=hidden"],
    libraries=["c10", "torch_cpu", "torch_python"],
    optional=True,
)

front_door = Extension(
    "kernel_api.native._front_door",
    sources=[str(NATIVE / "front_door.cc")],
    language="c++",
    extra_compile_args=["-std=c++17", "-O2", "-fvisibility=hidden"],
    optional=True,
)

setup(ext_modules=[native, torch_reads, front_door], cmdclass={"build_ext": BuildNativeIfPossible})
