// CPython entry points of the native library (module `_launch_table`), for torch tensors.
//
// Calling a TVM-FFI function from Python with torch tensors converts each tensor into a new
// TVM-FFI tensor object (two allocations each) and each plain argument anew. These entry points
// read the tensors with torch's DLPack exchange API instead (`dltensor_from_py_object_no_sync`:
// a DLTensor on the stack, no allocation, no synchronisation) and pass DLTensor pointers, which
// TVM-FFI functions (CuTe DSL's included) accept as tensors:
//
//   configure(tensor_type)                  torch.Tensor; the exchange API is read from it
//   bind(function, tensors, tail) -> BoundLaunch
//       BoundLaunch(stream) calls function(*tensors, *tail, stream), reading the tensors' current
//       metadata at each call; `tail` (None, bool, int, float) is converted once.
//   configure_replay(settings, grad_enabled, dispatch_modes, function_modes, autocast_enabled,
//                    tf32_allowed, increment_version)
//       what the call key reads (the settings' ContextVar and torch's state readers) and how a
//       replayed launch bumps a given output's version.
//   record(op, recipe, *args) -> bool; replay(op, *args) -> result | None; recipe(op, *args);
//   forget_replays(); replays() -> int
//       `kernel_api.ops`' repeated calls: the recipe (a torch call, or a TVM-FFI launch with its
//       output made as recorded) a Python path recorded for calls of this key, run without
//       Python (see "Replays" below, and kernel_api/native/recipes.py).
//   remember(tag, value, *tensors) -> bool; recall(tag, *tensors) -> value | None; forget()
//       a dictionary keyed by tensors' raw metadata (dtypes, devices, shapes, strides, pointer
//       alignment): what Python computed from tensors' metadata, found again without Python.
//
// Tensors carrying torch's lazy negative or conjugate bit (which DLPack cannot express) are never
// launched (see "Lazy bits" below): the call key holds the bit (a Python path, which refuses such
// operands, records none), recall misses, remember declines, and bind (or a bound launch, should a
// bound tensor gain a bit) raises ValueError.
//
// `stream` (bind): None is the producer's current stream on the first tensor's device (torch's
// current stream; nothing for CPU tensors), an int is passed on as an int, anything else as the
// pointer `int(stream)` gives (cuda.bindings' CUstream, for one). Replayed launches run on the
// current stream.

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <dlpack/dlpack.h>
#include <tvm/ffi/c_api.h>

#include <cstring>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "launch_table.h"
#include "torch_reads.h"

namespace {

using kernel_api_native::kMaxTail;
using kernel_api_native::kMaxTensors;

PyTypeObject* tensor_type = nullptr;  // torch.Tensor (a strong reference, set by configure)
const DLPackExchangeAPI* exchange = nullptr;
// torch.Tensor.is_neg and .is_conj (C methods taking no arguments, read by configure), called
// through their C functions, without the method lookup and vectorcall of the descriptor.
PyCFunction is_neg = nullptr;
PyCFunction is_conj = nullptr;
// The torch-linked reads (`_torch_reads`), once kernel_api.native has checked them
// (use_torch_reads); nullptr: every read goes through the exchange API and torch's Python readers.
const kernel_api_native::TorchReads* torch_reads = nullptr;

// The last non-int stream object converted and its pointer: a launch loop passes the same one.
PyObject* last_stream = nullptr;
void* last_stream_pointer = nullptr;

bool Configured() {
  if (exchange != nullptr) return true;
  PyErr_SetString(PyExc_RuntimeError, "_launch_table: configure(torch.Tensor) was not called");
  return false;
}

// The tag (args[0]) of an entry point taking `lead` arguments before 1 to kMaxTensors tensors;
// false with a Python error (a TypeError naming `usage` for a wrong count).
bool ReadTag(PyObject* const* args, Py_ssize_t nargs, Py_ssize_t lead, const char* usage, long long* tag) {
  if (nargs < lead + 1 || nargs - lead > kMaxTensors) {
    PyErr_Format(PyExc_TypeError, "%s: between 1 and %d tensors", usage, kMaxTensors);
    return false;
  }
  if (!Configured()) return false;
  *tag = PyLong_AsLongLong(args[0]);
  return !(*tag == -1 && PyErr_Occurred());
}

// Sets *set to what `method` (is_neg or is_conj) answers for `object`; false with a Python error
// when it raised.
bool Flag(PyCFunction method, PyObject* object, bool* set) {
  PyObject* flag = method(object, nullptr);
  if (flag == nullptr) return false;
  *set = flag == Py_True;
  Py_DECREF(flag);
  return true;
}

// The C function of the tensor type's method `name`, which must take no arguments; nullptr with
// a Python error otherwise.
PyCFunction NoArgumentMethod(PyObject* type, const char* name) {
  PyObject* method = PyObject_GetAttrString(type, name);
  if (method == nullptr) return nullptr;
  PyCFunction function = nullptr;
  if (Py_IS_TYPE(method, &PyMethodDescr_Type)) {
    const PyMethodDef* def = reinterpret_cast<PyMethodDescrObject*>(method)->d_method;
    if ((def->ml_flags & (METH_VARARGS | METH_KEYWORDS | METH_FASTCALL | METH_O | METH_NOARGS | METH_METHOD)) ==
        METH_NOARGS) {
      function = def->ml_meth;
    }
  }
  Py_DECREF(method);  // (the function is torch's own: loaded for the life of the process)
  if (function == nullptr) PyErr_Format(PyExc_TypeError, "configure: %s is not a C method without arguments", name);
  return function;
}

// ---- Lazy bits ------------------------------------------------------------------------------
//
// DLPack has no lazy negative or conjugate bit: the DLTensor of torch._neg_view(x) or of
// c.conj().imag describes the memory without the negation, so a kernel launched with it would
// compute with the wrong sign. Such tensors are never launched from here; declined, they reach
// the callers' Python paths, which refuse them naming the operand.
//
// torch tells the bits only through Tensor.is_neg()/is_conj(), whose C functions install torch's
// warning handler, look for __torch_function__ and release and retake the GIL: 0.1-0.3 us a call
// (the latter on a GPU host), as much as the rest of a launch from here. They are therefore asked
// once per tensor object, not per read. A tensor gets its bits when it is made (views get their own); afterwards
// only `t.data = other` changes them (it brings other's storage and bits, and with them, in
// practice, another data pointer) and torch's private in-place toggles torch._C._set_neg and
// _set_conj (torch sets them on tensors it is making). So a verdict is kept with the data pointer
// it was given for, and asked again when the pointer differs:
// - a bound launch reads the same tensor objects at every call: bind checks them, and a call
//   checks again only a tensor whose data pointer moved;
// - the call key (replay, record), recall and remember read the caller's tensors anew at each call: the last
//   tensors found clear are remembered by identity (a weak reference tells the live tensor from
//   a new one at a reused address) and data pointer.

// Which lazy bit `object` (of a dtype with code `dtype_code`) carries: 0 none, 1 the negative,
// 2 the conjugate; -1 with the Python error torch raised.
int LazyBit(PyObject* object, uint8_t dtype_code) {
  bool set = false;
  if (!Flag(is_neg, object, &set)) return -1;
  if (set) return 1;
  if (dtype_code != kDLComplex) return 0;  // (only complex tensors can carry the conjugate bit)
  if (!Flag(is_conj, object, &set)) return -1;
  return set ? 2 : 0;
}

const char* const kLazyBitSet[] = {
    nullptr, "torch's lazy negative bit set; call .resolve_neg()", "torch's lazy conjugate bit set; call .resolve_conj()"};

// Whether `bit` (LazyBit's answer) is none: true; false with a Python error (ValueError for a bit).
bool BitClear(int bit) {
  if (bit > 0) PyErr_Format(PyExc_ValueError, "the tensor has %s", kLazyBitSet[bit]);
  return bit == 0;
}

// Whether `object` carries neither bit: true; false with a Python error (ValueError for a bit).
bool LazyBitsClear(PyObject* object, uint8_t dtype_code) { return BitClear(LazyBit(object, dtype_code)); }

// Whether the weak reference `ref` refers to `object` (which the caller holds).
bool RefersTo(PyObject* ref, PyObject* object) {
#if PY_VERSION_HEX >= 0x030D0000
  PyObject* target = nullptr;
  if (PyWeakref_GetRef(ref, &target) != 1) return false;  // dead (ref is always a weak reference)
  Py_DECREF(target);  // never the last reference: the caller's object, or another live object
  return target == object;
#else
  return PyWeakref_GET_OBJECT(ref) == object;
#endif
}

// The tensors last found without lazy bits (see above), each in the slot its address hashes to:
// a model's weights and a benchmark's rotating operands stay known. Guarded by the GIL.
struct ClearTensor {
  PyObject* object = nullptr;  // borrowed: compared, never dereferenced unless `ref` refers to it
  PyObject* ref = nullptr;     // a weak reference to object
  void* data = nullptr;        // its data pointer when it was checked
};
constexpr int kClearTensors = 256;
ClearTensor clear_tensors[kClearTensors];

ClearTensor& ClearSlot(PyObject* object) {
  const uintptr_t address = reinterpret_cast<uintptr_t>(object);
  return clear_tensors[((address >> 4) ^ (address >> 12)) & (kClearTensors - 1)];
}

void RememberClear(PyObject* object, void* data) {
  PyObject* ref = PyWeakref_NewRef(object, nullptr);  // (may collect garbage: run Python code)
  if (ref == nullptr) {  // not weakly referenceable: checked at every read
    PyErr_Clear();
    return;
  }
  ClearTensor& slot = ClearSlot(object);
  PyObject* old = slot.ref;
  slot = {object, ref, data};
  Py_XDECREF(old);  // (a weak reference without callback: its release runs no Python code)
}

// LazyBit for a tensor read anew at each call, through the remembered verdicts.
int CheckedBit(PyObject* object, const DLTensor& tensor) {
  const ClearTensor& known = ClearSlot(object);
  if (known.object == object && known.data == tensor.data && RefersTo(known.ref, object)) return 0;
  const int bit = LazyBit(object, tensor.dtype.code);
  if (bit == 0) RememberClear(object, tensor.data);
  return bit;
}

// LazyBitsClear for a tensor read anew at each call, through the remembered verdicts.
bool CheckedClear(PyObject* object, const DLTensor& tensor) { return BitClear(CheckedBit(object, tensor)); }

// Reads a torch tensor's metadata into *out. False when `object` is not a torch tensor or torch
// cannot describe it, and, when `check` is set, when it carries a lazy bit; the Python error is
// then set (the caller may clear it).
bool ReadTensor(PyObject* object, DLTensor* out, bool check = true) {
  if (!PyObject_TypeCheck(object, tensor_type)) {
    PyErr_Format(PyExc_TypeError, "expected a torch.Tensor, got %s", Py_TYPE(object)->tp_name);
    return false;
  }
  int bit = 0, requires = 0;
  if (torch_reads != nullptr && torch_reads->tensor(object, out, &bit, &requires) == 1) {
    return !check || BitClear(bit);
  }
  if (exchange->dltensor_from_py_object_no_sync(object, out) != 0) return false;
  return !check || CheckedClear(object, *out);
}

// Whether `tensor` requires grad: 1 or 0, -1 with a Python error.
int RequiresGrad(PyObject* tensor) {
  static PyObject* name = PyUnicode_InternFromString("requires_grad");
  if (name == nullptr) return -1;
  PyObject* flag = PyObject_GetAttr(tensor, name);
  if (flag == nullptr) return -1;
  const int result = flag == Py_True;
  Py_DECREF(flag);
  return result;
}

// A tensor argument as the call key reads it: its DLTensor, lazy bit and (when `grad`)
// requires_grad. 1 read; 0 when torch cannot describe it (no Python error); -1 with a Python error.
int ReadKeyTensor(PyObject* object, DLTensor* out, bool grad, int* bit, int* requires) {
  if (torch_reads != nullptr && torch_reads->tensor(object, out, bit, requires) == 1) {
    if (!grad) *requires = 0;
    return 1;
  }
  if (exchange->dltensor_from_py_object_no_sync(object, out) != 0) {
    PyErr_Clear();  // (a tracer's tensor, a subclass torch cannot describe)
    return 0;
  }
  *bit = CheckedBit(object, *out);
  if (*bit < 0) return -1;
  *requires = grad ? RequiresGrad(object) : 0;
  return *requires < 0 ? -1 : 1;
}

void SetPointer(TVMFFIAny* out, int32_t type_index, void* pointer) {
  out->type_index = type_index;
  out->zero_padding = 0;
  out->v_int64 = 0;
  out->v_ptr = pointer;
}

// Reads `count` torch tensors into `tensors` and points `operands` (DLTensor pointers) at them.
// False, with the Python error of the first that could not be read, otherwise.
bool ReadOperands(PyObject* const* objects, int count, DLTensor* tensors, TVMFFIAny* operands) {
  for (int i = 0; i < count; ++i) {
    if (!ReadTensor(objects[i], &tensors[i])) return false;
    SetPointer(&operands[i], kTVMFFIDLTensorPtr, &tensors[i]);
  }
  return true;
}

// The stream argument for a launch on `device` (see the header comment). False with a Python error.
bool StreamArgument(PyObject* stream, const DLDevice& device, TVMFFIAny* out) {
  if (stream == Py_None) {
    if (device.device_type == kDLCPU || exchange->current_work_stream == nullptr) {
      SetPointer(out, kTVMFFINone, nullptr);
      return true;
    }
    void* current = nullptr;
    if (exchange->current_work_stream(device.device_type, device.device_id, &current) != 0) {
      if (!PyErr_Occurred()) PyErr_SetString(PyExc_RuntimeError, "stream: the current stream could not be read");
      return false;
    }
    SetPointer(out, kTVMFFIOpaquePtr, current);
    return true;
  }
  if (PyLong_CheckExact(stream)) {
    out->type_index = kTVMFFIInt;
    out->zero_padding = 0;
    out->v_int64 = PyLong_AsLongLong(stream);
    return !(out->v_int64 == -1 && PyErr_Occurred());
  }
  if (stream != last_stream) {
    PyObject* number = PyNumber_Long(stream);
    if (number == nullptr) {
      PyErr_Format(PyExc_TypeError, "stream: expected None, an int or a CUDA stream object, got %s",
                   Py_TYPE(stream)->tp_name);
      return false;
    }
    void* pointer = PyLong_AsVoidPtr(number);
    Py_DECREF(number);
    if (pointer == nullptr && PyErr_Occurred()) return false;
    Py_INCREF(stream);
    Py_XSETREF(last_stream, stream);
    last_stream_pointer = pointer;
  }
  SetPointer(out, kTVMFFIOpaquePtr, last_stream_pointer);
  return true;
}

// Turns the error a TVM-FFI function raised into the matching Python exception.
PyObject* RaiseFromFfi() {
  TVMFFIObjectHandle error = nullptr;
  TVMFFIErrorMoveFromRaised(&error);
  if (error == nullptr) {
    PyErr_SetString(PyExc_RuntimeError, "a TVM-FFI call failed without an error");
    return nullptr;
  }
  const TVMFFIErrorCell* cell = TVMFFIErrorGetCellPtr(error);
  struct Kind {
    const char* name;
    PyObject* type;
  };
  const Kind kinds[] = {{"TypeError", PyExc_TypeError},       {"ValueError", PyExc_ValueError},
                        {"IndexError", PyExc_IndexError},     {"KeyError", PyExc_KeyError},
                        {"AttributeError", PyExc_AttributeError}, {"MemoryError", PyExc_MemoryError},
                        {"NotImplementedError", PyExc_NotImplementedError}, {"RuntimeError", PyExc_RuntimeError}};
  PyObject* type = nullptr;
  for (const Kind& kind : kinds) {
    if (cell->kind.size == std::strlen(kind.name) && std::memcmp(cell->kind.data, kind.name, cell->kind.size) == 0) {
      type = kind.type;
    }
  }
  std::string message(cell->message.data, cell->message.size);
  if (type == nullptr) {
    type = PyExc_RuntimeError;
    message = std::string(cell->kind.data, cell->kind.size) + ": " + message;
  }
  PyErr_SetString(type, message.c_str());
  TVMFFIObjectDecRef(error);
  return nullptr;
}

PyObject* Configure(PyObject*, PyObject* type) {
  if (!PyType_Check(type)) {
    PyErr_SetString(PyExc_TypeError, "configure: expected torch.Tensor");
    return nullptr;
  }
  PyObject* capsule = PyObject_GetAttrString(type, "__dlpack_c_exchange_api__");
  if (capsule == nullptr) return nullptr;
  const void* api = nullptr;
  if (PyCapsule_CheckExact(capsule)) {
    api = PyCapsule_GetPointer(capsule, "dlpack_exchange_api");
  } else if (PyLong_Check(capsule)) {
    api = PyLong_AsVoidPtr(capsule);
  } else {
    PyErr_SetString(PyExc_TypeError, "configure: __dlpack_c_exchange_api__ is neither a capsule nor an address");
  }
  Py_DECREF(capsule);
  if (api == nullptr) return nullptr;
  const auto* table = static_cast<const DLPackExchangeAPI*>(api);
  if (table->header.version.major != DLPACK_MAJOR_VERSION || table->dltensor_from_py_object_no_sync == nullptr) {
    PyErr_Format(PyExc_RuntimeError, "configure: the tensor type's DLPack exchange API (version %u.%u) is not usable",
                 table->header.version.major, table->header.version.minor);
    return nullptr;
  }
  PyCFunction neg = NoArgumentMethod(type, "is_neg");
  PyCFunction conj = neg == nullptr ? nullptr : NoArgumentMethod(type, "is_conj");
  if (conj == nullptr) return nullptr;
  is_neg = neg;
  is_conj = conj;
  Py_INCREF(type);
  Py_XSETREF(tensor_type, reinterpret_cast<PyTypeObject*>(type));
  exchange = table;
  Py_RETURN_NONE;
}

// ---- Outputs ----------------------------------------------------------------------------------

// What replays make and write outputs with (set by configure_replay).
struct OutputHooks {
  PyObject* increment_version = nullptr;  // torch._C._increment_version (takes a tuple of tensors)
  // Its C function and self when it is a METH_O builtin (as in torch 2.x), called directly.
  PyCFunction increment_version_function = nullptr;
  PyObject* increment_version_self = nullptr;  // (borrowed: increment_version holds it)
  PyObject* written = nullptr;    // the 1-tuple passed to it, reused (see BumpVersion)
  PyObject* new_empty = nullptr;  // the interned name
} outputs;

// ---- New outputs -----------------------------------------------------------------------------
//
// A new dense (row-major) tensor made by torch's allocator through the exchange API
// (`managed_tensor_allocator`: at::empty on the current stream, then wrapped as a torch.Tensor),
// without the argument parsing of a Python call such as new_empty: 3.4 us of host time for
// torch.empty_like on an H200 host, as much as the rest of a replayed softmax call. Where that
// fails once (the producer has no allocator, or it refused), `new_empty` is called from then on.
bool exchange_allocation_failed = false;

void IgnoreAllocationError(void*, const char*, const char*) {}

// A new dense tensor of `shape` (`ndim` extents) with `like`'s dtype and device; a new reference,
// or nullptr with a Python error.
PyObject* NewDense(PyObject* like_object, const DLTensor& like, const int64_t* shape, int ndim) {
  if (!exchange_allocation_failed && exchange->managed_tensor_allocator != nullptr &&
      exchange->managed_tensor_to_py_object_no_sync != nullptr) {
    DLTensor prototype{};
    prototype.ndim = ndim;
    prototype.shape = const_cast<int64_t*>(shape);
    prototype.dtype = like.dtype;
    prototype.device = like.device;
    DLManagedTensorVersioned* managed = nullptr;
    void* made = nullptr;
    if (exchange->managed_tensor_allocator(&prototype, &managed, nullptr, IgnoreAllocationError) == 0 &&
        managed != nullptr) {
      if (exchange->managed_tensor_to_py_object_no_sync(managed, &made) == 0 && made != nullptr) {
        return static_cast<PyObject*>(made);
      }
      // (not wrapped: whether the producer released it is unknown, so it is left, once)
    }
    PyErr_Clear();
    exchange_allocation_failed = true;
  }
  PyObject* extents = PyTuple_New(ndim);
  if (extents == nullptr) return nullptr;
  for (int i = 0; i < ndim; ++i) {
    PyObject* extent = PyLong_FromLongLong(shape[i]);
    if (extent == nullptr) {
      Py_DECREF(extents);
      return nullptr;
    }
    PyTuple_SET_ITEM(extents, i, extent);
  }
  PyObject* call[] = {like_object, extents};
  PyObject* made = PyObject_VectorcallMethod(outputs.new_empty, call, 2, nullptr);
  Py_DECREF(extents);
  return made;
}

// increment_version((out,)): ops write `out` through raw pointers, behind autograd's back, so its
// version counter is bumped as a torch in-place op would. The 1-tuple is reused while no one else
// holds it (as CPython's own iterators reuse their result tuples): one allocation less per call.
// False with a Python error.
bool BumpVersion(PyObject* out) {
  PyObject* written = outputs.written;
  if (written == nullptr || Py_REFCNT(written) != 1) {  // first use, or kept by someone
    written = PyTuple_New(1);
    if (written == nullptr) return false;
    Py_INCREF(Py_None);
    PyTuple_SET_ITEM(written, 0, Py_None);
    Py_XSETREF(outputs.written, written);
  }
  Py_INCREF(written);  // held during the call: a nested BumpVersion (from Python code torch may run) makes its own
  Py_INCREF(out);
  PyObject* previous = PyTuple_GET_ITEM(written, 0);
  PyTuple_SET_ITEM(written, 0, out);
  Py_DECREF(previous);
  PyObject* done = outputs.increment_version_function != nullptr
                       ? outputs.increment_version_function(outputs.increment_version_self, written)
                       : PyObject_CallOneArg(outputs.increment_version, written);
  if (Py_REFCNT(written) == 2) {  // nobody kept it: let go of out (a kept tuple keeps its value)
    Py_INCREF(Py_None);
    PyTuple_SET_ITEM(written, 0, Py_None);
    Py_DECREF(out);
  }
  Py_DECREF(written);
  if (done == nullptr) return false;
  Py_DECREF(done);
  return true;
}

// ---- remember / recall ---------------------------------------------------------------------

// Guarded by the GIL (every caller holds it). Values are strong references.
std::unordered_map<std::string, PyObject*> remembered;
constexpr size_t kRememberLimit = 4096;

void Forget() {
  std::unordered_map<std::string, PyObject*> old;
  old.swap(remembered);
  for (auto& item : old) Py_DECREF(item.second);  // may run Python code: the map is already empty
}

// The key of (tag, tensors) (launch_table.h's TensorKey), in *key (emptied first); false when
// some argument is not a torch tensor or cannot be keyed.
bool MetadataKey(long long tag, PyObject* const* objects, int count, std::string* key) {
  DLTensor tensors[kMaxTensors];
  TVMFFIAny operands[kMaxTensors];
  if (!ReadOperands(objects, count, tensors, operands)) return false;
  key->clear();  // only now: reading may run Python code (torch's, a collection) that recalls too
  return kernel_api_native::TensorKey(tag, operands, count, key);
}

// Keeps `value` (a new strong reference) in *store under the key of (tag, tensors), emptying the
// store first (`forget`) when it holds `limit` values: Python's True, or False (no Python error)
// when the tensors cannot be keyed (meta, fake, no DLPack form).
PyObject* StoreByMetadata(std::unordered_map<std::string, PyObject*>* store, size_t limit, void (*forget)(),
                          long long tag, PyObject* value, PyObject* const* tensors, int count) {
  std::string key;
  if (!MetadataKey(tag, tensors, count, &key)) {
    PyErr_Clear();
    Py_RETURN_FALSE;
  }
  if (store->size() >= limit) forget();
  Py_INCREF(value);
  auto inserted = store->emplace(std::move(key), value);
  if (!inserted.second) {
    PyObject* old = inserted.first->second;
    inserted.first->second = value;
    Py_DECREF(old);
  }
  Py_RETURN_TRUE;
}

PyObject* Recall(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  long long tag;
  if (!ReadTag(args, nargs, 1, "recall(tag, *tensors)", &tag)) return nullptr;
  thread_local std::string key;  // reused: no allocation per call once it has grown
  if (!MetadataKey(tag, args + 1, static_cast<int>(nargs - 1), &key)) {
    PyErr_Clear();  // not tensors this can key: the caller computes
    Py_RETURN_NONE;
  }
  auto found = remembered.find(key);
  if (found == remembered.end()) Py_RETURN_NONE;
  Py_INCREF(found->second);
  return found->second;
}

PyObject* Remember(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  long long tag;
  if (!ReadTag(args, nargs, 2, "remember(tag, value, *tensors)", &tag)) return nullptr;
  return StoreByMetadata(&remembered, kRememberLimit, Forget, tag, args[1], args + 2, static_cast<int>(nargs - 2));
}

PyObject* ForgetAll(PyObject*, PyObject*) {
  Forget();
  Py_RETURN_NONE;
}

PyObject* RememberedCount(PyObject*, PyObject*) { return PyLong_FromSize_t(remembered.size()); }

// ---- BoundLaunch ---------------------------------------------------------------------------

struct BoundLaunch {
  PyObject_HEAD
  vectorcallfunc vectorcall;
  PyObject* function;  // the Python TVM-FFI function object: keeps `handle` alive
  TVMFFIObjectHandle handle;
  int n_tensors;
  PyObject* tensors[kMaxTensors];  // torch tensors or None
  // The data pointer each tensor had when it was last found without lazy bits (see "Lazy bits").
  void* clear_data[kMaxTensors];
  int n_tail;
  TVMFFIAny tail[kMaxTail];
};

PyObject* BoundLaunchCall(PyObject* self_object, PyObject* const* args, size_t nargsf, PyObject* kwnames) {
  auto* self = reinterpret_cast<BoundLaunch*>(self_object);
  const Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
  if (nargs != 1 || (kwnames != nullptr && PyTuple_GET_SIZE(kwnames) != 0)) {
    PyErr_SetString(PyExc_TypeError, "a bound launch takes one argument: the stream");
    return nullptr;
  }
  DLTensor tensors[kMaxTensors];
  TVMFFIAny call_args[kMaxTensors + kMaxTail + 1];
  const DLDevice* device = nullptr;
  for (int i = 0; i < self->n_tensors; ++i) {
    if (self->tensors[i] == Py_None) {
      SetPointer(&call_args[i], kTVMFFINone, nullptr);
      continue;
    }
    if (!ReadTensor(self->tensors[i], &tensors[i], false)) return nullptr;
    if (tensors[i].data != self->clear_data[i]) {  // moved since checked (`t.data = ...`): check again
      if (!LazyBitsClear(self->tensors[i], tensors[i].dtype.code)) return nullptr;
      self->clear_data[i] = tensors[i].data;
    }
    SetPointer(&call_args[i], kTVMFFIDLTensorPtr, &tensors[i]);
    if (device == nullptr) device = &tensors[i].device;
  }
  int n = self->n_tensors;
  for (int i = 0; i < self->n_tail; ++i) call_args[n++] = self->tail[i];
  const DLDevice cpu = {kDLCPU, 0};
  if (!StreamArgument(args[0], device != nullptr ? *device : cpu, &call_args[n++])) return nullptr;
  TVMFFIAny returned;
  SetPointer(&returned, kTVMFFINone, nullptr);
  if (TVMFFIFunctionCall(self->handle, call_args, n, &returned) != 0) return RaiseFromFfi();
  if (returned.type_index >= kTVMFFIStaticObjectBegin) TVMFFIObjectDecRef(returned.v_obj);
  Py_RETURN_NONE;
}

int BoundLaunchTraverse(PyObject* self_object, visitproc visit, void* arg) {
  auto* self = reinterpret_cast<BoundLaunch*>(self_object);
  Py_VISIT(self->function);
  for (int i = 0; i < self->n_tensors; ++i) Py_VISIT(self->tensors[i]);
  return 0;
}

int BoundLaunchClear(PyObject* self_object) {
  auto* self = reinterpret_cast<BoundLaunch*>(self_object);
  Py_CLEAR(self->function);
  for (int i = 0; i < self->n_tensors; ++i) Py_CLEAR(self->tensors[i]);
  self->n_tensors = 0;
  self->handle = nullptr;
  return 0;
}

void BoundLaunchDealloc(PyObject* self_object) {
  PyTypeObject* type = Py_TYPE(self_object);
  PyObject_GC_UnTrack(self_object);
  BoundLaunchClear(self_object);
  type->tp_free(self_object);
  Py_DECREF(type);  // instances of heap types hold a reference to their type
}

PyObject* BoundLaunchTensors(PyObject* self_object, void*) {
  auto* self = reinterpret_cast<BoundLaunch*>(self_object);
  PyObject* tuple = PyTuple_New(self->n_tensors);
  if (tuple == nullptr) return nullptr;
  for (int i = 0; i < self->n_tensors; ++i) {
    Py_INCREF(self->tensors[i]);
    PyTuple_SET_ITEM(tuple, i, self->tensors[i]);
  }
  return tuple;
}

PyObject* BoundLaunchFunction(PyObject* self_object, void*) {
  auto* self = reinterpret_cast<BoundLaunch*>(self_object);
  PyObject* function = self->function != nullptr ? self->function : Py_None;
  Py_INCREF(function);
  return function;
}

PyGetSetDef bound_launch_getset[] = {
    {"func", BoundLaunchFunction, nullptr, "The TVM-FFI function called.", nullptr},
    {"tensors", BoundLaunchTensors, nullptr, "The tensors passed first, read at each call.", nullptr},
    {nullptr, nullptr, nullptr, nullptr, nullptr},
};

PyMemberDef bound_launch_members[] = {
    {"__vectorcalloffset__", T_PYSSIZET, offsetof(BoundLaunch, vectorcall), READONLY, nullptr},
    {nullptr, 0, 0, 0, nullptr},
};

PyType_Slot bound_launch_slots[] = {
    {Py_tp_doc, const_cast<char*>("function(*tensors, *tail, stream), called with the stream.")},
    {Py_tp_call, reinterpret_cast<void*>(PyVectorcall_Call)},
    {Py_tp_traverse, reinterpret_cast<void*>(BoundLaunchTraverse)},
    {Py_tp_clear, reinterpret_cast<void*>(BoundLaunchClear)},
    {Py_tp_dealloc, reinterpret_cast<void*>(BoundLaunchDealloc)},
    {Py_tp_getset, bound_launch_getset},
    {Py_tp_members, bound_launch_members},
    {0, nullptr},
};

PyType_Spec bound_launch_spec = {
    "kernel_api.native.BoundLaunch", sizeof(BoundLaunch), 0,
    Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL, bound_launch_slots,
};

PyTypeObject* bound_launch_type = nullptr;

// The handle of a TVM-FFI function object (tvm_ffi objects' __chandle__), which the object keeps
// alive; nullptr with a TypeError (`refusal`) for anything else.
void* FunctionHandle(PyObject* function, const char* refusal) {
  PyObject* chandle = PyObject_CallMethod(function, "__chandle__", nullptr);
  void* handle = nullptr;
  if (chandle != nullptr) {
    handle = PyLong_AsVoidPtr(chandle);
    Py_DECREF(chandle);
  }
  if (handle == nullptr || TVMFFIObjectGetTypeIndex(handle) != kTVMFFIFunction) {
    PyErr_Clear();
    PyErr_SetString(PyExc_TypeError, refusal);
    return nullptr;
  }
  return handle;
}

// A tail value as TVM-FFI passes it; false (TypeError set) for anything but None, bool, int, float.
bool TailValue(PyObject* value, TVMFFIAny* out) {
  out->zero_padding = 0;
  out->v_int64 = 0;
  if (value == Py_None) {
    out->type_index = kTVMFFINone;
  } else if (PyBool_Check(value)) {
    out->type_index = kTVMFFIBool;
    out->v_int64 = value == Py_True ? 1 : 0;
  } else if (PyLong_Check(value)) {
    out->type_index = kTVMFFIInt;
    out->v_int64 = PyLong_AsLongLong(value);
    if (out->v_int64 == -1 && PyErr_Occurred()) return false;
  } else if (PyFloat_Check(value)) {
    out->type_index = kTVMFFIFloat;
    out->v_float64 = PyFloat_AS_DOUBLE(value);
  } else {
    PyErr_Format(PyExc_TypeError, "bind: arguments after the tensors must be None, bool, int or float, got %s",
                 Py_TYPE(value)->tp_name);
    return false;
  }
  return true;
}

PyObject* Bind(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 3 || !PyTuple_Check(args[1]) || !PyTuple_Check(args[2])) {
    PyErr_SetString(PyExc_TypeError, "bind(function, tensors: tuple, tail: tuple)");
    return nullptr;
  }
  if (!Configured()) return nullptr;
  PyObject* function = args[0];
  const Py_ssize_t n_tensors = PyTuple_GET_SIZE(args[1]);
  const Py_ssize_t n_tail = PyTuple_GET_SIZE(args[2]);
  if (n_tensors < 1 || n_tensors > kMaxTensors || n_tail > kMaxTail) {
    PyErr_SetString(PyExc_ValueError, "bind: between 1 and 8 tensors and at most 16 arguments after them");
    return nullptr;
  }
  void* handle = FunctionHandle(function, "bind: function must be a TVM-FFI function");
  if (handle == nullptr) return nullptr;
  void* clear_data[kMaxTensors];
  for (Py_ssize_t i = 0; i < n_tensors; ++i) {
    PyObject* tensor = PyTuple_GET_ITEM(args[1], i);
    clear_data[i] = nullptr;
    if (tensor == Py_None) continue;
    if (!PyObject_TypeCheck(tensor, tensor_type)) {
      PyErr_Format(PyExc_TypeError, "bind: tensors[%zd] is a %s, not a torch.Tensor or None", i,
                   Py_TYPE(tensor)->tp_name);
      return nullptr;
    }
    // The lazy bits, checked here once rather than at every call (see "Lazy bits").
    DLTensor read;
    if (exchange->dltensor_from_py_object_no_sync(tensor, &read) != 0) {
      // Not describable now (a fake tensor, say): checked at the first call that reads it.
      PyErr_Clear();
      clear_data[i] = reinterpret_cast<void*>(~uintptr_t{0});
      continue;
    }
    const int bit = LazyBit(tensor, read.dtype.code);
    if (bit != 0) {
      if (bit > 0) PyErr_Format(PyExc_ValueError, "bind: tensors[%zd] has %s", i, kLazyBitSet[bit]);
      return nullptr;
    }
    clear_data[i] = read.data;
  }
  auto* self = PyObject_GC_New(BoundLaunch, bound_launch_type);
  if (self == nullptr) return nullptr;
  self->vectorcall = BoundLaunchCall;
  self->n_tensors = 0;
  self->n_tail = 0;
  Py_INCREF(function);
  self->function = function;
  self->handle = handle;
  for (Py_ssize_t i = 0; i < n_tensors; ++i) {
    PyObject* tensor = PyTuple_GET_ITEM(args[1], i);
    Py_INCREF(tensor);
    self->clear_data[i] = clear_data[i];
    self->tensors[self->n_tensors++] = tensor;
  }
  for (Py_ssize_t i = 0; i < n_tail; ++i) {
    if (!TailValue(PyTuple_GET_ITEM(args[2], i), &self->tail[self->n_tail++])) {
      Py_DECREF(self);
      return nullptr;
    }
  }
  PyObject_GC_Track(self);
  return reinterpret_cast<PyObject*>(self);
}

// ---- Replays: one key for every operation's calls ---------------------------------------------
//
// `kernel_api.ops`' Python paths record what a call did (`record`); a later call whose key is
// equal is replayed from here (`replay`), with no rule of any operation's own. The key is one
// function of the call (`CallKey`): the settings' policy id, the operation's number, the state
// torch keeps per thread that changes what a call means (grad mode, torch dispatch and function
// modes, autocast, cuBLAS's TF32 flag), and every argument: a tensor's type, lazy bit,
// requires_grad (under grad mode) and raw metadata (dtype, device, shape, strides, pointer
// alignment), or an argument's value (None, bool, int, float, a str of at most 128 bytes). An
// argument of any other type (or a longer str) leaves the call unkeyed: it is not replayed. A
// recipe is what Python recorded for a key:
//   - a call: `call(*picked, out=argument)`, its result returned (a torch function, which sees
//     grad mode, modes and autocast itself);
//   - a launch: a TVM-FFI function called with the picked arguments and constants, the output
//     made as recorded (a dense tensor of the recorded shape, like an argument) or given, and
//     the current stream of the first tensor's device; the output is returned, a given one's
//     version counter bumped.
// A recipe whose output is an argument replays only while that argument's bytes meet no other
// tensor argument's. A launch that makes its output keeps a variant per pointer alignment of the
// made output (the arguments' summaries read it): a made output of another alignment declines.

// torch's state readers (C functions taking no arguments), configured by configure_replay.
struct StateReader {
  PyObject* object = nullptr;  // a strong reference
  PyCFunction function = nullptr;  // its C function when it is a METH_NOARGS builtin
  PyObject* self = nullptr;        // (borrowed: object holds it)

  void Set(PyObject* value) {
    Py_INCREF(value);
    Py_XSETREF(object, value);
    function = nullptr;
    if (PyCFunction_Check(value) && (PyCFunction_GET_FLAGS(value) & METH_NOARGS) != 0 &&
        (PyCFunction_GET_FLAGS(value) & (METH_VARARGS | METH_KEYWORDS | METH_FASTCALL | METH_O | METH_METHOD)) == 0) {
      function = PyCFunction_GET_FUNCTION(value);
      self = PyCFunction_GET_SELF(value);
    }
  }
  // The value read as a truth (an int's nonzero); -1 with a Python error.
  int Read() const {
    PyObject* value = function != nullptr ? function(self, nullptr) : PyObject_CallNoArgs(object);
    if (value == nullptr) return -1;
    int truth;
    if (value == Py_True) {
      truth = 1;
    } else if (value == Py_False) {
      truth = 0;
    } else {
      truth = PyObject_IsTrue(value);
    }
    Py_DECREF(value);
    return truth;
  }
};

struct ReplayHooks {
  PyObject* settings = nullptr;  // the ContextVar of kernel_api.settings (.policy_id)
  StateReader grad_enabled, dispatch_modes, function_modes, autocast, tf32;
  PyObject* policy_id = nullptr;  // interned names
  PyObject* last_settings = nullptr;  // the settings object last read (a strong reference) and its policy id
  long long last_policy = 0;
} hooks;

PyObject* ConfigureReplay(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 7) {
    PyErr_SetString(PyExc_TypeError, "configure_replay(settings, grad_enabled, dispatch_modes, function_modes, "
                                     "autocast_enabled, tf32_allowed, increment_version)");
    return nullptr;
  }
  for (int i = 1; i < 7; ++i) {
    if (!PyCallable_Check(args[i])) {
      PyErr_SetString(PyExc_TypeError, "configure_replay: the hooks after settings must be callable");
      return nullptr;
    }
  }
  if (hooks.policy_id == nullptr) hooks.policy_id = PyUnicode_InternFromString("policy_id");
  if (hooks.policy_id == nullptr) return nullptr;
  Py_INCREF(args[0]);
  Py_XSETREF(hooks.settings, args[0]);
  hooks.grad_enabled.Set(args[1]);
  hooks.dispatch_modes.Set(args[2]);
  hooks.function_modes.Set(args[3]);
  hooks.autocast.Set(args[4]);
  hooks.tf32.Set(args[5]);
  if (outputs.new_empty == nullptr && (outputs.new_empty = PyUnicode_InternFromString("new_empty")) == nullptr) {
    return nullptr;
  }
  Py_INCREF(args[6]);
  Py_XSETREF(outputs.increment_version, args[6]);
  outputs.increment_version_function = nullptr;
  if (PyCFunction_Check(args[6]) && PyCFunction_GET_FLAGS(args[6]) == METH_O) {
    outputs.increment_version_function = PyCFunction_GET_FUNCTION(args[6]);
    outputs.increment_version_self = PyCFunction_GET_SELF(args[6]);
  }
  Py_RETURN_NONE;
}

// The words of an argument's key: its kind first.
enum ArgumentKind : int64_t { kTensorArgument = 1, kNoneArgument, kBoolArgument, kIntArgument, kFloatArgument, kStrArgument };

// The state bits of a key (torch_reads.h's StateBit): each what one of torch's readers answers now.
using kernel_api_native::kAutocast;
using kernel_api_native::kDispatchMode;
using kernel_api_native::kFunctionMode;
using kernel_api_native::kGradMode;
using kernel_api_native::kTf32;
constexpr int64_t kAllState = 31;
// Asked for with kTf32: the flag is read, and held, only for calls with a float32 tensor argument
// (cuBLAS's TF32 flag changes float32 math only; the read costs as much as a tensor's).
constexpr int64_t kTf32ForFloat32 = 32;
// An operation's number holds, from this bit, the state parts its keys hold (recipes.op_number).
constexpr int kStateShift = 32;

constexpr int kMaxArguments = kMaxTensors * 2;

// The call's arguments as read for its key: the tensors' DLTensors (by argument index).
struct ReadArguments {
  DLTensor tensors[kMaxTensors];
  int tensor_at[kMaxArguments];  // argument index -> index in tensors, or -1 (every argument has one)
  int n_tensors = 0;
};

// A key's words as CallKey writes them (on the stack; the key is then copied once): the head, then
// per argument its kind and value, or a tensor's type, bits and metadata (TensorKeyWords), or a
// str's length and bytes (at most kMaxStrWords words: a longer str leaves the call unkeyed).
constexpr int kMaxStrWords = 16;
constexpr int kMaxKeyWords = 4 + kMaxArguments * (2 + kernel_api_native::kMaxTensorWords);
static_assert(2 + kMaxStrWords <= 2 + kernel_api_native::kMaxTensorWords, "a str fits a tensor's room");

// The one key function: (policy id, op, state, arguments) in *key. 1 when keyed; 0 when the
// call cannot be keyed (an argument of another type, an unreadable tensor: no Python error);
// -1 with a Python error (a reader of torch's state raised).
int CallKey(long long op, PyObject* const* args, int n, std::string* key, ReadArguments* read) {
  if (hooks.settings == nullptr || exchange == nullptr || n > kMaxArguments) return 0;
  PyObject* settings = nullptr;
  if (PyContextVar_Get(hooks.settings, nullptr, &settings) != 0) return -1;
  if (settings == nullptr) return 0;
  if (settings != hooks.last_settings) {  // (settings objects are immutable: their policy id is read once)
    PyObject* id = PyObject_GetAttr(settings, hooks.policy_id);
    const long long policy = id == nullptr ? -1 : PyLong_AsLongLong(id);
    Py_XDECREF(id);
    if (policy == -1 && PyErr_Occurred()) {
      Py_DECREF(settings);
      return -1;
    }
    Py_XSETREF(hooks.last_settings, settings);  // (the reference PyContextVar_Get gave)
    hooks.last_policy = policy;
  } else {
    Py_DECREF(settings);
  }
  const long long policy = hooks.last_policy;
  // The state parts the operation's number asks for (its bits from kStateShift; none: all).
  const int64_t wanted = op >> kStateShift == 0 ? kAllState : op >> kStateShift;
  const StateReader* readers[] = {&hooks.grad_enabled, &hooks.dispatch_modes, &hooks.function_modes, &hooks.autocast,
                                  &hooks.tf32};
  const bool tf32_later = (wanted & (kTf32 | kTf32ForFloat32)) == (kTf32 | kTf32ForFloat32);
  int64_t state = 0;
  // (torch_reads answers the first four at once; TF32 stays with torch's Python reader)
  constexpr int64_t kTorchReadState = kGradMode | kDispatchMode | kFunctionMode | kAutocast;
  const int first_read = torch_reads != nullptr ? 4 : 0;
  if (first_read != 0 && (wanted & kTorchReadState) != 0) state = torch_reads->state() & wanted & kTorchReadState;
  for (int i = first_read; i < 5; ++i) {
    if ((wanted >> i & 1) == 0 || (i == 4 && tf32_later)) continue;
    const int set = readers[i]->Read();
    if (set < 0) return -1;
    if (set) state |= int64_t{1} << i;
  }
  const bool grad = (state & kGradMode) != 0;
  int64_t words[kMaxKeyWords];
  words[0] = policy;
  words[1] = op;
  words[2] = state;
  words[3] = n;
  int w = 4;
  read->n_tensors = 0;
  for (int i = 0; i < n; ++i) {
    PyObject* arg = args[i];
    read->tensor_at[i] = -1;
    if (arg == Py_None) {
      words[w++] = kNoneArgument;
    } else if (PyBool_Check(arg)) {
      words[w++] = kBoolArgument;
      words[w++] = arg == Py_True;
    } else if (PyLong_CheckExact(arg)) {
      int overflow = 0;
      const long long value = PyLong_AsLongLongAndOverflow(arg, &overflow);
      if (overflow != 0 || (value == -1 && PyErr_Occurred())) {
        PyErr_Clear();
        return 0;
      }
      words[w++] = kIntArgument;
      words[w++] = value;
    } else if (PyFloat_CheckExact(arg)) {
      const double value = PyFloat_AS_DOUBLE(arg);
      words[w++] = kFloatArgument;
      std::memcpy(&words[w++], &value, sizeof(value));
    } else if (PyUnicode_CheckExact(arg)) {
      Py_ssize_t size = 0;
      const char* text = PyUnicode_AsUTF8AndSize(arg, &size);
      if (text == nullptr) {
        PyErr_Clear();
        return 0;
      }
      const int n_words = static_cast<int>((size + 7) / 8);
      if (n_words > kMaxStrWords) return 0;
      words[w++] = kStrArgument;
      words[w++] = size;
      if (n_words > 0) words[w + n_words - 1] = 0;  // (the last word's padding)
      std::memcpy(&words[w], text, static_cast<size_t>(size));
      w += n_words;
    } else if (PyObject_TypeCheck(arg, tensor_type) && read->n_tensors < kMaxTensors) {
      DLTensor* tensor = &read->tensors[read->n_tensors];
      int bit = 0, requires = 0;
      const int tensor_read = ReadKeyTensor(arg, tensor, grad, &bit, &requires);
      if (tensor_read <= 0) return tensor_read;
      words[w++] = kTensorArgument | bit << 8 | requires << 10;
      words[w++] = static_cast<int64_t>(reinterpret_cast<uintptr_t>(Py_TYPE(arg)));
      const int tensor_words = kernel_api_native::TensorKeyWords(tensor, &words[w]);
      if (tensor_words < 0) return 0;
      w += tensor_words;
      read->tensor_at[i] = read->n_tensors++;
    } else {
      return 0;
    }
  }
  if (tf32_later) {
    for (int i = 0; i < read->n_tensors; ++i) {
      const DLDataType dtype = read->tensors[i].dtype;
      if (dtype.code == kDLFloat && dtype.bits == 32 && dtype.lanes == 1) {
        const int set = hooks.tf32.Read();
        if (set < 0) return -1;
        if (set) words[2] |= kTf32;
        break;
      }
    }
  }
  key->assign(reinterpret_cast<const char*>(words), sizeof(int64_t) * static_cast<size_t>(w));
  return 1;
}

// A recorded call or launch (see the section's comment). Owned by `recipes`; released with the GIL.
struct Recipe {
  bool launch = false;
  PyObject* callable = nullptr;            // the torch function, or the TVM-FFI function object
  TVMFFIObjectHandle function = nullptr;  // launch: its handle (callable keeps it alive)
  // The passed arguments in order: >= 0 the call's argument, -1 - i constant i, kMade the made output.
  std::vector<int> order;
  PyObject* constants = nullptr;  // a tuple
  PyObject* spec = nullptr;       // the recipe as recorded (`recipe`)
  std::vector<TVMFFIAny> launch_constants;  // launch: the constants converted once
  int out_keyword = -1;  // call: the argument passed as out=
  int output = -1;       // the argument that is the output (no overlap; a launch bumps its version)
  // launch with a made output: a dense tensor of `made_shape` like argument `like`, whose pointer
  // alignment (its lowest set bit, up to 1024) is `alignment`; other variants for other alignments.
  int like = -1;
  std::vector<int64_t> made_shape;
  // launch: views of the call's tensor arguments, passed where order holds kView + index.
  struct View {
    int argument;
    int ndim;
    int64_t shape[8];
    int64_t strides[8];
    int64_t offset;  // in elements, from the argument's first element
  };
  std::vector<View> views;
  uintptr_t alignment = 0;
  std::vector<std::shared_ptr<Recipe>> variants;  // further alignments of the same call

  ~Recipe() {
    Py_XDECREF(callable);
    Py_XDECREF(constants);
    Py_XDECREF(spec);
  }
};
PyObject* out_kwnames = nullptr;  // ("out",): a Call's output passed by keyword, as torch functions take it

constexpr int kMade = -(1 << 20);
constexpr int kView = 1 << 20;
constexpr size_t kVariantLimit = 7;  // (the alignments from 16 to 1024 bytes)

// Call keys are whole 8-byte words (CallKey writes nothing else): hashed four words at a time in
// four independent lanes of scalar multiplies (a GEMM's key is 40-odd words; one lane's chain of
// dependent multiplies was a tenth of a replayed call's host time), mixed at the end. Kept
// scalar: SSE2 has no 64-bit multiply, and the vectorizer's emulation of it is slower.
#if defined(__GNUC__) && !defined(__clang__)
#define KERNEL_API_SCALAR __attribute__((optimize("no-tree-vectorize")))
#else
#define KERNEL_API_SCALAR
#endif
struct WordHash {
  static uint64_t Mix(uint64_t hash, uint64_t word) {
    hash = (hash ^ word) * 0xff51afd7ed558ccdULL;
    return hash ^ (hash >> 32);
  }
  KERNEL_API_SCALAR size_t operator()(const std::string& key) const {
    const char* data = key.data();
    const size_t words = key.size() / 8;
    uint64_t a = 0x9e3779b97f4a7c15ULL ^ key.size(), b = 0xc2b2ae3d27d4eb4fULL, c = 0x165667b19e3779f9ULL,
             d = 0x27d4eb2f165667c5ULL;
    size_t i = 0;
    for (; i + 4 <= words; i += 4) {
      uint64_t w0, w1, w2, w3;
      std::memcpy(&w0, data + 8 * i, 8);
      std::memcpy(&w1, data + 8 * i + 8, 8);
      std::memcpy(&w2, data + 8 * i + 16, 8);
      std::memcpy(&w3, data + 8 * i + 24, 8);
      a = Mix(a, w0);
      b = Mix(b, w1);
      c = Mix(c, w2);
      d = Mix(d, w3);
    }
    for (; i < words; ++i) {
      uint64_t word;
      std::memcpy(&word, data + 8 * i, 8);
      a = Mix(a, word);
    }
    for (i = 8 * words; i < key.size(); ++i) b = Mix(b, static_cast<unsigned char>(data[i]));
    return static_cast<size_t>(Mix(Mix(Mix(a, b), c), d));
  }
};
// (shared: a replay holds the recipe it runs, which Python code run meanwhile may forget)
using Recipes = std::unordered_map<std::string, std::shared_ptr<Recipe>, WordHash>;
Recipes& recipes = *new Recipes();
constexpr size_t kRecipeLimit = 4096;

void ForgetRecipes() {
  Recipes old;
  old.swap(recipes);  // released after: releasing may run Python code
}

uintptr_t LowestBit(const void* data) {
  const uintptr_t low = reinterpret_cast<uintptr_t>(data) & 1023;
  return low == 0 ? 1024 : low & (~low + 1);
}

// Reads a view (argument, shape, strides, offset) into *into; false with a Python error.
bool ParseView(PyObject* spec, Recipe::View* into) {
  if (!PyTuple_Check(spec) || PyTuple_GET_SIZE(spec) != 4 || !PyTuple_Check(PyTuple_GET_ITEM(spec, 1)) ||
      !PyTuple_Check(PyTuple_GET_ITEM(spec, 2)) ||
      PyTuple_GET_SIZE(PyTuple_GET_ITEM(spec, 1)) != PyTuple_GET_SIZE(PyTuple_GET_ITEM(spec, 2)) ||
      PyTuple_GET_SIZE(PyTuple_GET_ITEM(spec, 1)) > 8) {
    PyErr_SetString(PyExc_TypeError, "record: a view is (argument, shape, strides, offset), at most 8 dimensions");
    return false;
  }
  into->argument = static_cast<int>(PyLong_AsLong(PyTuple_GET_ITEM(spec, 0)));
  into->ndim = static_cast<int>(PyTuple_GET_SIZE(PyTuple_GET_ITEM(spec, 1)));
  for (int i = 0; i < into->ndim; ++i) {
    into->shape[i] = PyLong_AsLongLong(PyTuple_GET_ITEM(PyTuple_GET_ITEM(spec, 1), i));
    into->strides[i] = PyLong_AsLongLong(PyTuple_GET_ITEM(PyTuple_GET_ITEM(spec, 2), i));
  }
  into->offset = PyLong_AsLongLong(PyTuple_GET_ITEM(spec, 3));
  return !PyErr_Occurred();
}

// Reads recipe = (callable, launch, order, constants, out_keyword, output, made, views) into
// *into; false with a Python error.
bool ParseRecipe(PyObject* spec, Recipe* into) {
  if (!PyTuple_Check(spec) || PyTuple_GET_SIZE(spec) != 8 || !PyTuple_Check(PyTuple_GET_ITEM(spec, 2)) ||
      !PyTuple_Check(PyTuple_GET_ITEM(spec, 3)) || !PyTuple_Check(PyTuple_GET_ITEM(spec, 7))) {
    PyErr_SetString(PyExc_TypeError, "record: recipe is (callable, launch, order: tuple, constants: tuple, "
                                     "out_keyword, output, made, views: tuple)");
    return false;
  }
  PyObject* views = PyTuple_GET_ITEM(spec, 7);
  for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(views); ++i) {
    Recipe::View view;
    if (!ParseView(PyTuple_GET_ITEM(views, i), &view)) return false;
    into->views.push_back(view);
  }
  PyObject* callable = PyTuple_GET_ITEM(spec, 0);
  into->launch = PyObject_IsTrue(PyTuple_GET_ITEM(spec, 1)) == 1;
  PyObject* order = PyTuple_GET_ITEM(spec, 2);
  PyObject* constants = PyTuple_GET_ITEM(spec, 3);
  for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(order); ++i) {
    const long slot = PyLong_AsLong(PyTuple_GET_ITEM(order, i));
    if (slot == -1 && PyErr_Occurred()) return false;
    into->order.push_back(static_cast<int>(slot));
  }
  into->out_keyword = static_cast<int>(PyLong_AsLong(PyTuple_GET_ITEM(spec, 4)));
  into->output = static_cast<int>(PyLong_AsLong(PyTuple_GET_ITEM(spec, 5)));
  if (PyErr_Occurred()) return false;
  PyObject* made = PyTuple_GET_ITEM(spec, 6);
  if (made != Py_None) {
    if (!PyTuple_Check(made) || PyTuple_GET_SIZE(made) != 3 || !PyTuple_Check(PyTuple_GET_ITEM(made, 1))) {
      PyErr_SetString(PyExc_TypeError, "record: made is None or (like, shape: tuple, alignment)");
      return false;
    }
    into->like = static_cast<int>(PyLong_AsLong(PyTuple_GET_ITEM(made, 0)));
    PyObject* shape = PyTuple_GET_ITEM(made, 1);
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(shape); ++i) {
      into->made_shape.push_back(PyLong_AsLongLong(PyTuple_GET_ITEM(shape, i)));
    }
    into->alignment = static_cast<uintptr_t>(PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(made, 2)));
    if (PyErr_Occurred()) return false;
    if (into->made_shape.size() > 8 || into->like < 0) {
      PyErr_SetString(PyExc_ValueError, "record: a made output has at most 8 dimensions, like an argument");
      return false;
    }
  }
  if (into->launch) {
    into->function = FunctionHandle(callable, "record: a launch's callable must be a TVM-FFI function");
    if (into->function == nullptr) return false;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(constants); ++i) {
      TVMFFIAny value;
      if (!TailValue(PyTuple_GET_ITEM(constants, i), &value)) return false;
      into->launch_constants.push_back(value);
    }
  } else if (!PyCallable_Check(callable) || made != Py_None) {
    PyErr_SetString(PyExc_TypeError, "record: a call's callable must be callable, and makes no output");
    return false;
  }
  Py_INCREF(callable);
  into->callable = callable;
  Py_INCREF(spec);
  into->spec = spec;
  Py_INCREF(constants);
  into->constants = constants;
  const int constant_count = static_cast<int>(PyTuple_GET_SIZE(constants));
  for (int slot : into->order) {
    if ((slot < 0 && slot != kMade && -1 - slot >= constant_count) || (slot == kMade && into->like < 0) ||
        (slot >= kMaxArguments && slot - kView >= static_cast<int>(into->views.size())) ||
        (slot >= kView && !into->launch)) {
      PyErr_SetString(PyExc_ValueError, "record: order names a constant, argument, view or made output that is not there");
      return false;
    }
  }
  return true;
}

// record(op, recipe, *args) -> bool: keep the recipe for calls keyed as this one (False: the call
// cannot be keyed). A launch recipe with a made output adds a variant for its alignment.
PyObject* Record(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs < 2) {
    PyErr_SetString(PyExc_TypeError, "record(op, recipe, *args)");
    return nullptr;
  }
  const long long op = PyLong_AsLongLong(args[0]);
  if (op == -1 && PyErr_Occurred()) return nullptr;
  auto recipe = std::make_shared<Recipe>();
  if (!ParseRecipe(args[1], recipe.get())) return nullptr;
  for (int slot : recipe->order) {
    if (slot < kView && slot >= nargs - 2) {
      PyErr_SetString(PyExc_ValueError, "record: order names an argument the call does not have");
      return nullptr;
    }
  }
  for (const Recipe::View& view : recipe->views) {
    if (view.argument < 0 || view.argument >= nargs - 2) {
      PyErr_SetString(PyExc_ValueError, "record: a view of an argument the call does not have");
      return nullptr;
    }
  }
  std::string key;
  ReadArguments read;
  const int keyed = CallKey(op, args + 2, static_cast<int>(nargs - 2), &key, &read);
  if (keyed < 0) return nullptr;
  if (keyed == 0) Py_RETURN_FALSE;
  if (recipes.size() >= kRecipeLimit) ForgetRecipes();
  auto found = recipes.find(key);
  if (found != recipes.end() && recipe->like >= 0 && found->second->like >= 0) {
    Recipe* kept = found->second.get();
    if (kept->alignment != recipe->alignment) {
      for (auto& variant : kept->variants) {
        if (variant->alignment == recipe->alignment) {
          variant.swap(recipe);  // (the old variant is released when `recipe` goes)
          Py_RETURN_TRUE;
        }
      }
      if (kept->variants.size() < kVariantLimit) kept->variants.push_back(std::move(recipe));
      Py_RETURN_TRUE;
    }
    recipe->variants.swap(kept->variants);
  }
  std::shared_ptr<Recipe> old;
  if (found != recipes.end()) {
    old.swap(found->second);
    found->second = std::move(recipe);
  } else {
    recipes.emplace(std::move(key), std::move(recipe));
  }
  Py_RETURN_TRUE;
}

// Runs a call recipe: its result (a new reference), or nullptr with a Python error.
PyObject* RunCall(const Recipe& recipe, PyObject* const* args) {
  PyObject* passed[kMaxArguments * 2 + 1];
  int n = 0;
  for (int slot : recipe.order) passed[n++] = slot >= 0 ? args[slot] : PyTuple_GET_ITEM(recipe.constants, -1 - slot);
  if (recipe.out_keyword < 0) return PyObject_Vectorcall(recipe.callable, passed, static_cast<size_t>(n), nullptr);
  if (out_kwnames == nullptr) {
    PyObject* name = PyUnicode_InternFromString("out");
    if (name == nullptr) return nullptr;
    out_kwnames = PyTuple_Pack(1, name);
    Py_DECREF(name);
    if (out_kwnames == nullptr) return nullptr;
  }
  passed[n] = args[recipe.out_keyword];
  return PyObject_Vectorcall(recipe.callable, passed, static_cast<size_t>(n), out_kwnames);
}

// Runs a launch recipe: the output (a new reference); nullptr without a Python error when it
// declines (a made output of an alignment no variant has); nullptr with one when it failed.
PyObject* RunLaunch(const Recipe& first, PyObject* const* args, const ReadArguments& read) {
  const Recipe* recipe = &first;
  std::shared_ptr<Recipe> held;
  PyObject* made = nullptr;
  DLTensor made_tensor;
  if (first.like >= 0) {
    const int like = read.tensor_at[first.like];
    if (like < 0) return nullptr;
    made = NewDense(args[first.like], read.tensors[like], first.made_shape.data(),
                    static_cast<int>(first.made_shape.size()));
    if (made == nullptr) return nullptr;
    if (!ReadTensor(made, &made_tensor, false)) {
      Py_DECREF(made);
      return nullptr;
    }
    const uintptr_t alignment = LowestBit(static_cast<char*>(made_tensor.data) + made_tensor.byte_offset);
    if (recipe->alignment != alignment) {
      recipe = nullptr;
      for (const auto& variant : first.variants) {
        if (variant->alignment == alignment) {
          held = variant;  // (kept while it runs, as the first is by the caller)
          recipe = held.get();
        }
      }
      if (recipe == nullptr) {
        Py_DECREF(made);
        return nullptr;
      }
    }
  }
  TVMFFIAny passed[kMaxArguments + kMaxTail + 2];
  DLTensor viewed[kMaxTensors];
  int n = 0;
  int n_viewed = 0;
  const DLDevice* device = nullptr;
  for (int slot : recipe->order) {
    if (slot >= kView) {  // a view of a tensor argument, as recorded
      const Recipe::View& view = recipe->views[static_cast<size_t>(slot - kView)];
      const int at = read.tensor_at[view.argument];
      if (at < 0 || n_viewed == kMaxTensors) {
        Py_XDECREF(made);
        return nullptr;
      }
      DLTensor* tensor = &viewed[n_viewed++];
      *tensor = read.tensors[at];
      tensor->ndim = view.ndim;
      tensor->shape = const_cast<int64_t*>(view.shape);
      tensor->strides = const_cast<int64_t*>(view.strides);
      tensor->byte_offset += static_cast<uint64_t>(view.offset * ((tensor->dtype.bits * tensor->dtype.lanes + 7) / 8));
      SetPointer(&passed[n++], kTVMFFIDLTensorPtr, tensor);
      if (device == nullptr) device = &tensor->device;
    } else if (slot == kMade) {
      SetPointer(&passed[n++], kTVMFFIDLTensorPtr, &made_tensor);
      if (device == nullptr) device = &made_tensor.device;
    } else if (slot < 0) {
      passed[n++] = recipe->launch_constants[static_cast<size_t>(-1 - slot)];
    } else if (read.tensor_at[slot] >= 0) {
      const DLTensor* tensor = &read.tensors[read.tensor_at[slot]];
      SetPointer(&passed[n++], kTVMFFIDLTensorPtr, const_cast<DLTensor*>(tensor));
      if (device == nullptr) device = &tensor->device;
    } else if (args[slot] == Py_None) {
      SetPointer(&passed[n++], kTVMFFINone, nullptr);
    } else {
      Py_XDECREF(made);
      return nullptr;  // (recorded for a tensor or None only)
    }
  }
  const DLDevice cpu = {kDLCPU, 0};
  if (!StreamArgument(Py_None, device != nullptr ? *device : cpu, &passed[n++])) {
    Py_XDECREF(made);
    return nullptr;
  }
  TVMFFIAny returned;
  SetPointer(&returned, kTVMFFINone, nullptr);
  const int output = recipe->output;  // (read first: a function that runs Python code may forget the recipe)
  if (TVMFFIFunctionCall(recipe->function, passed, n, &returned) != 0) {
    Py_XDECREF(made);
    RaiseFromFfi();
    return nullptr;
  }
  if (returned.type_index >= kTVMFFIStaticObjectBegin) TVMFFIObjectDecRef(returned.v_obj);
  if (made != nullptr) return made;
  if (output < 0) Py_RETURN_NONE;
  PyObject* out = args[output];
  if (!BumpVersion(out)) return nullptr;
  Py_INCREF(out);
  return out;
}

// Whether argument `output` may share bytes with another tensor argument.
bool ArgumentMayOverlap(const ReadArguments& read, int output) {
  const int at = read.tensor_at[output];
  if (at < 0) return true;
  TVMFFIAny operands[kMaxTensors];
  int n = 0;
  for (int i = 0; i < read.n_tensors; ++i) {
    if (i != at) SetPointer(&operands[n++], kTVMFFIDLTensorPtr, const_cast<DLTensor*>(&read.tensors[i]));
  }
  SetPointer(&operands[n++], kTVMFFIDLTensorPtr, const_cast<DLTensor*>(&read.tensors[at]));
  return kernel_api_native::OutputMayOverlap(operands, n);
}

// replay(op, *args) -> result | None: the recipe recorded for this call's key, run; None (no
// Python error) when nothing is recorded, the call cannot be keyed, an output argument may
// overlap another tensor argument, or the recipe declined or raised (the Python path runs the
// call again and reports). Raises only when a launch ran and bumping the output's version failed.
// The same for C callers (`_front_door`, through the capsule `replay_function`): `args` are the n
// arguments after op.
PyObject* ReplayCall(long long op, PyObject* const* args, Py_ssize_t n) {
  if (recipes.empty()) Py_RETURN_NONE;
  thread_local std::string key;  // reused: no allocation per call once it has grown
  ReadArguments read;
  const int keyed = CallKey(op, args, static_cast<int>(n), &key, &read);
  if (keyed <= 0) {
    PyErr_Clear();
    Py_RETURN_NONE;
  }
  auto found = recipes.find(key);
  if (found == recipes.end()) Py_RETURN_NONE;
  // Kept while it runs (its callable, constants and views): Python code it runs may forget it.
  const std::shared_ptr<Recipe> held = found->second;
  const Recipe& recipe = *held;
  if (recipe.output >= 0 && ArgumentMayOverlap(read, recipe.output)) Py_RETURN_NONE;
  PyObject* result = recipe.launch ? RunLaunch(recipe, args, read) : RunCall(recipe, args);
  if (result == nullptr) {
    PyErr_Clear();  // (the Python path runs the call again and reports)
    Py_RETURN_NONE;
  }
  return result;
}

PyObject* Replay(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs < 1) {
    PyErr_SetString(PyExc_TypeError, "replay(op, *args)");
    return nullptr;
  }
  const long long op = PyLong_AsLongLong(args[0]);
  if (op == -1 && PyErr_Occurred()) return nullptr;
  return ReplayCall(op, args + 1, nargs - 1);
}

PyObject* ForgetReplays(PyObject*, PyObject*) {
  ForgetRecipes();
  Py_RETURN_NONE;
}

PyObject* RecipeCount(PyObject*, PyObject*) { return PyLong_FromSize_t(recipes.size()); }

// recipe(op, *args) -> the recipes recorded for this call's key (as given to record; one per
// variant), or None.
PyObject* RecipeOf(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs < 1) {
    PyErr_SetString(PyExc_TypeError, "recipe(op, *args)");
    return nullptr;
  }
  const long long op = PyLong_AsLongLong(args[0]);
  if (op == -1 && PyErr_Occurred()) return nullptr;
  std::string key;
  ReadArguments read;
  const int keyed = CallKey(op, args + 1, static_cast<int>(nargs - 1), &key, &read);
  if (keyed < 0) return nullptr;
  auto found = keyed == 0 ? recipes.end() : recipes.find(key);
  if (found == recipes.end()) Py_RETURN_NONE;
  const Recipe& first = *found->second;
  PyObject* specs = PyTuple_New(static_cast<Py_ssize_t>(1 + first.variants.size()));
  if (specs == nullptr) return nullptr;
  Py_INCREF(first.spec);
  PyTuple_SET_ITEM(specs, 0, first.spec);
  for (size_t i = 0; i < first.variants.size(); ++i) {
    Py_INCREF(first.variants[i]->spec);
    PyTuple_SET_ITEM(specs, static_cast<Py_ssize_t>(i + 1), first.variants[i]->spec);
  }
  return specs;
}

// ---- torch_reads --------------------------------------------------------------------------

// The table in a `_torch_reads` capsule; nullptr with a Python error for anything else.
const kernel_api_native::TorchReads* TorchReadsOf(PyObject* capsule) {
  auto* table = static_cast<const kernel_api_native::TorchReads*>(
      PyCapsule_GetPointer(capsule, kernel_api_native::kTorchReadsCapsule));
  if (table == nullptr) return nullptr;
  if (table->abi != kernel_api_native::kTorchReadsAbi) {
    PyErr_Format(PyExc_RuntimeError, "torch reads: table version %u, expected %u", table->abi,
                 kernel_api_native::kTorchReadsAbi);
    return nullptr;
  }
  return table;
}

// check_torch_reads(reads, *tensors) -> None | str: where the torch-linked reads disagree with the
// exchange API and torch's Python readers (configure_replay's) on these tensors and the state as it
// stands (None: nowhere). Their autocast bit may say more than torch's reader, never less.
PyObject* CheckTorchReads(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs < 1) {
    PyErr_SetString(PyExc_TypeError, "check_torch_reads(reads, *tensors)");
    return nullptr;
  }
  if (!Configured()) return nullptr;
  if (hooks.settings == nullptr) {
    PyErr_SetString(PyExc_RuntimeError, "check_torch_reads: configure_replay was not called");
    return nullptr;
  }
  const kernel_api_native::TorchReads* table = TorchReadsOf(args[0]);
  if (table == nullptr) return nullptr;
  const int64_t fast = table->state();
  const StateReader* readers[] = {&hooks.grad_enabled, &hooks.dispatch_modes, &hooks.function_modes, &hooks.autocast};
  const char* names[] = {"grad mode", "dispatch modes", "function modes", "autocast"};
  for (int i = 0; i < 4; ++i) {
    const int set = readers[i]->Read();
    if (set < 0) return nullptr;
    const bool said = (fast >> i & 1) != 0;
    if (said != (set != 0) && !(i == 3 && said)) {
      return PyUnicode_FromFormat("state: %s read %d, torch's reader %d", names[i], said ? 1 : 0, set);
    }
  }
  for (Py_ssize_t i = 1; i < nargs; ++i) {
    PyObject* object = args[i];
    if (!PyObject_TypeCheck(object, tensor_type)) {
      PyErr_SetString(PyExc_TypeError, "check_torch_reads: tensors only");
      return nullptr;
    }
    DLTensor mine, theirs;
    int bit = 0, requires = 0;
    if (table->tensor(object, &mine, &bit, &requires) != 1) continue;  // (theirs alone reads it)
    if (exchange->dltensor_from_py_object_no_sync(object, &theirs) != 0) {
      PyErr_Clear();
      return PyUnicode_FromFormat("tensor %zd: read, where the exchange API cannot", i - 1);
    }
    bool same = mine.data == theirs.data && mine.byte_offset == theirs.byte_offset &&
                mine.device.device_type == theirs.device.device_type &&
                mine.device.device_id == theirs.device.device_id && mine.ndim == theirs.ndim &&
                mine.dtype.code == theirs.dtype.code && mine.dtype.bits == theirs.dtype.bits &&
                mine.dtype.lanes == theirs.dtype.lanes && (mine.strides == nullptr) == (theirs.strides == nullptr);
    for (int d = 0; same && d < mine.ndim; ++d) {
      same = mine.shape[d] == theirs.shape[d] && (mine.strides == nullptr || mine.strides[d] == theirs.strides[d]);
    }
    if (!same) return PyUnicode_FromFormat("tensor %zd: its DLTensor differs from the exchange API's", i - 1);
    const int their_bit = LazyBit(object, theirs.dtype.code);
    const int their_requires = RequiresGrad(object);
    if (their_bit < 0 || their_requires < 0) return nullptr;
    if (bit != their_bit || requires != their_requires) {
      return PyUnicode_FromFormat("tensor %zd: lazy bit %d, requires_grad %d; torch says %d, %d", i - 1, bit,
                                  requires, their_bit, their_requires);
    }
  }
  Py_RETURN_NONE;
}

// use_torch_reads(reads | None): the call key reads torch through the table from now on (None:
// through the exchange API and torch's Python readers again).
PyObject* UseTorchReads(PyObject*, PyObject* capsule) {
  if (capsule == Py_None) {
    torch_reads = nullptr;
    Py_RETURN_NONE;
  }
  const kernel_api_native::TorchReads* table = TorchReadsOf(capsule);
  if (table == nullptr) return nullptr;
  torch_reads = table;  // (the capsule's module stays imported: its table is static)
  Py_RETURN_NONE;
}

PyObject* UsesTorchReads(PyObject*, PyObject*) { return PyBool_FromLong(torch_reads != nullptr); }

PyMethodDef methods[] = {
    {"configure", Configure, METH_O, "configure(tensor_type): read the DLPack exchange API of torch.Tensor."},
    {"bind", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(Bind)), METH_FASTCALL,
     "bind(function, tensors, tail) -> BoundLaunch: function(*tensors, *tail, stream) per call."},
    {"recall", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(Recall)), METH_FASTCALL,
     "recall(tag, *tensors) -> the value remembered for these tensors' metadata, or None."},
    {"remember", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(Remember)), METH_FASTCALL,
     "remember(tag, value, *tensors) -> bool: remember value for these tensors' metadata (False: cannot key them)."},
    {"forget", ForgetAll, METH_NOARGS, "forget(): drop every remembered value."},
    {"remembered", RememberedCount, METH_NOARGS, "remembered() -> int: how many values are remembered."},
    {"configure_replay", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(ConfigureReplay)),
     METH_FASTCALL,
     "configure_replay(settings, grad_enabled, dispatch_modes, function_modes, autocast_enabled, tf32_allowed, "
     "increment_version): what the call key and launches read."},
    {"record", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(Record)), METH_FASTCALL,
     "record(op, recipe, *args) -> bool: replay the recipe for calls keyed as this one (False: it cannot be keyed)."},
    {"replay", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(Replay)), METH_FASTCALL,
     "replay(op, *args) -> result | None: the recipe recorded for this call's key, run."},
    {"recipe", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(RecipeOf)), METH_FASTCALL,
     "recipe(op, *args) -> the recipes recorded for this call's key (one per variant), or None."},
    {"forget_replays", ForgetReplays, METH_NOARGS, "forget_replays(): drop every recipe."},
    {"replays", RecipeCount, METH_NOARGS, "replays() -> int: how many calls have a recipe."},
    {"check_torch_reads", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(CheckTorchReads)),
     METH_FASTCALL,
     "check_torch_reads(reads, *tensors) -> None | str: where the torch-linked reads disagree with torch's own."},
    {"use_torch_reads", UseTorchReads, METH_O,
     "use_torch_reads(reads | None): read torch through the torch-linked table (None: through torch's Python)."},
    {"uses_torch_reads", UsesTorchReads, METH_NOARGS, "uses_torch_reads() -> bool"},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_launch_table", nullptr, -1, methods,
                          nullptr, nullptr, nullptr, nullptr};

}  // namespace

// Set by setup.py; kernel_api.native refuses a module built for other sources or another TVM-FFI.
#ifndef KERNEL_API_TVM_FFI_VERSION
#define KERNEL_API_TVM_FFI_VERSION ""
#endif
#ifndef KERNEL_API_SOURCE_DIGEST
#define KERNEL_API_SOURCE_DIGEST ""
#endif

extern "C" __attribute__((visibility("default"))) PyObject* PyInit__launch_table() {
  PyObject* module = PyModule_Create(&module_def);
  if (module == nullptr) return nullptr;
#ifdef Py_GIL_DISABLED
  // Free-threaded Python (3.13t+): this module keeps its state in globals that only the GIL
  // guards (the configured tensor type, the last stream, the remembered summaries), so importing
  // it keeps the GIL enabled.
  PyUnstable_Module_SetGIL(module, Py_MOD_GIL_USED);
#endif
  if (PyModule_AddStringConstant(module, "tvm_ffi_version", KERNEL_API_TVM_FFI_VERSION) != 0 ||
      PyModule_AddStringConstant(module, "source_digest", KERNEL_API_SOURCE_DIGEST) != 0) {
    Py_DECREF(module);
    return nullptr;
  }
  if (bound_launch_type == nullptr) {
    bound_launch_type = reinterpret_cast<PyTypeObject*>(PyType_FromSpec(&bound_launch_spec));
    if (bound_launch_type == nullptr) {
      Py_DECREF(module);
      return nullptr;
    }
  }
  Py_INCREF(bound_launch_type);
  if (PyModule_AddObject(module, "BoundLaunch", reinterpret_cast<PyObject*>(bound_launch_type)) != 0) {
    Py_DECREF(bound_launch_type);
    Py_DECREF(module);
    return nullptr;
  }
  // `replay` for C callers (front_door.cc's ReplayFunction)
  PyObject* replay_function =
      PyCapsule_New(reinterpret_cast<void*>(ReplayCall), "kernel_api.replay", nullptr);
  if (replay_function == nullptr || PyModule_AddObject(module, "replay_function", replay_function) != 0) {
    Py_XDECREF(replay_function);
    Py_DECREF(module);
    return nullptr;
  }
  return module;
}
