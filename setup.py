"""Builds kernel_api's optional native module; the project's metadata is in pyproject.toml.

`kernel_api.native._launch_table` (launch_table.cc + python_entry.cc) is compiled against the
headers of the tvm_ffi found at build time. It is not linked to libtvm_ffi: a build-isolated
install finds tvm_ffi in a temporary environment that is gone at run time, so the module leaves
the TVM-FFI symbols unresolved and kernel_api.native imports tvm_ffi first (which loads
libtvm_ffi with RTLD_GLOBAL). Where the module cannot be built (no compiler, no tvm_ffi, no
Python headers) the install still succeeds, with a warning, and kernel_api runs its Python paths.
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


class BuildNativeIfPossible(build_ext):
    """build_ext that turns any failure to build the native module into a warning."""

    def build_extension(self, ext: Extension) -> None:
        try:
            import tvm_ffi
            from tvm_ffi import libinfo

            ext.include_dirs += dict.fromkeys([libinfo.find_include_path(), libinfo.find_dlpack_include_path()])
            # Checked by kernel_api.native at import: a module built for other sources or another
            # TVM-FFI is refused rather than trusted.
            digest = runpy.run_path(str(NATIVE / "sources.py"))["digest"](NATIVE)
            ext.define_macros += [("KERNEL_API_TVM_FFI_VERSION", f'"{tvm_ffi.__version__}"'),
                                  ("KERNEL_API_SOURCE_DIGEST", f'"{digest}"')]
            super().build_extension(ext)
        except Exception as exc:  # noqa: BLE001 - whatever stops the build, the install goes on
            self.warn(f"kernel_api: the native module {ext.name} was not built ({type(exc).__name__}: {exc}); "
                      "kernel_api will run its Python paths. Reinstall with a C++ compiler and tvm_ffi "
                      "available for the fast path.")

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

setup(ext_modules=[native], cmdclass={"build_ext": BuildNativeIfPossible})
