// The table the torch-linked module (`_torch_reads`, torch_reads.cc) hands the CPython entry
// points (python_entry.cc) in a capsule: what the call key reads of torch, read through torch's
// C++ API instead of its Python functions. Built against the installed torch's headers, it is
// loaded only for that torch (kernel_api.native checks the version and compares its answers with
// torch's Python readers and DLPack exchange API before handing it over).
#pragma once

#include <Python.h>

#include <cstdint>

namespace kernel_api_native {

constexpr uint32_t kTorchReadsAbi = 1;
constexpr const char* kTorchReadsCapsule = "kernel_api.torch_reads";

// The state bits of a call key: each what one of torch's readers answers now.
enum StateBit : int64_t { kGradMode = 1, kDispatchMode = 2, kFunctionMode = 4, kAutocast = 8, kTf32 = 16 };

struct TorchReads {
  uint32_t abi;  // kTorchReadsAbi
  // Reads a plain tensor (torch.Tensor or a subclass without __torch_dispatch__, strided, on the
  // CPU or a CUDA device): fills *out (a DLTensor) as torch's DLPack exchange API does, sets
  // *lazy_bit (0 none, 1 the negative bit, 2 the conjugate bit) and *requires_grad, and returns 1.
  // Returns 0, with no Python error, for anything else (read it the exchange API's way).
  int (*tensor)(PyObject* object, void* out, int* lazy_bit, int* requires_grad);
  // kGradMode | kDispatchMode | kFunctionMode | kAutocast as torch's state stands: grad mode, a
  // torch dispatch mode on the stack, a torch function mode enabled, autocast enabled for any
  // device type that has it.
  int64_t (*state)();
};

}  // namespace kernel_api_native
