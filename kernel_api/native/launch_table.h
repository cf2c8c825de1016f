// Tensor keys and overlap checks shared by the TVM-FFI entry points (launch_table.cc) and the
// CPython ones (python_entry.cc), which are built into the same library.
#pragma once

#include <dlpack/dlpack.h>
#include <tvm/ffi/c_api.h>

#include <cstdint>
#include <string>

namespace kernel_api_native {

constexpr int kMaxTensors = 8;
constexpr int kMaxTail = 16;

// The key of (tag, tensors): their dtypes, devices, shapes, strides and the low 10 bits of their
// data pointers. False when some tensor cannot be keyed (more than 8 dimensions, or no memory
// behind a non-empty tensor: a tracer's fake tensor).
bool TensorKey(int64_t tag, const TVMFFIAny* tensors, int count, std::string* key);

// Appends one tensor's metadata to `key` (its dtype, device, shape, strides and the low 10 bits of
// its data pointer): the tensor part of every key. False when it cannot be keyed (more than 8
// dimensions, or no memory behind a non-empty tensor).
bool AppendTensorKey(const DLTensor* t, std::string* key);

// The words AppendTensorKey appends, written to `words` (room for kMaxTensorWords): how many, or
// -1 when the tensor cannot be keyed.
constexpr int kMaxTensorWords = 3 + 2 * 8;
int TensorKeyWords(const DLTensor* t, int64_t* words);

// Whether the last of `tensors` (the one a launch writes) may share memory with another of them.
// Conservative (byte ranges): such calls go back to Python, which judges them exactly.
bool OutputMayOverlap(const TVMFFIAny* tensors, int count);

}  // namespace kernel_api_native
