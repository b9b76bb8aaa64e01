// The per-tensor loops of a message's call, in C++.
//
// tensorferry checks every tensor of a message before anything moves (type, device, layout,
// contiguity, lazy views) and describes it for the header (dtype and shape). From Python each
// of those reads is an attribute lookup costing a tenth of a microsecond or more, about seven
// per tensor: a message of 64 small tensors spent most of its host time there. inspect_plain
// makes the same reads on the tensors themselves and gives back what tensorferry/p2p/_spec.py's
// Python loop gives, or None for anything unusual, which that module then checks in detail.
// addresses reads a message's data addresses (the copy-engine route's key of a layout);
// copy_pieces launches the copies in and out of a message's packed buffer (see there).
// record_event, wait_event and query make the event and stream calls of
// tensorferry/runtime/_events.py, nccl_move a message's NCCL call and nccl_async_error the
// NCCL transport's poll;
// send_now and recv_now make the side channel's system calls holding the GIL (see each).
//
// Built on first use against the running torch (tensorferry/_native/__init__.py); never
// required: without it the Python loop, torch's copies and calls, and the socket's methods
// run.

#include <Python.h>

#include <dlfcn.h>
#include <sys/socket.h>

#include <cerrno>
#include <cstdint>

#include <algorithm>
#include <vector>

#include <torch/csrc/DynamicTypes.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/autograd/variable.h>

namespace {

bool is_listed(PyTypeObject* type, PyObject* types) {
  const Py_ssize_t n = PyTuple_GET_SIZE(types);
  for (Py_ssize_t i = 0; i < n; ++i) {
    if (reinterpret_cast<PyObject*>(type) == PyTuple_GET_ITEM(types, i)) {
      return true;
    }
  }
  return false;
}

// A new tuple of Python ints, or nullptr with a Python error set.
PyObject* shape_tuple(c10::IntArrayRef sizes) {
  PyObject* shape = PyTuple_New(static_cast<Py_ssize_t>(sizes.size()));
  if (shape == nullptr) {
    return nullptr;
  }
  for (size_t d = 0; d < sizes.size(); ++d) {
    PyObject* size = PyLong_FromLongLong(sizes[d]);
    if (size == nullptr) {
      Py_DECREF(shape);
      return nullptr;
    }
    PyTuple_SET_ITEM(shape, static_cast<Py_ssize_t>(d), size);
  }
  return shape;
}

// Whether `pair`, a (name, shape) item of a descriptor met before, describes a tensor of
// dtype `name` and sizes `sizes`: no object is made for it.
bool same_item(PyObject* pair, PyObject* name, c10::IntArrayRef sizes) {
  if (!PyTuple_Check(pair) || PyTuple_GET_SIZE(pair) != 2) {
    return false;
  }
  PyObject* known_name = PyTuple_GET_ITEM(pair, 0);
  if (known_name != name &&
      !(PyUnicode_Check(known_name) && PyUnicode_Compare(known_name, name) == 0)) {
    return false;
  }
  PyObject* shape = PyTuple_GET_ITEM(pair, 1);
  if (!PyTuple_Check(shape) || PyTuple_GET_SIZE(shape) != static_cast<Py_ssize_t>(sizes.size())) {
    return false;
  }
  for (size_t d = 0; d < sizes.size(); ++d) {
    PyObject* size = PyTuple_GET_ITEM(shape, static_cast<Py_ssize_t>(d));
    int overflow = 0;
    if (!PyLong_Check(size) || PyLong_AsLongLongAndOverflow(size, &overflow) != sizes[d] ||
        overflow != 0) {
      return false;
    }
  }
  return true;
}

enum class Walk { plain, unusual, error };

// Fills `desc` (a new tuple of len(items)) with (dtype name, shape) pairs; sets *grads when
// a tensor requires grad. `unusual` when any item is not a plain, dense, contiguous tensor of
// the first item's device with a known dtype (the caller's detailed check then names it).
// While the tensors match `hint` (a descriptor of n items, or nullptr), *hint_holds stays true
// and no pair is made: messages repeat their layouts.
Walk walk(PyObject** items, Py_ssize_t n, PyObject* types, PyObject* names, PyObject* hint,
          PyObject* desc, bool* grads, bool* hint_holds) {
  c10::Device expected(c10::kCPU);
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* item = items[i];
    if (!is_listed(Py_TYPE(item), types)) {
      return Walk::unusual;
    }
    const at::Tensor& t = THPVariable_Unpack(item);
    if (t.layout() != c10::kStrided || t.is_nested() || t.is_quantized()) {
      return Walk::unusual;
    }
    if (i == 0) {
      expected = t.device();
    } else if (t.device() != expected) {
      return Walk::unusual;
    }
    if (!t.is_contiguous() || t.is_neg() || t.is_conj()) {
      return Walk::unusual;
    }
    PyObject* dtype = reinterpret_cast<PyObject*>(torch::getTHPDtype(t.scalar_type()));
    PyObject* name = PyDict_GetItemWithError(names, dtype);  // borrowed
    if (name == nullptr) {
      return PyErr_Occurred() ? Walk::error : Walk::unusual;
    }
    const c10::IntArrayRef sizes = t.sizes();  // throws for symbolic shapes
    *grads = *grads || t.requires_grad();
    if (*hint_holds) {
      if (same_item(PyTuple_GET_ITEM(hint, i), name, sizes)) {
        continue;
      }
      *hint_holds = false;
      for (Py_ssize_t j = 0; j < i; ++j) {  // the items so far, now needed as pairs of their own
        PyObject* known = PyTuple_GET_ITEM(hint, j);
        Py_INCREF(known);
        PyTuple_SET_ITEM(desc, j, known);
      }
    }
    PyObject* shape = shape_tuple(sizes);
    if (shape == nullptr) {
      return Walk::error;
    }
    PyObject* pair = PyTuple_Pack(2, name, shape);
    Py_DECREF(shape);
    if (pair == nullptr) {
      return Walk::error;
    }
    PyTuple_SET_ITEM(desc, i, pair);
  }
  return Walk::plain;
}

// inspect_plain(items, plain_types, dtype_names, hint) -> None | (requires_grad, descriptor)
//
// items: a non-empty list or tuple; plain_types: a tuple of the tensor types taken (torch.Tensor
// and torch.nn.Parameter: subclasses with behaviour of their own go the detailed way);
// dtype_names: {torch.dtype: name} of the dtypes a message may carry; hint: a descriptor met
// before (a tuple of (name, shape) pairs) or None. The descriptor returned is `hint` itself
// when the tensors match it, else a new tuple of (name, shape) pairs, shapes as tuples.
PyObject* inspect_plain(PyObject* /*module*/, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 4 || !PyTuple_Check(args[1]) || !PyDict_Check(args[2]) ||
      !(args[3] == Py_None || PyTuple_Check(args[3]))) {
    PyErr_SetString(PyExc_TypeError,
                    "inspect_plain(items, plain_types: tuple, dtype_names: dict, hint: tuple | None)");
    return nullptr;
  }
  PyObject* seq = PySequence_Fast(args[0], "inspect_plain: items must be a list or a tuple");
  if (seq == nullptr) {
    return nullptr;
  }
  const Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
  PyObject* desc = PyTuple_New(n);
  if (desc == nullptr) {
    Py_DECREF(seq);
    return nullptr;
  }
  PyObject* hint = args[3] != Py_None && PyTuple_GET_SIZE(args[3]) == n ? args[3] : nullptr;
  bool grads = false;
  bool hint_holds = hint != nullptr;
  Walk outcome = Walk::unusual;
  try {
    outcome = walk(PySequence_Fast_ITEMS(seq), n, args[1], args[2], hint, desc, &grads,
                   &hint_holds);
  } catch (const std::exception&) {  // a tensor torch cannot answer for: the detailed way
    outcome = Walk::unusual;
  }
  Py_DECREF(seq);
  if (outcome != Walk::plain) {
    Py_DECREF(desc);  // frees the pairs made so far; unset slots are NULL, which is allowed
    if (outcome == Walk::error) {
      return nullptr;
    }
    Py_RETURN_NONE;
  }
  if (hint_holds) {
    Py_DECREF(desc);  // never filled
    return Py_BuildValue("(OO)", grads ? Py_True : Py_False, hint);
  }
  return Py_BuildValue("(ON)", grads ? Py_True : Py_False, desc);
}

// first_overlap(tensors) -> (i, j) or None: two tensors of a list or tuple whose bytes share
// memory (j's start lies within i's), or None when none do. A receive's buffers must lie apart:
// the transports write them at once. From Python each tensor's address and size cost a fraction
// of a microsecond, too much for a many-tensor message's every call.
PyObject* first_overlap(PyObject* /*module*/, PyObject* tensors) {
  if (!PyList_Check(tensors) && !PyTuple_Check(tensors)) {  // (a tensor itself iterates)
    PyErr_SetString(PyExc_TypeError, "first_overlap: tensors must be a list or a tuple");
    return nullptr;
  }
  PyObject* seq = PySequence_Fast(tensors, "first_overlap: tensors must be a list or a tuple");
  if (seq == nullptr) {
    return nullptr;
  }
  const Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
  PyObject** items = PySequence_Fast_ITEMS(seq);
  struct Span {
    uintptr_t start, end;
    Py_ssize_t index;
  };
  std::vector<Span> spans;
  spans.reserve(static_cast<size_t>(n));
  for (Py_ssize_t i = 0; i < n; ++i) {
    if (!THPVariable_Check(items[i])) {
      Py_DECREF(seq);
      PyErr_Format(PyExc_TypeError, "first_overlap: item %zd is not a tensor", i);
      return nullptr;
    }
    const at::Tensor& tensor = THPVariable_Unpack(items[i]);
    const uintptr_t nbytes = static_cast<uintptr_t>(tensor.nbytes());
    if (nbytes != 0) {
      const uintptr_t start = reinterpret_cast<uintptr_t>(tensor.data_ptr());
      spans.push_back({start, start + nbytes, i});
    }
  }
  Py_DECREF(seq);
  std::sort(spans.begin(), spans.end(), [](const Span& a, const Span& b) {
    return a.start != b.start ? a.start < b.start : a.index < b.index;
  });
  // Sorted by start: a span overlaps an earlier one exactly when it starts before the furthest
  // end so far, whose owner is then one it overlaps.
  uintptr_t furthest = 0;
  Py_ssize_t owner = -1;
  for (const Span& span : spans) {
    if (owner >= 0 && span.start < furthest) {
      return Py_BuildValue("(nn)", owner, span.index);
    }
    if (span.end > furthest) {
      furthest = span.end;
      owner = span.index;
    }
  }
  Py_RETURN_NONE;
}

// addresses(tensors) -> bytes: each tensor's data address (its data_ptr()), as native-order
// 64-bit words one after another. The copy-engine route keys what a layout came to by the
// addresses of a message's tensors; from Python each data_ptr() costs a tenth of a microsecond
// or more and a 64-tensor message's key took about ten.
PyObject* addresses(PyObject* /*module*/, PyObject* tensors) {
  if (!PyList_Check(tensors) && !PyTuple_Check(tensors)) {  // (a tensor itself iterates)
    PyErr_SetString(PyExc_TypeError, "addresses: tensors must be a list or a tuple");
    return nullptr;
  }
  PyObject* seq = PySequence_Fast(tensors, "addresses: tensors must be a list or a tuple");
  if (seq == nullptr) {
    return nullptr;
  }
  const Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
  PyObject** items = PySequence_Fast_ITEMS(seq);
  std::vector<uint64_t> words(static_cast<size_t>(n));
  for (Py_ssize_t i = 0; i < n; ++i) {
    if (!THPVariable_Check(items[i])) {
      Py_DECREF(seq);
      PyErr_Format(PyExc_TypeError, "addresses: item %zd is not a tensor", i);
      return nullptr;
    }
    words[static_cast<size_t>(i)] =
        reinterpret_cast<uintptr_t>(THPVariable_Unpack(items[i]).data_ptr());
  }
  Py_DECREF(seq);
  return PyBytes_FromStringAndSize(reinterpret_cast<const char*>(words.data()),
                                   static_cast<Py_ssize_t>(words.size() * sizeof(uint64_t)));
}

// ---------------------------------------------------------------- copying a message's pieces
// A message of many small tensors travels packed in one buffer. torch._foreach_copy_ moves the
// pieces in and out with one kernel, but its host work per tensor made it about 30 us for 64
// tensors on the GPU machine. Here one launch of tensorferry's own kernel (compiled with NVRTC
// by tensorferry/p2p/_piece_copy.py) takes the pieces' addresses as its one argument.

// The CUDA driver's entry points, found in the process (torch loaded the driver); no CUDA
// headers are needed to build this file.
using CuResult = int;
using CuLaunchKernel = CuResult (*)(void* function, unsigned grid_x, unsigned grid_y,
                                    unsigned grid_z, unsigned block_x, unsigned block_y,
                                    unsigned block_z, unsigned shared_bytes, void* stream,
                                    void** params, void** extra);
using CuCtxGetCurrent = CuResult (*)(void** context);

struct Driver {
  CuLaunchKernel launch = nullptr;
  CuCtxGetCurrent current_context = nullptr;
};

const Driver& driver() {
  static const Driver found = [] {
    Driver d;
    void* library = dlopen("libcuda.so.1", RTLD_LAZY | RTLD_NOLOAD);
    if (library != nullptr) {
      d.launch = reinterpret_cast<CuLaunchKernel>(dlsym(library, "cuLaunchKernel"));
      d.current_context = reinterpret_cast<CuCtxGetCurrent>(dlsym(library, "cuCtxGetCurrent"));
    }
    return d;
  }();
  return found;
}

// Must match tensorferry/p2p/_piece_copy.py's kernel source.
constexpr int kPiecesPerLaunch = 128;
constexpr unsigned kThreads = 256;
constexpr int64_t kBytesPerBlock = kThreads * 16 * 4;  // four 16-byte steps per thread
constexpr unsigned kMaxBlocksPerPiece = 64;

struct Piece {
  const void* src;
  void* dst;
  int64_t nbytes;
};

struct Pieces {
  int64_t count;
  Piece piece[kPiecesPerLaunch];
};

bool pointer_arg(PyObject* value, void** out) {
  *out = PyLong_AsVoidPtr(value);
  return !(*out == nullptr && PyErr_Occurred());
}

// copy_pieces(function, context, device, stream, dsts, srcs) -> bool
//
// Copies each srcs[i] into dsts[i] (tensors of CUDA device `device`, contiguous, of equal byte
// sizes) on `stream` with `function` (a CUfunction loaded in `context`, that device's). False,
// having launched nothing, when it cannot: no CUDA driver in the process, another context
// current on this thread, or a pair it does not take; the caller then copies them its own way.
// Raises after a failed launch.
PyObject* copy_pieces(PyObject* /*module*/, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 6) {
    PyErr_SetString(PyExc_TypeError,
                    "copy_pieces(function, context, device, stream, dsts, srcs)");
    return nullptr;
  }
  void* function = nullptr;
  void* context = nullptr;
  void* stream = nullptr;
  if (!pointer_arg(args[0], &function) || !pointer_arg(args[1], &context) ||
      !pointer_arg(args[3], &stream)) {
    return nullptr;
  }
  const long device = PyLong_AsLong(args[2]);
  if (device == -1 && PyErr_Occurred()) {
    return nullptr;
  }
  PyObject* dst_seq = PySequence_Fast(args[4], "copy_pieces: dsts must be a list or a tuple");
  if (dst_seq == nullptr) {
    return nullptr;
  }
  PyObject* src_seq = PySequence_Fast(args[5], "copy_pieces: srcs must be a list or a tuple");
  if (src_seq == nullptr) {
    Py_DECREF(dst_seq);
    return nullptr;
  }
  const Py_ssize_t n = PySequence_Fast_GET_SIZE(dst_seq);
  PyObject** dsts = PySequence_Fast_ITEMS(dst_seq);
  PyObject** srcs = PySequence_Fast_ITEMS(src_seq);
  const Driver& cuda = driver();
  bool usable = cuda.launch != nullptr && cuda.current_context != nullptr && function != nullptr &&
                n == PySequence_Fast_GET_SIZE(src_seq);
  if (usable) {
    void* current = nullptr;
    usable = cuda.current_context(&current) == 0 && current == context;
  }
  std::vector<Piece> pieces;
  std::vector<const at::Tensor*> written;
  try {
    for (Py_ssize_t i = 0; usable && i < n; ++i) {
      if (!THPVariable_Check(dsts[i]) || !THPVariable_Check(srcs[i])) {
        usable = false;
        break;
      }
      const at::Tensor& dst = THPVariable_Unpack(dsts[i]);
      const at::Tensor& src = THPVariable_Unpack(srcs[i]);
      usable = dst.is_cuda() && src.is_cuda() && dst.layout() == c10::kStrided &&
               src.layout() == c10::kStrided && dst.is_contiguous() && src.is_contiguous() &&
               dst.nbytes() == src.nbytes() && dst.get_device() == device &&
               src.get_device() == device;
      if (usable && dst.nbytes() > 0) {
        pieces.push_back({src.const_data_ptr(), dst.data_ptr(), static_cast<int64_t>(dst.nbytes())});
        written.push_back(&dst);
      }
    }
  } catch (const std::exception&) {
    usable = false;
  }
  if (!usable) {
    Py_DECREF(dst_seq);
    Py_DECREF(src_seq);
    Py_RETURN_FALSE;
  }
  CuResult failed = 0;
  size_t launched = 0;
  while (launched < pieces.size() && failed == 0) {
    Pieces batch;
    batch.count = static_cast<int64_t>(
        std::min<size_t>(kPiecesPerLaunch, pieces.size() - launched));
    int64_t largest = 0;
    for (int64_t k = 0; k < batch.count; ++k) {
      batch.piece[k] = pieces[launched + k];
      largest = std::max(largest, batch.piece[k].nbytes);
    }
    const unsigned blocks = static_cast<unsigned>(std::min<int64_t>(
        kMaxBlocksPerPiece, (largest + kBytesPerBlock - 1) / kBytesPerBlock));
    void* params[] = {&batch};  // copied by the driver at launch
    failed = cuda.launch(function, static_cast<unsigned>(batch.count), blocks, 1, kThreads, 1,
                         1, 0, stream, params, nullptr);
    if (failed == 0) {
      launched += static_cast<size_t>(batch.count);
    }
  }
  if (launched > 0) {
    // Written in place, as copy_ would: autograd's checks of saved tensors see the change.
    for (const at::Tensor* dst : written) {
      if (!dst->is_inference()) {
        torch::autograd::impl::bump_version(*dst);
      }
    }
  }
  Py_DECREF(dst_seq);
  Py_DECREF(src_seq);
  if (failed != 0 && launched == 0) {
    Py_RETURN_FALSE;  // nothing moved: the caller's own copy runs (and reports a sticky error)
  }
  if (failed != 0) {
    PyErr_Format(PyExc_RuntimeError,
                 "tensorferry: launching the piece copy failed (CUDA driver error %d) after "
                 "%zu of %zu pieces",
                 failed, launched, pieces.size());
    return nullptr;
  }
  Py_RETURN_TRUE;
}

// ---------------------------------------------------------------- CUDA and NCCL calls
// The entry points are passed as addresses the caller found (tensorferry/runtime/_events.py,
// tensorferry/p2p/_nccl_lib.py), so nothing of CUDA or NCCL is needed to build this file.
using CudaStreamWaitEvent = int (*)(void* stream, void* event, unsigned flags);
using CudaEventRecord = int (*)(void* event, void* stream);
using CudaQuery = int (*)(void* handle);  // cudaEventQuery, cudaStreamQuery
using NcclAsyncError = int (*)(void* comm, int* result);
using NcclMove = int (*)(const void* buffer, size_t count, int datatype, int peer, void* comm,
                         void* stream);

// `move` (ncclSend or ncclRecv) of `nbytes` at `buffer` on `stream`: the code it returned. The
// GIL is released around it unless `hold_gil` (see nccl_move for when a caller may keep it).
int move_bytes(void* move, const void* buffer, size_t nbytes, int datatype, int peer, void* comm,
               void* stream, bool hold_gil) {
  const auto call = [&] {
    return reinterpret_cast<NcclMove>(move)(buffer, nbytes, datatype, peer, comm, stream);
  };
  if (hold_gil) {
    return call();
  }
  int code = 0;
  Py_BEGIN_ALLOW_THREADS
  code = call();
  Py_END_ALLOW_THREADS
  return code;
}

// record_event(record, event, stream) -> int, wait_event(wait, stream, event, flags) -> int,
// query(entry, handle) -> int
//
// cudaEventRecord, cudaStreamWaitEvent and cudaEventQuery or cudaStreamQuery through the entry
// points `record`, `wait` and `entry` (addresses the caller found: tensorferry/runtime/_events.py),
// the GIL held; each returns the CUDA call's code. What ctypes makes of the same calls costs a
// microsecond or more of argument conversion on the GPU machine's host, and the p2p layer makes
// one to three of them per message (and one per poll of a transfer in flight).
bool event_call_args(PyObject* const* args, Py_ssize_t nargs, Py_ssize_t expected,
                     const char* usage, void** pointers) {
  if (nargs != expected) {
    PyErr_SetString(PyExc_TypeError, usage);
    return false;
  }
  for (Py_ssize_t i = 0; i < nargs; ++i) {
    if (!pointer_arg(args[i], &pointers[i])) {
      return false;
    }
  }
  if (pointers[0] == nullptr) {
    PyErr_SetString(PyExc_ValueError, "a null entry point");
    return false;
  }
  return true;
}

PyObject* record_event(PyObject* /*module*/, PyObject* const* args, Py_ssize_t nargs) {
  void* p[3];
  if (!event_call_args(args, nargs, 3, "record_event(record, event, stream)", p)) {
    return nullptr;
  }
  return PyLong_FromLong(reinterpret_cast<CudaEventRecord>(p[0])(p[1], p[2]));
}

PyObject* wait_event(PyObject* /*module*/, PyObject* const* args, Py_ssize_t nargs) {
  void* p[4];
  if (!event_call_args(args, nargs, 4, "wait_event(wait, stream, event, flags)", p)) {
    return nullptr;
  }
  const auto flags = static_cast<unsigned>(reinterpret_cast<uintptr_t>(p[3]));
  return PyLong_FromLong(reinterpret_cast<CudaStreamWaitEvent>(p[0])(p[1], p[2], flags));
}

PyObject* query(PyObject* /*module*/, PyObject* const* args, Py_ssize_t nargs) {
  void* p[2];
  if (!event_call_args(args, nargs, 2, "query(entry, handle)", p)) {
    return nullptr;
  }
  return PyLong_FromLong(reinterpret_cast<CudaQuery>(p[0])(p[1]));
}

// nccl_move(move, buffer, nbytes, datatype, peer, comm, stream, hold_gil) -> int
//
// `move` (ncclSend or ncclRecv, outside any group) of `nbytes` at the address `buffer` as
// `datatype` on `stream`: the code it returned; through ctypes its seven arguments cost
// microseconds of conversion.
//
// The GIL is released around `move` unless `hold_gil` is true. Released, another of the
// process's threads (the completion pool's poller, in a burst of sends) takes it while NCCL
// launches, and the caller waits for that thread to let go of it again: tens of microseconds
// per call. Held, nothing else of the process runs while `move` does, so the caller holds it
// only where `move` cannot block for long: with few transfers in flight, the device's launch
// queue has room, and a connected pair's send or receive only launches.
PyObject* nccl_move(PyObject* /*module*/, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 8) {
    PyErr_SetString(PyExc_TypeError,
                    "nccl_move(move, buffer, nbytes, datatype, peer, comm, stream, hold_gil)");
    return nullptr;
  }
  void* move = nullptr;
  void* buffer = nullptr;
  void* comm = nullptr;
  void* stream = nullptr;
  if (!pointer_arg(args[0], &move) || !pointer_arg(args[1], &buffer) ||
      !pointer_arg(args[5], &comm) || !pointer_arg(args[6], &stream)) {
    return nullptr;
  }
  const Py_ssize_t nbytes = PyLong_AsSsize_t(args[2]);
  const long datatype = PyLong_AsLong(args[3]);
  const long peer = PyLong_AsLong(args[4]);
  if ((nbytes == -1 || datatype == -1 || peer == -1) && PyErr_Occurred()) {
    return nullptr;
  }
  const int hold_gil = PyObject_IsTrue(args[7]);
  if (hold_gil < 0) {
    return nullptr;
  }
  if (move == nullptr || nbytes < 0) {
    PyErr_SetString(PyExc_ValueError, "nccl_move: a null entry point or a negative size");
    return nullptr;
  }
  return PyLong_FromLong(move_bytes(move, buffer, static_cast<size_t>(nbytes),
                                    static_cast<int>(datatype), static_cast<int>(peer), comm,
                                    stream, hold_gil != 0));
}

// nccl_async_error(entry, comm) -> int
//
// ncclCommGetAsyncError(comm, &result) through its entry point `entry`, the GIL held: the
// result (0 when nothing went wrong in the background), or minus the call's own error code.
// Every poll of an NCCL transfer in flight asks it; through ctypes (an int made, two
// arguments converted, one passed by reference) that cost microseconds on the GPU machine.
PyObject* nccl_async_error(PyObject* /*module*/, PyObject* const* args, Py_ssize_t nargs) {
  void* p[2];
  if (!event_call_args(args, nargs, 2, "nccl_async_error(entry, comm)", p)) {
    return nullptr;
  }
  int result = 0;
  const int code = reinterpret_cast<NcclAsyncError>(p[0])(p[1], &result);
  return PyLong_FromLong(code != 0 ? -code : result);
}

// The arguments of send_now and recv_now: a socket's file descriptor and a buffer, taken with
// `flags` (PyBUF_SIMPLE, or PyBUF_WRITABLE to write into it). False with a Python error set.
bool socket_call_args(PyObject* const* args, Py_ssize_t nargs, const char* usage, int flags,
                      int* fd, Py_buffer* buffer) {
  if (nargs != 2) {
    PyErr_SetString(PyExc_TypeError, usage);
    return false;
  }
  const long number = PyLong_AsLong(args[0]);
  if (number == -1 && PyErr_Occurred()) {
    return false;
  }
  *fd = static_cast<int>(number);
  return PyObject_GetBuffer(args[1], buffer, flags) == 0;
}

// send_now(fd, data) -> int
//
// send(2) of the bytes-like `data` on the socket `fd` without waiting, the GIL held: the
// bytes written, or minus the errno. Python's socket methods let go of the GIL around their
// system call, and a thread of the process that wants it then (the p2p engine's, woken by a
// peer's frame; the completion pool's poller) takes it, so the caller waits for that thread's
// whole turn. A call that never waits costs nothing held.
PyObject* send_now(PyObject* /*module*/, PyObject* const* args, Py_ssize_t nargs) {
  int fd = -1;
  Py_buffer data;
  if (!socket_call_args(args, nargs, "send_now(fd, data)", PyBUF_SIMPLE, &fd, &data)) {
    return nullptr;
  }
  const ssize_t sent =
      ::send(fd, data.buf, static_cast<size_t>(data.len), MSG_DONTWAIT | MSG_NOSIGNAL);
  const int error = errno;
  PyBuffer_Release(&data);
  return PyLong_FromSsize_t(sent >= 0 ? sent : -static_cast<ssize_t>(error));
}

// recv_now(fd, buffer) -> int
//
// recv(2) into the writable bytes-like `buffer` from the socket `fd` without waiting, the GIL
// held (see send_now): the bytes read (0 at the end of the stream), or minus the errno.
PyObject* recv_now(PyObject* /*module*/, PyObject* const* args, Py_ssize_t nargs) {
  int fd = -1;
  Py_buffer buffer;
  if (!socket_call_args(args, nargs, "recv_now(fd, buffer)", PyBUF_WRITABLE, &fd, &buffer)) {
    return nullptr;
  }
  const ssize_t got = ::recv(fd, buffer.buf, static_cast<size_t>(buffer.len), MSG_DONTWAIT);
  const int error = errno;
  PyBuffer_Release(&buffer);
  return PyLong_FromSsize_t(got >= 0 ? got : -static_cast<ssize_t>(error));
}

PyMethodDef methods[] = {
    {"inspect_plain", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(inspect_plain)),
     METH_FASTCALL, "Validates and describes a message's tensors in one pass (or None)."},
    {"first_overlap", first_overlap, METH_O, "Two tensors whose bytes share memory, or None."},
    {"addresses", addresses, METH_O, "The tensors' data addresses as 64-bit words."},
    {"copy_pieces", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(copy_pieces)),
     METH_FASTCALL, "Copies tensors into tensors with one kernel launch (or returns False)."},
    {"record_event", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(record_event)),
     METH_FASTCALL, "cudaEventRecord through its entry point, the GIL held."},
    {"wait_event", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(wait_event)),
     METH_FASTCALL, "cudaStreamWaitEvent through its entry point, the GIL held."},
    {"query", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(query)),
     METH_FASTCALL, "cudaEventQuery or cudaStreamQuery through its entry point, the GIL held."},
    {"nccl_move", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(nccl_move)),
     METH_FASTCALL, "ncclSend or ncclRecv outside any group through its entry point."},
    {"nccl_async_error",
     reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(nccl_async_error)),
     METH_FASTCALL, "ncclCommGetAsyncError through its entry point, the GIL held."},
    {"send_now", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(send_now)),
     METH_FASTCALL, "send(2) without waiting, the GIL held."},
    {"recv_now", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(recv_now)),
     METH_FASTCALL, "recv(2) without waiting, the GIL held."},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "_tensorferry_native", "tensorferry's compiled helpers.", -1, methods,
};

}  // namespace

PyMODINIT_FUNC PyInit__tensorferry_native(void) { return PyModule_Create(&module_def); }
