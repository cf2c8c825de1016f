// A launch table in C: raw tensor metadata -> (TVM-FFI function, the arguments that follow the
// tensors). `kernel_api.ops` records an entry after a call has chosen, checked and compiled a
// kernel through the Python path; a later call whose tensors have the same dtypes, shapes,
// strides, pointer alignment (low 10 bits) and devices is launched from here without building
// arguments in Python. Only the C ABI of TVM-FFI is used (c_api.h), so this builds in about a
// second against the headers of the installed tvm_ffi wheel.
//
// Exported through the TVM-FFI packed-call ABI (`tvm_ffi.load_module(...).<name>`):
//   launch(tag, stream, *tensors) -> bool   launched (true), or false: no entry, a non-empty
//                                            tensor without memory (a tracer's fake tensor), or
//                                            the last tensor (the output) may share memory with another
//   record(tag, function, n_tensors, *tensors, *tail) -> None
//   clear() -> None;  size() -> int
// `stream` None means the stream TVM-FFI set for the first tensor's device for this call (the
// producer's current stream: torch's, for torch tensors); anything else is passed on as it is.
// The function is called as function(*tensors, *tail, stream).
// DLPack has no lazy negative or conjugate bit: callers passing torch tensors decline tensors
// carrying one before calling launch (python_entry.cc's entry points do it in C).

#include <dlpack/dlpack.h>
#include <tvm/ffi/c_api.h>
#include <tvm/ffi/extra/c_env_api.h>

#include "launch_table.h"

#include <cstdint>
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

struct Entry {
  TVMFFIObjectHandle function = nullptr;
  std::vector<TVMFFIAny> tail;
  Entry() = default;
  Entry(const Entry&) = delete;
  Entry& operator=(const Entry&) = delete;
  ~Entry() {
    if (function != nullptr) TVMFFIObjectDecRef(function);
    for (TVMFFIAny& value : tail) {
      if (value.type_index >= kTVMFFIStaticObjectBegin) TVMFFIObjectDecRef(value.v_obj);
    }
  }
};

using Table = std::unordered_map<std::string, std::shared_ptr<Entry>>;
std::mutex table_mutex;
// Never destroyed: at process exit the entries' functions may hold Python objects, which must
// not be released after the interpreter is gone (the Python side clears the table at exit).
Table& table = *new Table();
constexpr size_t kTableLimit = 4096;

const DLTensor* AsTensor(const TVMFFIAny& value) {
  if (value.type_index == kTVMFFITensor) return TVMFFITensorGetDLTensorPtr(value.v_obj);
  if (value.type_index == kTVMFFIDLTensorPtr) return static_cast<const DLTensor*>(value.v_ptr);
  return nullptr;
}

// Appends one tensor's metadata to the key; false when the tensor cannot be keyed.
bool AppendTensorKey(const DLTensor* t, std::string* key) {
  if (t->ndim < 0 || t->ndim > kMaxNdim) return false;
  if (t->data == nullptr) {
    // No memory behind a non-empty tensor: a fake tensor of a tracer, never launched from here.
    bool empty = false;
    for (int i = 0; i < t->ndim; ++i) empty = empty || t->shape[i] == 0;
    if (!empty) return false;
  }
  int64_t words[4 + 2 * kMaxNdim];
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
  key->append(reinterpret_cast<const char*>(words), sizeof(int64_t) * n);
  return true;
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

void SetBool(TVMFFIAny* result, bool value) {
  result->type_index = kTVMFFIBool;
  result->zero_padding = 0;
  result->v_int64 = value ? 1 : 0;
}

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


int LaunchRecorded(int64_t tag, const TVMFFIAny& stream, const TVMFFIAny* tensors, int count, bool* launched) {
  *launched = false;
  if (count < 1 || count > kMaxTensors) return 0;
  thread_local std::string key;  // reused: no allocation per call once it has grown
  key.clear();
  if (!TensorKey(tag, tensors, count, &key)) return 0;
  std::shared_ptr<Entry> entry;
  {
    std::lock_guard<std::mutex> lock(table_mutex);
    auto found = table.find(key);
    if (found != table.end()) entry = found->second;  // kept alive past a concurrent clear()
  }  // (copying a shared_ptr never frees: no GIL is needed under the lock)
  if (entry == nullptr || OutputMayOverlap(tensors, count)) return 0;
  TVMFFIAny call_args[kMaxTensors + kMaxTail + 1];
  int n = 0;
  for (int i = 0; i < count; ++i) call_args[n++] = tensors[i];
  for (const TVMFFIAny& value : entry->tail) call_args[n++] = value;
  call_args[n++] = stream;
  TVMFFIAny returned;
  returned.type_index = kTVMFFINone;
  returned.zero_padding = 0;
  returned.v_int64 = 0;
  if (TVMFFIFunctionCall(entry->function, call_args, n, &returned) != 0) return -1;
  if (returned.type_index >= kTVMFFIStaticObjectBegin) TVMFFIObjectDecRef(returned.v_obj);
  *launched = true;
  return 0;
}

}  // namespace kernel_api_native

extern "C" {

TVM_FFI_DLL_EXPORT int __tvm_ffi_launch(void*, const TVMFFIAny* args, int32_t num_args, TVMFFIAny* result) {
  if (num_args < 3 || num_args - 2 > kMaxTensors) return RaiseError("ValueError", "launch(tag, stream, *tensors)");
  if (args[0].type_index != kTVMFFIInt) return RaiseError("TypeError", "launch: tag must be an int");
  const int count = num_args - 2;
  TVMFFIAny stream = args[1];
  const DLTensor* first = AsTensor(args[2]);
  if (stream.type_index == kTVMFFINone && first != nullptr && first->device.device_type != kDLCPU) {
    stream.type_index = kTVMFFIOpaquePtr;
    stream.zero_padding = 0;
    stream.v_ptr = TVMFFIEnvGetStream(first->device.device_type, first->device.device_id);
  }
  bool launched = false;
  if (kernel_api_native::LaunchRecorded(args[0].v_int64, stream, args + 2, count, &launched) != 0) return -1;
  SetBool(result, launched);
  return 0;
}

TVM_FFI_DLL_EXPORT int __tvm_ffi_record(void*, const TVMFFIAny* args, int32_t num_args, TVMFFIAny* result) {
  if (num_args < 3 || args[0].type_index != kTVMFFIInt || args[2].type_index != kTVMFFIInt) {
    return RaiseError("TypeError", "record(tag: int, function, n_tensors: int, *tensors, *tail)");
  }
  if (args[1].type_index != kTVMFFIFunction) return RaiseError("TypeError", "record: function must be a TVM-FFI function");
  const int64_t count = args[2].v_int64;
  if (count < 1 || count > kMaxTensors || 3 + count > num_args) {
    return RaiseError("ValueError", "record: n_tensors must be between 1 and 8 and match the tensors given");
  }
  const int tail_count = num_args - 3 - static_cast<int>(count);
  if (tail_count > kMaxTail) return RaiseError("ValueError", "record: at most 16 arguments may follow the tensors");
  std::string key;
  if (!kernel_api_native::TensorKey(args[0].v_int64, args + 3, static_cast<int>(count), &key)) {
    return RaiseError("TypeError", "record: every operand must be a tensor with memory, of at most 8 dimensions");
  }
  auto entry = std::make_shared<Entry>();
  for (int i = 0; i < tail_count; ++i) {
    TVMFFIAny value = args[3 + count + i];
    if (value.type_index == kTVMFFIRawStr || value.type_index == kTVMFFIByteArrayPtr ||
        value.type_index == kTVMFFIDLTensorPtr || value.type_index == kTVMFFIObjectRValueRef ||
        value.type_index == kTVMFFISmallStr || value.type_index == kTVMFFISmallBytes ||
        (value.type_index >= kTVMFFIStaticObjectBegin && value.type_index != kTVMFFIFunction &&
         value.type_index != kTVMFFIShape && value.type_index != kTVMFFIArray)) {
      // Borrowed pointers would dangle; objects other than these are not expected as launch constants.
      return RaiseError("TypeError", "record: the arguments after the tensors must be plain values");
    }
    if (value.type_index >= kTVMFFIStaticObjectBegin) TVMFFIObjectIncRef(value.v_obj);
    entry->tail.push_back(value);
  }
  TVMFFIObjectIncRef(args[1].v_obj);
  entry->function = args[1].v_obj;
  // Entries displaced here are destroyed after the lock is released: destroying one may take
  // the GIL (its function may be a Python object), and a thread holding the GIL may be waiting
  // for table_mutex in launch. Nothing may need the GIL while table_mutex is held.
  Table displaced;
  std::shared_ptr<Entry> replaced;
  {
    std::lock_guard<std::mutex> lock(table_mutex);
    if (table.size() >= kTableLimit) displaced.swap(table);
    std::shared_ptr<Entry>& slot = table[key];
    replaced.swap(slot);
    slot = std::move(entry);
  }
  result->type_index = kTVMFFINone;
  result->zero_padding = 0;
  result->v_int64 = 0;
  return 0;
}

TVM_FFI_DLL_EXPORT int __tvm_ffi_clear(void*, const TVMFFIAny*, int32_t, TVMFFIAny* result) {
  Table old;
  {
    std::lock_guard<std::mutex> lock(table_mutex);
    old.swap(table);
  }  // entries are released here, outside the lock (their functions may be Python objects)
  result->type_index = kTVMFFINone;
  result->zero_padding = 0;
  result->v_int64 = 0;
  return 0;
}

TVM_FFI_DLL_EXPORT int __tvm_ffi_size(void*, const TVMFFIAny*, int32_t, TVMFFIAny* result) {
  std::lock_guard<std::mutex> lock(table_mutex);
  result->type_index = kTVMFFIInt;
  result->zero_padding = 0;
  result->v_int64 = static_cast<int64_t>(table.size());
  return 0;
}

}  // extern "C"
