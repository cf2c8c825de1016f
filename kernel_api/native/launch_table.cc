// The TVM-FFI face of the native library: recorded CUDA launches, and the tensor keys and
// overlap checks the CPython entry points (python_entry.cc) build their call keys with. Only the
// C ABI of TVM-FFI is used (c_api.h), so this builds in about a second against the headers of
// the installed tvm_ffi wheel.
//
// Exported through the TVM-FFI packed-call ABI (`tvm_ffi.load_module(...).<name>`):
//   cuda_launch(kernel, n_tensors, grid_x, grid_y, grid_z, block_x, block_y, block_z, shared_bytes,
//               *parameters) -> function
//       a TVM-FFI function(*tensors, stream) that launches a CUDA kernel (a CUfunction or CUkernel
//       handle) with cuLaunchKernel: what a Python launch recorded, replayed. `parameters` are
//       pairs (kind, value), one per kernel parameter: kind 0 is the data pointer of tensor
//       `value`, kind 4 or 8 a constant of that many bytes. See "Recorded CUDA launches" below.
// `stream` None means the stream TVM-FFI set for the first tensor's device for this call (the
// producer's current stream: torch's, for torch tensors); anything else is passed on as it is.
// DLPack has no lazy negative or conjugate bit: callers passing torch tensors decline tensors
// carrying one (python_entry.cc's entry points do it in C).

#include <dlpack/dlpack.h>
#include <tvm/ffi/c_api.h>
#include <tvm/ffi/extra/c_env_api.h>

#include "launch_table.h"

#include <dlfcn.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

namespace {

using kernel_api_native::kMaxTail;
using kernel_api_native::kMaxTensors;
constexpr int kMaxNdim = 8;

const DLTensor* AsTensor(const TVMFFIAny& value) {
  if (value.type_index == kTVMFFITensor) return TVMFFITensorGetDLTensorPtr(value.v_obj);
  if (value.type_index == kTVMFFIDLTensorPtr) return static_cast<const DLTensor*>(value.v_ptr);
  return nullptr;
}

// The bytes [first, end) a tensor's elements lie in (empty for an empty tensor).
void ByteRange(const DLTensor* t, uintptr_t* first, uintptr_t* end) {
  int64_t span = 0;
  for (int i = 0; i < t->ndim; ++i) {
    if (t->shape[i] == 0) {
      *first = *end = 0;
      return;
    }
    int64_t stride = 1;
    if (t->strides != nullptr) {
      stride = t->strides[i];
    } else {
      for (int j = i + 1; j < t->ndim; ++j) stride *= t->shape[j];
    }
    span += (t->shape[i] - 1) * (stride < 0 ? -stride : stride);
  }
  const uintptr_t bytes = (static_cast<uintptr_t>(t->dtype.bits) * t->dtype.lanes + 7) / 8;
  *first = reinterpret_cast<uintptr_t>(t->data) + static_cast<uintptr_t>(t->byte_offset);
  *end = *first + static_cast<uintptr_t>(span + 1) * bytes;
}

int RaiseError(const char* kind, const char* message) {
  TVMFFIErrorSetRaisedFromCStr(kind, message);
  return -1;
}

// ---- Recorded CUDA launches ------------------------------------------------------------------
//
// A kernel that Python launched through the CUDA driver (a cuda_src kernel's cuda.core launch),
// replayed as a TVM-FFI function(*tensors, stream): cuLaunchKernel with the grid, block, shared
// memory and parameters Python recorded, the tensors' data pointers read at each call. So the
// table, bound launches and the entry points take such kernels as they take compiled TVM-FFI
// functions. The driver is opened once, when the first such function is made; on a machine
// without one making it fails, and the caller keeps its Python launch.

using CuLaunchKernel = int (*)(void*, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, void*,
                               void**, void**);
using CuCtxGetDevice = int (*)(int*);
using CuDevicePrimaryCtxRetain = int (*)(void**, int);
using CuCtxPushCurrent = int (*)(void*);
using CuCtxPopCurrent = int (*)(void**);
using CuGetErrorName = int (*)(int, const char**);

struct Driver {
  CuLaunchKernel launch = nullptr;
  CuCtxGetDevice context_device = nullptr;
  CuDevicePrimaryCtxRetain primary_context = nullptr;
  CuCtxPushCurrent push = nullptr;
  CuCtxPopCurrent pop = nullptr;
  CuGetErrorName error_name = nullptr;
};

// The driver's entry points, or nullptr with the reason in *why.
const Driver* FindDriver(std::string* why) {
  static std::once_flag once;
  static Driver driver;
  static std::string error;
  std::call_once(once, [] {
    void* library = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (library == nullptr) library = dlopen("libcuda.so", RTLD_NOW | RTLD_LOCAL);
    if (library == nullptr) {
      const char* reason = dlerror();
      error = std::string("the CUDA driver (libcuda.so.1) could not be opened: ") + (reason ? reason : "not found");
      return;
    }
    driver.launch = reinterpret_cast<CuLaunchKernel>(dlsym(library, "cuLaunchKernel"));
    driver.context_device = reinterpret_cast<CuCtxGetDevice>(dlsym(library, "cuCtxGetDevice"));
    driver.primary_context = reinterpret_cast<CuDevicePrimaryCtxRetain>(dlsym(library, "cuDevicePrimaryCtxRetain"));
    driver.push = reinterpret_cast<CuCtxPushCurrent>(dlsym(library, "cuCtxPushCurrent_v2"));
    driver.pop = reinterpret_cast<CuCtxPopCurrent>(dlsym(library, "cuCtxPopCurrent_v2"));
    driver.error_name = reinterpret_cast<CuGetErrorName>(dlsym(library, "cuGetErrorName"));
    if (driver.launch == nullptr || driver.context_device == nullptr || driver.primary_context == nullptr ||
        driver.push == nullptr || driver.pop == nullptr || driver.error_name == nullptr) {
      error = "the CUDA driver lacks cuLaunchKernel or the context functions";
    }
  });
  if (!error.empty()) {
    *why = error;
    return nullptr;
  }
  return &driver;
}

constexpr int kMaxParameters = 64;
constexpr int kMaxDevices = 64;

// The primary context of each device, retained once (as torch's runtime keeps it) for launches
// from a thread whose current context is another device's or none.
void* PrimaryContext(const Driver& driver, int device) {
  static std::mutex mutex;
  static void* contexts[kMaxDevices] = {};
  if (device < 0 || device >= kMaxDevices) return nullptr;
  std::lock_guard<std::mutex> lock(mutex);
  if (contexts[device] == nullptr && driver.primary_context(&contexts[device], device) != 0) contexts[device] = nullptr;
  return contexts[device];
}

struct CudaLaunch {
  const Driver* driver = nullptr;
  void* kernel = nullptr;  // a CUfunction or CUkernel
  unsigned grid[3] = {1, 1, 1};
  unsigned block[3] = {1, 1, 1};
  unsigned shared = 0;
  int n_tensors = 0;
  int n_parameters = 0;
  int kind[kMaxParameters] = {};  // 0: tensor `value`'s data pointer; 4 or 8: a constant of that many bytes
  uint64_t value[kMaxParameters] = {};
};

int RaiseCudaError(const Driver& driver, int status, const char* what) {
  const char* name = nullptr;
  if (driver.error_name(status, &name) != 0 || name == nullptr) name = "an unknown error";
  char message[256];
  std::snprintf(message, sizeof(message), "%s failed: %s (%d)", what, name, status);
  return RaiseError("RuntimeError", message);
}

int CallCudaLaunch(void* self, const TVMFFIAny* args, int32_t num_args, TVMFFIAny* result) {
  const auto* launch = static_cast<const CudaLaunch*>(self);
  if (num_args != launch->n_tensors + 1) {
    return RaiseError("TypeError", "a recorded CUDA launch takes its tensors, then the stream");
  }
  const DLTensor* tensors[kMaxTensors];
  for (int i = 0; i < launch->n_tensors; ++i) {
    tensors[i] = AsTensor(args[i]);
    if (tensors[i] == nullptr) return RaiseError("TypeError", "a recorded CUDA launch takes tensors before the stream");
  }
  const DLDevice device = tensors[0]->device;
  if (device.device_type != kDLCUDA) return RaiseError("ValueError", "a recorded CUDA launch takes CUDA tensors");
  void* stream = nullptr;
  const TVMFFIAny& given = args[launch->n_tensors];
  if (given.type_index == kTVMFFINone) {
    stream = TVMFFIEnvGetStream(device.device_type, device.device_id);
  } else if (given.type_index == kTVMFFIOpaquePtr) {
    stream = given.v_ptr;
  } else if (given.type_index == kTVMFFIInt) {
    stream = reinterpret_cast<void*>(static_cast<uintptr_t>(given.v_int64));
  } else {
    return RaiseError("TypeError", "a recorded CUDA launch takes its stream as None, a pointer or an int");
  }
  uint64_t storage[kMaxParameters];
  void* parameters[kMaxParameters];
  for (int p = 0; p < launch->n_parameters; ++p) {
    if (launch->kind[p] == 0) {
      const DLTensor* t = tensors[launch->value[p]];
      storage[p] = reinterpret_cast<uintptr_t>(t->data) + static_cast<uint64_t>(t->byte_offset);
    } else {
      storage[p] = launch->value[p];  // (4-byte constants: the low bytes, read in place on little-endian hosts)
    }
    parameters[p] = &storage[p];
  }
  const Driver& driver = *launch->driver;
  int current = -1;
  void* pushed = nullptr;
  if (driver.context_device(&current) != 0 || current != device.device_id) {
    // No context, or another device's: the tensors' device's primary context for this launch.
    pushed = PrimaryContext(driver, device.device_id);
    if (pushed == nullptr) return RaiseError("RuntimeError", "the tensors' device has no primary context");
    const int status = driver.push(pushed);
    if (status != 0) return RaiseCudaError(driver, status, "cuCtxPushCurrent");
  }
  const int status = driver.launch(launch->kernel, launch->grid[0], launch->grid[1], launch->grid[2], launch->block[0],
                                   launch->block[1], launch->block[2], launch->shared, stream, parameters, nullptr);
  if (pushed != nullptr) {
    void* popped = nullptr;
    driver.pop(&popped);
  }
  if (status != 0) return RaiseCudaError(driver, status, "cuLaunchKernel");
  result->type_index = kTVMFFINone;
  result->zero_padding = 0;
  result->v_int64 = 0;
  return 0;
}

void DeleteCudaLaunch(void* self) { delete static_cast<CudaLaunch*>(self); }

}  // namespace

namespace kernel_api_native {

bool OutputMayOverlap(const TVMFFIAny* tensors, int count) {
  uintptr_t out_first, out_end;
  ByteRange(AsTensor(tensors[count - 1]), &out_first, &out_end);
  if (out_first == out_end) return false;
  for (int i = 0; i < count - 1; ++i) {
    uintptr_t first, end;
    ByteRange(AsTensor(tensors[i]), &first, &end);
    if (first < out_end && out_first < end) return true;
  }
  return false;
}

bool AppendTensorKey(const DLTensor* t, std::string* key) {
  int64_t words[kMaxTensorWords];
  const int n = TensorKeyWords(t, words);
  if (n < 0) return false;
  key->append(reinterpret_cast<const char*>(words), sizeof(int64_t) * n);
  return true;
}

static_assert(kMaxTensorWords == 3 + 2 * kMaxNdim, "a tensor's key words: dtype, device, rank and alignment, shape, strides");

int TensorKeyWords(const DLTensor* t, int64_t* words) {
  if (t->ndim < 0 || t->ndim > kMaxNdim) return -1;
  if (t->data == nullptr) {
    // No memory behind a non-empty tensor: a fake tensor of a tracer, never launched from here.
    bool empty = false;
    for (int i = 0; i < t->ndim; ++i) empty = empty || t->shape[i] == 0;
    if (!empty) return -1;
  }
  int n = 0;
  words[n++] = (static_cast<int64_t>(t->dtype.code) << 32) | (static_cast<int64_t>(t->dtype.bits) << 16) |
               t->dtype.lanes;
  words[n++] = (static_cast<int64_t>(t->device.device_type) << 32) | static_cast<uint32_t>(t->device.device_id);
  uintptr_t address = reinterpret_cast<uintptr_t>(t->data) + static_cast<uintptr_t>(t->byte_offset);
  words[n++] = (static_cast<int64_t>(t->ndim) << 16) | static_cast<int64_t>(address & 1023);
  for (int i = 0; i < t->ndim; ++i) words[n++] = t->shape[i];
  for (int i = 0; i < t->ndim; ++i) {
    // DLPack allows strides == NULL for a compact row-major tensor; key that as its strides.
    if (t->strides != nullptr) {
      words[n++] = t->strides[i];
    } else {
      int64_t stride = 1;
      for (int j = i + 1; j < t->ndim; ++j) stride *= t->shape[j];
      words[n++] = stride;
    }
  }
  return n;
}

bool TensorKey(int64_t tag, const TVMFFIAny* tensors, int count, std::string* key) {
  key->reserve(sizeof(int64_t) * (2 + count * (4 + 2 * 3)));
  int64_t head[2] = {tag, count};
  key->append(reinterpret_cast<const char*>(head), sizeof(head));
  for (int i = 0; i < count; ++i) {
    const DLTensor* t = AsTensor(tensors[i]);
    if (t == nullptr || !AppendTensorKey(t, key)) return false;
  }
  return true;
}


}  // namespace kernel_api_native

extern "C" {

TVM_FFI_DLL_EXPORT int __tvm_ffi_cuda_launch(void*, const TVMFFIAny* args, int32_t num_args, TVMFFIAny* result) {
  const char* usage = "cuda_launch(kernel: int, n_tensors: int, grid_x, grid_y, grid_z, block_x, block_y, block_z, "
                      "shared_bytes: int, *parameters: (kind, value) pairs of ints)";
  if (num_args < 9 || (num_args - 9) % 2 != 0 || (num_args - 9) / 2 > kMaxParameters) {
    return RaiseError("TypeError", usage);
  }
  for (int i = 0; i < num_args; ++i) {
    if (args[i].type_index != kTVMFFIInt && !(i == 0 && args[i].type_index == kTVMFFIOpaquePtr)) {
      return RaiseError("TypeError", usage);
    }
  }
  auto launch = std::make_unique<CudaLaunch>();
  launch->kernel = args[0].type_index == kTVMFFIOpaquePtr ? args[0].v_ptr
                                                          : reinterpret_cast<void*>(static_cast<uintptr_t>(args[0].v_int64));
  const int64_t n_tensors = args[1].v_int64;
  if (launch->kernel == nullptr || n_tensors < 1 || n_tensors > kMaxTensors) {
    return RaiseError("ValueError", "cuda_launch: a kernel handle and between 1 and 8 tensors");
  }
  launch->n_tensors = static_cast<int>(n_tensors);
  for (int i = 0; i < 3; ++i) {
    const int64_t grid = args[2 + i].v_int64;
    const int64_t block = args[5 + i].v_int64;
    if (grid < 1 || grid > 0xffffffffLL || block < 1 || block > 1024) {
      return RaiseError("ValueError", "cuda_launch: grid and block dimensions must be positive (block at most 1024)");
    }
    launch->grid[i] = static_cast<unsigned>(grid);
    launch->block[i] = static_cast<unsigned>(block);
  }
  if (args[8].v_int64 < 0 || args[8].v_int64 > 0xffffffffLL) return RaiseError("ValueError", "cuda_launch: shared_bytes");
  launch->shared = static_cast<unsigned>(args[8].v_int64);
  launch->n_parameters = (num_args - 9) / 2;
  for (int p = 0; p < launch->n_parameters; ++p) {
    const int64_t kind = args[9 + 2 * p].v_int64;
    const int64_t value = args[10 + 2 * p].v_int64;
    if (kind == 0 ? (value < 0 || value >= n_tensors) : (kind != 4 && kind != 8)) {
      return RaiseError("ValueError", "cuda_launch: each parameter is (0, a tensor's index) or (4 or 8, a constant)");
    }
    launch->kind[p] = static_cast<int>(kind);
    launch->value[p] = kind == 4 ? static_cast<uint64_t>(static_cast<uint32_t>(value)) : static_cast<uint64_t>(value);
  }
  std::string why;
  launch->driver = FindDriver(&why);
  if (launch->driver == nullptr) return RaiseError("RuntimeError", why.c_str());
  TVMFFIObjectHandle function = nullptr;
  if (TVMFFIFunctionCreate(launch.get(), CallCudaLaunch, DeleteCudaLaunch, &function) != 0) return -1;
  launch.release();  // (the function owns it now)
  result->type_index = kTVMFFIFunction;
  result->zero_padding = 0;
  result->v_obj = static_cast<TVMFFIObject*>(function);
  return 0;
}

}  // extern "C"
