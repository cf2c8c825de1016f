#!/usr/bin/env bash
# Shrinks the CuTe DSL pack that ../shared/device/pack-dsl.sh writes (.carry/dsl.tar.xz) by the
# parts no test or benchmark here loads, so the tree and the pack fit the 64 MiB a device run
# carries: the top-level `iket` profiler package, and TVM-FFI's bundled libbacktrace sources, C++
# sources and Cython sources. It keeps what the native launch table's build needs (TVM-FFI's
# headers and dlpack headers) and libtvm_ffi_testing.so, which tvm_ffi.core links. About 1.3 MiB
# off the pack (55.9 -> 54.6 MB); ~6 minutes of single-threaded xz.
#
#   scripts/slim-dsl-pack.sh            # from the project root, after pack-dsl.sh
set -euo pipefail
pack=.carry/dsl.tar.xz
[ -f "$pack" ] || { echo "no $pack: run ../shared/device/pack-dsl.sh first" >&2; exit 1; }
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
tar -xJf "$pack" -C "$tmp"
rm -rf "$tmp/nvidia_cutlass_dsl/dsl_packages/iket" "$tmp/tvm_ffi/3rdparty/libbacktrace" "$tmp/tvm_ffi/src" \
       "$tmp/tvm_ffi/cython"
tar -C "$tmp" --sort=name -cf - . | xz -T1 --x86 --lzma2=preset=9e,dict=256MiB > "$pack.part"
mv "$pack.part" "$pack"
echo "slimmed $pack to $(($(stat -c %s "$pack") / 1048576)) MiB"
