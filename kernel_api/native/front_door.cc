// Module `_front_door`: kernel_api.ops' front doors as C functions.
//
// A repeated call that the native replay serves spends most of its time over torch's own call in
// Python: the front door's frame (binding its keywords, building **operands, the Dynamo check)
// costs as much as the call key. A front door made here binds the call's arguments to the
// function's parameters (names and defaults given by Python: no rule of any operation), asks the
// replay, and runs Python only when the replay has nothing: then `unreplayed`, the Python front
// door less its replay attempt, with the call's own arguments. Before the replay is handed over
// (set_replay, when kernel_api loads the native library) every call goes to `python`, the whole
// Python front door. Under torch.compile Dynamo traces the Python front door in this function's
// place (kernel_api.ops.front_doors registers it with torch._dynamo.substitute_in_graph).
//
// This module depends on neither torch nor TVM-FFI, so importing it costs kernel_api's import
// nothing measurable; the replay comes from `_launch_table` as a C function in a capsule.
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <cstring>
#include <string>
#include <vector>

namespace {

constexpr const char* kReplayCapsule = "kernel_api.replay";
// replay(op, args, n) -> the result (a new reference), Py_None (a new reference) when nothing is
// recorded for the call, or nullptr with a Python error.
using ReplayFunction = PyObject* (*)(long long op, PyObject* const* args, Py_ssize_t n);
ReplayFunction replay = nullptr;

constexpr int kMaxParameters = 32;

struct FrontDoor {
  PyObject_HEAD
  PyMethodDef def;
  std::string* name;  // def.ml_name and def.ml_doc point into these
  std::string* doc;
  long long op;
  PyObject* python;      // the Python front door
  PyObject* unreplayed;  // the Python front door less its replay attempt
  PyObject* names;       // parameter names (interned str), positional ones first
  PyObject* defaults;    // one per name; `required` where there is none
  PyObject* required;
  PyObject* module_name;  // the Python front door's module, which holds this one under its name
  int n_positional;
  std::vector<int>* key;           // the replay's arguments: parameter indices, in order
  std::vector<int>* default_only;  // parameters the replay serves only at their defaults
};

void FrontDoorDealloc(PyObject* self_object) {
  auto* self = reinterpret_cast<FrontDoor*>(self_object);
  PyObject_GC_UnTrack(self_object);
  Py_XDECREF(self->python);
  Py_XDECREF(self->unreplayed);
  Py_XDECREF(self->names);
  Py_XDECREF(self->defaults);
  Py_XDECREF(self->required);
  Py_XDECREF(self->module_name);
  delete self->name;
  delete self->doc;
  delete self->key;
  delete self->default_only;
  PyObject_GC_Del(self_object);
}

int FrontDoorTraverse(PyObject* self_object, visitproc visit, void* arg) {
  auto* self = reinterpret_cast<FrontDoor*>(self_object);
  Py_VISIT(self->python);
  Py_VISIT(self->unreplayed);
  Py_VISIT(self->defaults);
  return 0;
}

// Pickling a front door (builtin functions pickle as getattr(their __self__, name)): the door
// reduces to its module, importlib.import_module(name), whose attribute is the front door again.
PyObject* FrontDoorReduce(PyObject* self_object, PyObject*) {
  const auto* self = reinterpret_cast<FrontDoor*>(self_object);
  if (self->module_name == nullptr) {
    PyErr_SetString(PyExc_TypeError, "a front door without a module cannot be pickled");
    return nullptr;
  }
  PyObject* importlib = PyImport_ImportModule("importlib");
  if (importlib == nullptr) return nullptr;
  PyObject* import_module = PyObject_GetAttrString(importlib, "import_module");
  Py_DECREF(importlib);
  if (import_module == nullptr) return nullptr;
  PyObject* reduced = Py_BuildValue("(N(O))", import_module, self->module_name);
  return reduced;
}

PyMethodDef front_door_methods[] = {
    {"__reduce__", FrontDoorReduce, METH_NOARGS, "Pickled as the module that holds the front door."},
    {nullptr, nullptr, 0, nullptr},
};

PyType_Slot front_door_slots[] = {
    {Py_tp_dealloc, reinterpret_cast<void*>(FrontDoorDealloc)},
    {Py_tp_traverse, reinterpret_cast<void*>(FrontDoorTraverse)},
    {Py_tp_methods, front_door_methods},
    {0, nullptr},
};
PyType_Spec front_door_spec = {"kernel_api.native._front_door.FrontDoor", sizeof(FrontDoor), 0,
                               Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC, front_door_slots};
PyTypeObject* front_door_type = nullptr;

// The index of keyword `name` among the parameters, or -1.
int ParameterIndex(const FrontDoor& door, PyObject* name) {
  const Py_ssize_t n = PyTuple_GET_SIZE(door.names);
  for (Py_ssize_t i = 0; i < n; ++i) {
    if (PyTuple_GET_ITEM(door.names, i) == name) return static_cast<int>(i);  // (interned: the usual case)
  }
  for (Py_ssize_t i = 0; i < n; ++i) {
    const int equal = PyUnicode_Compare(PyTuple_GET_ITEM(door.names, i), name);
    if (equal == 0) return static_cast<int>(i);
    if (equal == -1 && PyErr_Occurred()) PyErr_Clear();
  }
  return -1;
}

PyObject* Call(PyObject* self_object, PyObject* const* args, Py_ssize_t nargs, PyObject* kwnames) {
  const FrontDoor& door = *reinterpret_cast<FrontDoor*>(self_object);
  if (replay == nullptr) return PyObject_Vectorcall(door.python, args, static_cast<size_t>(nargs), kwnames);
  const Py_ssize_t n_keywords = kwnames == nullptr ? 0 : PyTuple_GET_SIZE(kwnames);
  const Py_ssize_t n = PyTuple_GET_SIZE(door.names);
  // The arguments bound to the parameters; a call this cannot bind plainly (too many positional
  // arguments, a keyword given twice or unknown, a required one missing) goes to Python, which
  // binds it or explains.
  PyObject* bound[kMaxParameters];
  bool given[kMaxParameters] = {};
  bool plain = nargs <= door.n_positional;
  for (Py_ssize_t i = 0; plain && i < nargs; ++i) {
    bound[i] = args[i];
    given[i] = true;
  }
  for (Py_ssize_t i = 0; plain && i < n_keywords; ++i) {
    const int at = ParameterIndex(door, PyTuple_GET_ITEM(kwnames, i));
    if (at < 0 || given[at]) {
      plain = false;
    } else {
      bound[at] = args[nargs + i];
      given[at] = true;
    }
  }
  for (Py_ssize_t i = 0; plain && i < n; ++i) {
    if (!given[i]) {
      bound[i] = PyTuple_GET_ITEM(door.defaults, i);
      plain = bound[i] != door.required;
    }
  }
  for (int i : *door.default_only) {
    if (plain && bound[i] != PyTuple_GET_ITEM(door.defaults, i)) plain = false;
  }
  if (plain) {
    PyObject* picked[kMaxParameters];
    Py_ssize_t n_picked = 0;
    for (int i : *door.key) picked[n_picked++] = bound[i];
    PyObject* result = replay(door.op, picked, n_picked);
    if (result == nullptr) return nullptr;
    if (result != Py_None) return result;
    Py_DECREF(result);
  }
  return PyObject_Vectorcall(plain ? door.unreplayed : door.python, args, static_cast<size_t>(nargs), kwnames);
}

// A tuple of ints as a vector of indices below `limit`; false with a Python error otherwise.
bool Indices(PyObject* tuple, Py_ssize_t limit, std::vector<int>* out) {
  if (!PyTuple_Check(tuple)) {
    PyErr_SetString(PyExc_TypeError, "make: indices must be a tuple of ints");
    return false;
  }
  for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(tuple); ++i) {
    const long value = PyLong_AsLong(PyTuple_GET_ITEM(tuple, i));
    if (value == -1 && PyErr_Occurred()) return false;
    if (value < 0 || value >= limit) {
      PyErr_SetString(PyExc_ValueError, "make: an index names no parameter");
      return false;
    }
    out->push_back(static_cast<int>(value));
  }
  return true;
}

// make(name, doc, op, python, unreplayed, n_positional, names, defaults, required, key, default_only)
PyObject* Make(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 11) {
    PyErr_SetString(PyExc_TypeError, "make(name, doc, op, python, unreplayed, n_positional, names, defaults, required, "
                                     "key, default_only)");
    return nullptr;
  }
  if (!PyUnicode_Check(args[0]) || !PyUnicode_Check(args[1]) || !PyCallable_Check(args[3]) ||
      !PyCallable_Check(args[4]) || !PyTuple_Check(args[6]) || !PyTuple_Check(args[7]) ||
      PyTuple_GET_SIZE(args[6]) != PyTuple_GET_SIZE(args[7]) || PyTuple_GET_SIZE(args[6]) > kMaxParameters) {
    PyErr_SetString(PyExc_TypeError, "make: name and doc str, python and unreplayed callable, names and defaults "
                                     "tuples of one length (at most 32)");
    return nullptr;
  }
  const long long op = PyLong_AsLongLong(args[2]);
  const long n_positional = PyLong_AsLong(args[5]);
  if ((op == -1 || n_positional == -1) && PyErr_Occurred()) return nullptr;
  const Py_ssize_t n = PyTuple_GET_SIZE(args[6]);
  if (n_positional < 0 || n_positional > n) {
    PyErr_SetString(PyExc_ValueError, "make: n_positional exceeds the parameters");
    return nullptr;
  }
  PyObject* names = PyTuple_New(n);
  if (names == nullptr) return nullptr;
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* name = PyTuple_GET_ITEM(args[6], i);
    if (!PyUnicode_CheckExact(name)) {
      Py_DECREF(names);
      PyErr_SetString(PyExc_TypeError, "make: parameter names must be str");
      return nullptr;
    }
    Py_INCREF(name);
    PyUnicode_InternInPlace(&name);
    PyTuple_SET_ITEM(names, i, name);
  }
  auto* door = PyObject_GC_New(FrontDoor, front_door_type);
  if (door == nullptr) {
    Py_DECREF(names);
    return nullptr;
  }
  door->name = new std::string(PyUnicode_AsUTF8(args[0]));
  door->doc = new std::string(PyUnicode_AsUTF8(args[1]));
  door->key = new std::vector<int>();
  door->default_only = new std::vector<int>();
  door->op = op;
  door->n_positional = static_cast<int>(n_positional);
  door->names = names;
  Py_INCREF(args[3]);
  door->python = args[3];
  Py_INCREF(args[4]);
  door->unreplayed = args[4];
  Py_INCREF(args[7]);
  door->defaults = args[7];
  Py_INCREF(args[8]);
  door->required = args[8];
  door->module_name = PyObject_GetAttrString(args[3], "__module__");
  if (door->module_name == nullptr) PyErr_Clear();
  door->def = {door->name->c_str(), reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(Call)),
               METH_FASTCALL | METH_KEYWORDS, door->doc->c_str()};
  PyObject_GC_Track(reinterpret_cast<PyObject*>(door));
  if (!Indices(args[9], n, door->key) || !Indices(args[10], n, door->default_only)) {
    Py_DECREF(door);
    return nullptr;
  }
  // (the function holds the door, whose def it points at; its __module__ is the Python function's)
  PyObject* function = PyCFunction_NewEx(&door->def, reinterpret_cast<PyObject*>(door), door->module_name);
  Py_DECREF(door);
  return function;
}

// set_replay(capsule | None): the replay front doors ask from now on (None: none; calls go to Python).
PyObject* SetReplay(PyObject*, PyObject* capsule) {
  if (capsule == Py_None) {
    replay = nullptr;
    Py_RETURN_NONE;
  }
  void* function = PyCapsule_GetPointer(capsule, kReplayCapsule);
  if (function == nullptr) return nullptr;
  replay = reinterpret_cast<ReplayFunction>(function);
  Py_RETURN_NONE;
}

PyMethodDef methods[] = {
    {"make", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(Make)), METH_FASTCALL,
     "make(name, doc, op, python, unreplayed, n_positional, names, defaults, required, key, default_only) -> "
     "a front door"},
    {"set_replay", SetReplay, METH_O, "set_replay(capsule | None): the replay front doors ask."},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_front_door", nullptr, -1, methods,
                          nullptr, nullptr, nullptr, nullptr};

}  // namespace

#ifndef KERNEL_API_SOURCE_DIGEST
#define KERNEL_API_SOURCE_DIGEST ""
#endif

extern "C" __attribute__((visibility("default"))) PyObject* PyInit__front_door() {
  PyObject* module = PyModule_Create(&module_def);
  if (module == nullptr) return nullptr;
#ifdef Py_GIL_DISABLED
  PyUnstable_Module_SetGIL(module, Py_MOD_GIL_USED);
#endif
  if (front_door_type == nullptr) {
    front_door_type = reinterpret_cast<PyTypeObject*>(PyType_FromSpec(&front_door_spec));
    if (front_door_type == nullptr) {
      Py_DECREF(module);
      return nullptr;
    }
  }
  if (PyModule_AddStringConstant(module, "source_digest", KERNEL_API_SOURCE_DIGEST) != 0) {
    Py_DECREF(module);
    return nullptr;
  }
  return module;
}
