// Module `_torch_reads`: the call key's reads of torch (torch_reads.h) through torch's C++ API.
//
// Through torch's Python functions each state reader costs 30-120 ns (a call that installs torch's
// warning handler; autocast asks each device type), and a tensor's read through the DLPack
// exchange API about 60 ns (a pybind11 cast), with its lazy bits and requires_grad asked through
// Python besides. Here a read is a few loads from the tensor's TensorImpl and torch's thread-local
// state. What it answers is what torch's readers answer: kernel_api.native compares the two on
// sample tensors of every dtype it maps and on toggled states before handing this table over. This module is built only against the torch it runs with (setup.py records the version;
// kernel_api.native compares it), since it depends on torch's C++ ABI.
#include <Python.h>

#include <ATen/DLConvertor.h>
#include <ATen/PythonTorchFunctionTLS.h>
#include <ATen/autocast_mode.h>
#include <c10/core/GradMode.h>
#include <c10/core/impl/TorchDispatchModeTLS.h>
#include <torch/csrc/autograd/python_variable.h>

#include "torch_reads.h"

namespace {

using kernel_api_native::TorchReads;

// The DLPack type of the dtypes read here (torch's own mapping, which kernel_api.native checks
// against the exchange API's on every one of them); false for any other dtype.
bool DLType(c10::ScalarType type, DLDataType* out) {
  uint8_t code;
  uint8_t bits;
  switch (type) {
    case c10::ScalarType::Byte: code = kDLUInt, bits = 8; break;
    case c10::ScalarType::Char: code = kDLInt, bits = 8; break;
    case c10::ScalarType::Short: code = kDLInt, bits = 16; break;
    case c10::ScalarType::Int: code = kDLInt, bits = 32; break;
    case c10::ScalarType::Long: code = kDLInt, bits = 64; break;
    case c10::ScalarType::Half: code = kDLFloat, bits = 16; break;
    case c10::ScalarType::Float: code = kDLFloat, bits = 32; break;
    case c10::ScalarType::Double: code = kDLFloat, bits = 64; break;
    case c10::ScalarType::BFloat16: code = kDLBfloat, bits = 16; break;
    case c10::ScalarType::Bool: code = kDLBool, bits = 8; break;
    case c10::ScalarType::ComplexFloat: code = kDLComplex, bits = 64; break;
    case c10::ScalarType::ComplexDouble: code = kDLComplex, bits = 128; break;
    default: return false;
  }
  *out = DLDataType{code, bits, 1};
  return true;
}

int ReadTensor(PyObject* object, void* out_pointer, int* lazy_bit, int* requires_grad) {
  try {
    const at::Tensor& tensor = THPVariable_Unpack(object);
    if (!tensor.defined()) return 0;
    c10::TensorImpl* impl = tensor.unsafeGetTensorImpl();
    // Only what torch's exchange API describes plainly: a subclass that dispatches to Python
    // (FakeTensor, FunctionalTensor), a symbolic shape, another layout, device or dtype goes its way.
    if (impl->is_python_dispatch() || impl->has_symbolic_sizes_strides() || impl->layout() != c10::kStrided ||
        !impl->has_storage()) {
      return 0;
    }
    auto* out = static_cast<DLTensor*>(out_pointer);
    const c10::Device device = impl->device();
    if (device.is_cpu()) {
      out->device = DLDevice{kDLCPU, 0};
    } else if (device.is_cuda()) {
      out->device = DLDevice{kDLCUDA, device.index()};
    } else {
      return 0;
    }
    if (!DLType(tensor.scalar_type(), &out->dtype)) return 0;
    // (mutable: a copy-on-write storage is materialised, as for any tensor a kernel may write)
    out->data = impl->mutable_data();
    out->byte_offset = 0;
    out->ndim = static_cast<int32_t>(impl->dim());
    out->shape = const_cast<int64_t*>(impl->sizes().data());
    out->strides = const_cast<int64_t*>(impl->strides().data());
    *lazy_bit = impl->is_neg() ? 1 : impl->is_conj() ? 2 : 0;
    *requires_grad = impl->requires_grad() ? 1 : 0;
    return 1;
  } catch (...) {  // (a storage that refuses its pointer, ...: the exchange API reports it)
    return 0;
  }
}

// The dispatch keys of autocast for every device type it knows: autocast is enabled for a device
// type while its key is not in the thread's excluded set (at::autocast::is_autocast_enabled).
c10::DispatchKeySet AutocastKeys() {
  c10::DispatchKeySet keys;
  for (const c10::DeviceType device : at::autocast::_AUTOCAST_SUPPORTED_DEVICES) {
    keys = keys | c10::DispatchKeySet(at::autocast::get_autocast_dispatch_key_from_device_type(device));
  }
  return keys;
}

int64_t State() {
  static const c10::DispatchKeySet autocast_keys = AutocastKeys();
  int64_t bits = 0;
  if (c10::GradMode::is_enabled()) bits |= kernel_api_native::kGradMode;
  if (c10::impl::TorchDispatchModeTLS::stack_len() > 0) bits |= kernel_api_native::kDispatchMode;
  if (at::impl::torch_function_mode_enabled()) bits |= kernel_api_native::kFunctionMode;
  // Any device type's autocast: a superset of what torch._C._is_any_autocast_enabled asks (a key
  // that says more than needed only misses a replay, never finds a wrong one).
  if (!(autocast_keys - c10::impl::tls_local_dispatch_key_set().excluded_).empty()) {
    bits |= kernel_api_native::kAutocast;
  }
  return bits;
}

const TorchReads reads = {kernel_api_native::kTorchReadsAbi, ReadTensor, State};

PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_torch_reads", nullptr, -1, nullptr,
                          nullptr, nullptr, nullptr, nullptr};

}  // namespace

// Set by setup.py; kernel_api.native refuses a module built for another torch or other sources.
#ifndef KERNEL_API_TORCH_VERSION
#define KERNEL_API_TORCH_VERSION ""
#endif
#ifndef KERNEL_API_SOURCE_DIGEST
#define KERNEL_API_SOURCE_DIGEST ""
#endif

extern "C" __attribute__((visibility("default"))) PyObject* PyInit__torch_reads() {
  PyObject* module = PyModule_Create(&module_def);
  if (module == nullptr) return nullptr;
#ifdef Py_GIL_DISABLED
  PyUnstable_Module_SetGIL(module, Py_MOD_GIL_USED);
#endif
  PyObject* capsule =
      PyCapsule_New(const_cast<TorchReads*>(&reads), kernel_api_native::kTorchReadsCapsule, nullptr);
  if (capsule == nullptr || PyModule_AddObject(module, "reads", capsule) != 0) {
    Py_XDECREF(capsule);
    Py_DECREF(module);
    return nullptr;
  }
  if (PyModule_AddStringConstant(module, "torch_version", KERNEL_API_TORCH_VERSION) != 0 ||
      PyModule_AddStringConstant(module, "source_digest", KERNEL_API_SOURCE_DIGEST) != 0) {
    Py_DECREF(module);
    return nullptr;
  }
  return module;
}
