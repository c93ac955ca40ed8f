#include "buffers.h"

#include <cstring>
#include <string>
#include <utility>

#include "pskv/error.h"

namespace pskv::python {

namespace {

[[noreturn]] void reject(const char* what, std::size_t index, const std::string& why) {
  std::string name = what;
  if (index != static_cast<std::size_t>(-1)) name += " " + std::to_string(index);
  throw Error(Errc::invalid_argument, name + ": " + why);
}

// struct-module format codes that mean a native float32.
bool is_float32_format(const char* format) {
  if (format == nullptr) return false;  // bytes-like without a format: unsigned bytes
  if (format[0] == '@' || format[0] == '=' || format[0] == '<') ++format;
  return std::strcmp(format, "f") == 0;
}

// torch is never imported by pskv: a Tensor can only exist once the user imported torch.
// What from_tensor compares against, looked up once torch is there and kept for the process's
// lifetime; null until then.
struct TorchObjects {
  PyObject* tensor_type;
  PyObject* float32;
  PyObject* strided;
};

const TorchObjects* torch_objects() {
  static TorchObjects objects{};
  if (objects.tensor_type) return &objects;
  PyObject* modules = PyImport_GetModuleDict();
  PyObject* torch = PyDict_GetItemString(modules, "torch");
  if (!torch) return nullptr;
  PyObject* tensor_type = PyObject_GetAttrString(torch, "Tensor");
  PyObject* float32 = PyObject_GetAttrString(torch, "float32");
  PyObject* strided = PyObject_GetAttrString(torch, "strided");
  if (!tensor_type || !float32 || !strided) {
    PyErr_Clear();
    Py_XDECREF(tensor_type);
    Py_XDECREF(float32);
    Py_XDECREF(strided);
    return nullptr;
  }
  objects = {tensor_type, float32, strided};
  return &objects;
}

// Calls a no-argument method or reads an attribute; returns a new reference, never null.
PyObject* get(PyObject* object, const char* name, bool call) {
  PyObject* r = call ? PyObject_CallMethod(object, name, nullptr) : PyObject_GetAttrString(object, name);
  if (!r) {
    PyErr_Clear();
    throw Error(Errc::invalid_argument, std::string("cannot read tensor.") + name);
  }
  return r;
}

// Rejects unless tensor.<attribute> == expected (torch's dtypes and layouts are singletons, so
// this is an identity test); the message is "is a <its value> tensor<why>".
void require_attribute(PyObject* tensor, const char* attribute, PyObject* expected, const char* what, std::size_t index,
                       const char* why) {
  PyObject* value = get(tensor, attribute, false);
  const int equal = PyObject_RichCompareBool(value, expected, Py_EQ);
  if (equal < 0) PyErr_Clear();
  if (equal == 1) {
    Py_DECREF(value);
    return;
  }
  const std::string name = str_of(value);
  Py_DECREF(value);
  reject(what, index, "is a " + name + " tensor" + why);
}

}  // namespace

std::string str_of(PyObject* object) {
  PyObject* s = PyObject_Str(object);
  if (!s) {
    PyErr_Clear();
    return "?";
  }
  const char* c = PyUnicode_AsUTF8(s);
  if (!c) PyErr_Clear();
  std::string out = c ? c : "?";
  Py_DECREF(s);
  return out;
}

HeldBuffer::HeldBuffer(PyObject* object, Access access, const char* what, std::size_t index) {
  if (PyObject_CheckBuffer(object)) {
    if (PyObject_GetBuffer(object, &view_, PyBUF_FORMAT | PyBUF_STRIDES) != 0) {
      PyErr_Clear();
      reject(what, index, "its buffer cannot be exported");
    }
    has_view_ = true;
    if (!is_float32_format(view_.format) || view_.itemsize != 4) {
      const std::string format = view_.format ? view_.format : "B";
      reset();
      reject(what, index,
             "has element format '" + format +
                 "', not float32 ('f'); pskv moves float32 only and never converts "
                 "(use .astype(numpy.float32), or .float() for a tensor)");
    }
    if (!PyBuffer_IsContiguous(&view_, 'C')) {
      reset();
      reject(what, index,
             "is not C-contiguous; pass a contiguous array (numpy.ascontiguousarray) so it can be "
             "read or written in place");
    }
    if (access == Access::write && view_.readonly) {
      reset();
      reject(what, index, "is read-only, so a pull cannot land in it; pass a writable float32 array");
    }
    data_ = static_cast<float*>(view_.buf);
    floats_ = static_cast<std::size_t>(view_.len) / sizeof(float);
    return;
  }
  const TorchObjects* torch = torch_objects();
  if (torch) {
    const int is_tensor = PyObject_IsInstance(object, torch->tensor_type);
    if (is_tensor < 0) PyErr_Clear();
    if (is_tensor == 1) {
      from_tensor(object, what, index);
      return;
    }
  }
  reject(what, index,
         std::string("is a ") + Py_TYPE(object)->tp_name +
             "; pass a C-contiguous float32 buffer (numpy array, memoryview, array('f')) or a CPU torch.Tensor");
}

void HeldBuffer::from_tensor(PyObject* tensor, const char* what, std::size_t index) {
  const TorchObjects& torch = *torch_objects();  // found, or this would not be a tensor
  // Names are built only for the messages: this runs for every tensor of every push and pull.
  PyObject* device = get(tensor, "device", false);
  PyObject* device_type = get(device, "type", false);
  const bool on_cpu = PyUnicode_Check(device_type) && PyUnicode_CompareWithASCIIString(device_type, "cpu") == 0;
  Py_DECREF(device_type);
  if (!on_cpu) {
    const std::string device_name = str_of(device);
    Py_DECREF(device);
    reject(what, index,
           "is a tensor on " + device_name +
               "; pskv reads and writes CPU memory only (CUDA tensors "
               "are not supported): move it with .cpu() first");
  }
  Py_DECREF(device);
  require_attribute(tensor, "dtype", torch.float32, what, index,
                    "; pskv moves float32 only and never converts (use .float())");
  require_attribute(tensor, "layout", torch.strided, what, index, "; pass a dense tensor");
  PyObject* contiguous = get(tensor, "is_contiguous", true);
  const bool is_contiguous = PyObject_IsTrue(contiguous) == 1;
  Py_DECREF(contiguous);
  if (!is_contiguous)
    reject(what, index, "is a non-contiguous tensor; pass .contiguous() so it can be read or written in place");
  PyObject* pointer = get(tensor, "data_ptr", true);
  PyObject* numel = get(tensor, "numel", true);
  data_ = static_cast<float*>(PyLong_AsVoidPtr(pointer));
  floats_ = PyLong_AsSize_t(numel);
  Py_DECREF(pointer);
  Py_DECREF(numel);
  if (PyErr_Occurred()) {
    PyErr_Clear();
    reject(what, index, "has an unreadable data pointer or size");
  }
  Py_INCREF(tensor);
  owner_ = tensor;
}

HeldBuffer::HeldBuffer(HeldBuffer&& other) noexcept
    : view_(other.view_), has_view_(other.has_view_), owner_(other.owner_), data_(other.data_), floats_(other.floats_) {
  other.has_view_ = false;
  other.owner_ = nullptr;
}

HeldBuffer& HeldBuffer::operator=(HeldBuffer&& other) noexcept {
  if (this != &other) {
    reset();
    view_ = other.view_;
    has_view_ = std::exchange(other.has_view_, false);
    owner_ = std::exchange(other.owner_, nullptr);
    data_ = other.data_;
    floats_ = other.floats_;
  }
  return *this;
}

void HeldBuffer::reset() noexcept {
  if (has_view_) {
    PyBuffer_Release(&view_);
    has_view_ = false;
  }
  Py_CLEAR(owner_);
  data_ = nullptr;
  floats_ = 0;
}

}  // namespace pskv::python
