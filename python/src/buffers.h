// Float32 memory borrowed from Python objects without a copy: anything exporting a C-contiguous
// float32 buffer (numpy arrays, memoryviews, array('f')) and CPU torch.Tensors (which export no
// buffer; their data pointer is read through the tensor's own methods).
#pragma once

#include <Python.h>

#include <cstddef>
#include <string>

namespace pskv::python {

// str(object) in UTF-8, or "?" if that fails (the Python error is cleared). For messages.
std::string str_of(PyObject* object);

enum class Access { read, write };

// Keeps the Python object (and, for a buffer export, the export itself, which stops numpy from
// resizing or freeing the array) alive until destroyed.
// Thread-safety: constructed, moved and destroyed with the GIL held; data() may be used without
// it for as long as the object lives.
class HeldBuffer {
 public:
  HeldBuffer() = default;
  // Throws pskv::Error(invalid_argument) naming what is wrong with `object`; never converts.
  // `what` names the argument in messages (e.g. "push value 3").
  HeldBuffer(PyObject* object, Access access, const char* what, std::size_t index);
  HeldBuffer(HeldBuffer&& other) noexcept;
  HeldBuffer& operator=(HeldBuffer&& other) noexcept;
  HeldBuffer(const HeldBuffer&) = delete;
  HeldBuffer& operator=(const HeldBuffer&) = delete;
  ~HeldBuffer() { reset(); }

  float* data() const noexcept { return data_; }
  std::size_t floats() const noexcept { return floats_; }
  bool empty() const noexcept { return owner_ == nullptr && !has_view_; }
  void reset() noexcept;

 private:
  void from_tensor(PyObject* tensor, const char* what, std::size_t index);

  Py_buffer view_{};
  bool has_view_ = false;
  PyObject* owner_ = nullptr;  // strong reference for tensors
  float* data_ = nullptr;
  std::size_t floats_ = 0;
};

}  // namespace pskv::python
