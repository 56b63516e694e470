//@ ch00
// Python bindings of the acme vendor runtime. Plain pybind11 over the C API:
// no PyTorch here, so chapter 0 can drive the device before any integration.
#include "python/runtime_bindings.h"

#include <cstdint>
#include <string>
#include <utility>

#include "runtime/acme_runtime.h"
//> ch06 bindings-streams-include
#include "runtime/acme_streams.h"
//< ch06 bindings-streams-include
//> ch11 bindings-device-include
#include "runtime/acme_device.h"
#include "runtime/acme_host.h"
//< ch11 bindings-device-include
//> ch19 bindings-activity-include
#include "runtime/acme_activity.h"
//< ch19 bindings-activity-include

namespace py = pybind11;

namespace {

// The AcmeError class. Deliberately never released: a py::object in a static
// would be destroyed after the interpreter is gone.
PyObject* acme_error_type = nullptr;

// A failed runtime call on its way out of a binding; becomes an AcmeError.
struct Failure {
  acmeError_t code;
  std::string message;
};

void check(acmeError_t code) {
  // The last-error message is per thread: read it before anything else runs.
  if (code != acmeSuccess) throw Failure{code, acmeGetLastErrorMessage()};
}

// Copies may be long and other Python threads may use the device meanwhile,
// so the call runs without the GIL (on the same thread, so check() still
// reads this call's message).
template <class Call>
void call_without_gil(Call&& call) {
  acmeError_t code;
  {
    py::gil_scoped_release no_gil;
    code = call();
  }
  check(code);
}

void set_acme_error(const Failure& f) {
  const std::string text = std::string(acmeGetErrorName(f.code)) + ": " + f.message;
  // "replace": an echoed environment value need not be valid UTF-8.
  PyObject* message = PyUnicode_DecodeUTF8(text.data(), static_cast<Py_ssize_t>(text.size()),
                                           "replace");
  PyObject* error = message ? PyObject_CallOneArg(acme_error_type, message) : nullptr;
  Py_XDECREF(message);
  if (!error) return;  // the failure to build it is what gets raised
  PyObject* code = PyLong_FromLong(f.code);
  PyObject* name = PyUnicode_FromString(acmeGetErrorName(f.code));
  if (code && name) {
    PyObject_SetAttrString(error, "code", code);
    PyObject_SetAttrString(error, "name", name);
  }
  Py_XDECREF(code);
  Py_XDECREF(name);
  PyErr_SetObject(acme_error_type, error);
  Py_DECREF(error);
}

// A contiguous view of any buffer-protocol object (bytes, bytearray, memoryview,
// array.array, ...), held while the copy runs.
struct HostBuffer {
  Py_buffer view;
  explicit HostBuffer(const py::object& data) {
    if (PyObject_GetBuffer(data.ptr(), &view, PyBUF_C_CONTIGUOUS) != 0)
      throw py::error_already_set();
  }
  ~HostBuffer() { PyBuffer_Release(&view); }
  HostBuffer(const HostBuffer&) = delete;
  HostBuffer& operator=(const HostBuffer&) = delete;
};

void* as_pointer(uintptr_t address) { return reinterpret_cast<void*>(address); }
//> ch06 bind-handles

// Stream and event handles travel through Python as ints; stream 0 is NULL,
// the current device's default stream.
acmeStream_t as_stream(uintptr_t handle) { return reinterpret_cast<acmeStream_t>(handle); }
acmeEvent_t as_event(uintptr_t handle) { return reinterpret_cast<acmeEvent_t>(handle); }
template <class Handle>
uintptr_t as_int(Handle handle) {
  return reinterpret_cast<uintptr_t>(handle);
}
//< ch06 bind-handles

}  // namespace

void acme_bind_runtime(py::module_& m) {
  const std::string module_name = py::str(m.attr("__name__"));
  acme_error_type = PyErr_NewExceptionWithDoc(
      (module_name + ".AcmeError").c_str(),
      "A failed acme runtime call.\n\n"
      "Attributes: code (int, the acmeError_t value) and name (e.g. "
      "\"acmeErrorInvalidDevice\").\nstr(error) is \"<name>: <detailed message>\".",
      PyExc_RuntimeError, nullptr);
  if (!acme_error_type) throw py::error_already_set();
  m.attr("AcmeError") = py::handle(acme_error_type);
  py::register_local_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const Failure& f) {
      set_acme_error(f);
    }
  });

  py::enum_<acmeMemcpyKind>(m, "MemcpyKind", "Direction of a raw memcpy.")
      .value("HostToHost", acmeMemcpyHostToHost)
      .value("HostToDevice", acmeMemcpyHostToDevice)
      .value("DeviceToHost", acmeMemcpyDeviceToHost)
      .value("DeviceToDevice", acmeMemcpyDeviceToDevice);

  m.def(
      "device_count",
      [] {
        int count = 0;
        check(acmeGetDeviceCount(&count));
        return count;
      },
      "Number of acme devices (environment variable ACME_DEVICE_COUNT, default 2).");
  m.def(
      "current_device",
      [] {
        int device = 0;
        check(acmeGetDevice(&device));
        return device;
      },
      "This thread's current device (each thread starts on device 0).");
  m.def(
      "set_device", [](int device) { check(acmeSetDevice(device)); }, py::arg("device"),
      "Make `device` this thread's current device.");
  m.def(
      "synchronize", [] { call_without_gil([] { return acmeDeviceSynchronize(); }); },
//> ch00 sync-binding-doc < ch06 sync-binding-doc
//       "Wait for all work on the current device (everything is synchronous for now).");
//< ch00 sync-binding-doc
//> ch06 sync-binding-doc
      "Wait for all work queued on every stream of the current device.");
//< ch06 sync-binding-doc
  m.def(
      "checked_mode", [] { return acmeCheckedMode() != 0; },
      "True if device memory faults on host access (the default; ACME_CHECKED=0 turns it off).");

  m.def(
      "malloc",
      [](size_t nbytes) {
        void* ptr = nullptr;
        call_without_gil([&] { return acmeMalloc(&ptr, nbytes); });
        return reinterpret_cast<uintptr_t>(ptr);
      },
      py::arg("nbytes"),
      "Allocate `nbytes` on the current device; returns the device pointer as an int "
      "(0 for 0 bytes). The host must not dereference it.");
  m.def(
      "free", [](uintptr_t ptr) { call_without_gil([&] { return acmeFree(as_pointer(ptr)); }); },
      py::arg("ptr"), "Free an allocation given its base pointer (0 is a no-op).");

  m.def(
      "copy_to_device",
      [](uintptr_t dst, const py::object& data) {
        HostBuffer host(data);
        call_without_gil([&] {
          return acmeMemcpy(as_pointer(dst), host.view.buf, static_cast<size_t>(host.view.len),
                            acmeMemcpyHostToDevice);
        });
      },
      py::arg("dst"), py::arg("data"),
      "Copy the bytes of `data` (any contiguous buffer: bytes, bytearray, memoryview, "
      "array, ...) to device memory at `dst`.");
  m.def(
      "copy_to_host",
      [](uintptr_t src, size_t nbytes) {
        if (nbytes > static_cast<size_t>(PY_SSIZE_T_MAX)) throw py::value_error("nbytes too large");
        PyObject* raw = PyBytes_FromStringAndSize(nullptr, static_cast<Py_ssize_t>(nbytes));
        if (!raw) throw py::error_already_set();
        auto out = py::reinterpret_steal<py::bytes>(raw);
        char* buffer = PyBytes_AS_STRING(raw);  // fresh and unshared: ours to fill
        call_without_gil(
            [&] { return acmeMemcpy(buffer, as_pointer(src), nbytes, acmeMemcpyDeviceToHost); });
        return out;
      },
      py::arg("src"), py::arg("nbytes"), "Copy `nbytes` of device memory at `src` into new bytes.");
  m.def(
      "copy_device_to_device",
      [](uintptr_t dst, uintptr_t src, size_t nbytes) {
        call_without_gil([&] {
          return acmeMemcpy(as_pointer(dst), as_pointer(src), nbytes, acmeMemcpyDeviceToDevice);
        });
      },
      py::arg("dst"), py::arg("src"), py::arg("nbytes"),
      "Copy `nbytes` between device pointers (possibly on different devices).");
  m.def(
      "memset",
      [](uintptr_t ptr, int value, size_t nbytes) {
        call_without_gil([&] { return acmeMemset(as_pointer(ptr), value, nbytes); });
      },
      py::arg("ptr"), py::arg("value"), py::arg("nbytes"),
      "Set `nbytes` of device memory at `ptr` to the byte `value`.");
  m.def(
      "memcpy",
      [](uintptr_t dst, uintptr_t src, size_t nbytes, acmeMemcpyKind kind) {
        call_without_gil(
            [&] { return acmeMemcpy(as_pointer(dst), as_pointer(src), nbytes, kind); });
      },
      py::arg("dst"), py::arg("src"), py::arg("nbytes"), py::arg("kind"),
      "The raw acmeMemcpy on integer addresses, e.g. from ctypes.addressof. The runtime "
      "checks every side against `kind`: a host side pointing into device memory raises "
      "AcmeError (acmeErrorHostAccessToDevice).");

  m.def(
      "pointer_attributes",
      [](uintptr_t ptr) {
        acmePointerAttributes a;
        check(acmePointerGetAttributes(&a, as_pointer(ptr)));
        py::dict d;
        d["device"] = a.device;
        d["is_device"] = a.isDevice != 0;
        d["base"] = reinterpret_cast<uintptr_t>(a.base);
        d["size"] = a.size;
        return d;
      },
      py::arg("ptr"),
      "dict(device, is_device, base, size) of the allocation `ptr` points into; host "
      "pointers give device=-1, is_device=False, base=0, size=0.");
  m.def(
      "mem_get_info",
      [] {
        size_t free = 0, total = 0;
        check(acmeMemGetInfo(&free, &total));
        return std::make_pair(free, total);
      },
      "(free, total) bytes on the current device (total = ACME_DEVICE_MEMORY, default 16 GiB).");
  m.def(
      "memory_stats",
      [](int device) {
        size_t bytes = 0, blocks = 0, peak = 0;
        check(acmeMemoryStats(device, &bytes, &blocks, &peak));
        py::dict d;
        d["bytes_in_use"] = bytes;
        d["blocks_in_use"] = blocks;
        d["peak_bytes"] = peak;
        return d;
      },
      py::arg("device"),
      "dict(bytes_in_use, blocks_in_use, peak_bytes) of a device, in requested bytes: "
      "the leak check of the tests.");
//> ch06 bind-streams

  m.def(
      "stream_create",
      [](int device) {
        acmeStream_t stream = nullptr;
        check(acmeStreamCreate(&stream, device));
        return as_int(stream);
      },
      py::arg("device"), "Create a stream on `device`; returns its handle (an int).");
  m.def(
      "stream_destroy", [](uintptr_t stream) { check(acmeStreamDestroy(as_stream(stream))); },
      py::arg("stream"), "Destroy a stream; work already queued on it still runs.");
  m.def(
      "default_stream",
      [](int device) {
        acmeStream_t stream = nullptr;
        check(acmeStreamGetDefault(&stream, device));
        return as_int(stream);
      },
      py::arg("device"), "The handle of `device`'s default stream.");
  m.def(
      "stream_device",
      [](uintptr_t stream) {
        int device = -1;
        check(acmeStreamGetDevice(as_stream(stream), &device));
        return device;
      },
      py::arg("stream"), "The device a stream belongs to.");
  m.def(
      "stream_query",
      [](uintptr_t stream) {
        int complete = 0;
        check(acmeStreamQuery(as_stream(stream), &complete));
        return complete != 0;
      },
      py::arg("stream"), "True if all work queued on the stream has completed.");
  m.def(
      "stream_synchronize",
      [](uintptr_t stream) {
        call_without_gil([&] { return acmeStreamSynchronize(as_stream(stream)); });
      },
      py::arg("stream"), "Wait until the work queued on the stream so far has completed.");
  m.def(
      "stream_wait_event",
      [](uintptr_t stream, uintptr_t event) {
        check(acmeStreamWaitEvent(as_stream(stream), as_event(event)));
      },
      py::arg("stream"), py::arg("event"),
      "Make work queued on `stream` from now on wait for the event's latest record.");

  m.def(
      "event_create",
      [](int device, bool timing) {
        acmeEvent_t event = nullptr;
        check(acmeEventCreate(&event, device, timing ? acmeEventTiming : acmeEventDefault));
        return as_int(event);
      },
      py::arg("device"), py::arg("timing") = false,
      "Create an event on `device` (with timestamps if `timing`); returns its handle.");
  m.def(
      "event_destroy", [](uintptr_t event) { check(acmeEventDestroy(as_event(event))); },
      py::arg("event"), "Destroy an event.");
  m.def(
      "event_record",
      [](uintptr_t event, uintptr_t stream) {
        check(acmeEventRecord(as_event(event), as_stream(stream)));
      },
      py::arg("event"), py::arg("stream") = 0,
      "Queue the event's mark on `stream` (0: the current device's default stream).");
  m.def(
      "event_query",
      [](uintptr_t event) {
        int complete = 0;
        check(acmeEventQuery(as_event(event), &complete));
        return complete != 0;
      },
      py::arg("event"), "True if the event's latest record has completed (or none was issued).");
  m.def(
      "event_synchronize",
      [](uintptr_t event) {
        call_without_gil([&] { return acmeEventSynchronize(as_event(event)); });
      },
      py::arg("event"), "Wait until the event's latest record has completed.");
  m.def(
      "event_elapsed_time",
      [](uintptr_t start, uintptr_t end) {
        float ms = 0;
        check(acmeEventElapsedTime(&ms, as_event(start), as_event(end)));
        return ms;
      },
      py::arg("start"), py::arg("end"),
      "Milliseconds between the completions of two timing events' latest records.");

  m.def(
      "memcpy_async",
      [](uintptr_t dst, uintptr_t src, size_t nbytes, acmeMemcpyKind kind, uintptr_t stream) {
        check(acmeMemcpyAsync(as_pointer(dst), as_pointer(src), nbytes, kind, as_stream(stream)));
      },
      py::arg("dst"), py::arg("src"), py::arg("nbytes"), py::arg("kind"), py::arg("stream") = 0,
      "acmeMemcpy queued on `stream`. Host memory must outlive the copy.");
  m.def(
      "memset_async",
      [](uintptr_t ptr, int value, size_t nbytes, uintptr_t stream) {
        check(acmeMemsetAsync(as_pointer(ptr), value, nbytes, as_stream(stream)));
      },
      py::arg("ptr"), py::arg("value"), py::arg("nbytes"), py::arg("stream") = 0,
      "acmeMemset queued on `stream`.");
  m.def(
      "sleep_kernel",
      [](uintptr_t stream, unsigned microseconds) {
        check(acmeLaunchSleepKernel(as_stream(stream), microseconds));
      },
      py::arg("stream"), py::arg("microseconds"),
      "Queue a kernel that keeps `stream` busy for `microseconds` (for tests and demos).");
//< ch06 bind-streams
//> ch11 bind-init
  m.def(
      "init", [] { check(acmeInit()); },
      "Initialize the runtime (the first device call does it implicitly).");
  m.def(
      "device_properties",
      [](int device) {
        acmeDeviceProperties p{};
        check(acmeGetDeviceProperties(&p, device));
        py::dict fields;
        fields["name"] = std::string(p.name);
        fields["total_memory"] = p.totalMemory;
        fields["major"] = p.major;
        fields["minor"] = p.minor;
        fields["checked"] = p.checked != 0;
        return fields;
      },
      py::arg("device"), "The properties of `device` as a dict.");
  m.def(
      "host_alloc",
      [](size_t nbytes) {
        void* ptr = nullptr;
        check(acmeHostAlloc(&ptr, nbytes));
        return reinterpret_cast<uintptr_t>(ptr);
      },
      py::arg("nbytes"), "Allocate `nbytes` of pinned host memory; returns its address.");
  m.def(
      "host_free", [](uintptr_t ptr) { check(acmeHostFree(as_pointer(ptr))); }, py::arg("ptr"),
      "Free pinned host memory given its base address.");
  m.def(
      "host_is_pinned",
      [](uintptr_t ptr) {
        int pinned = 0;
        check(acmeHostIsPinned(as_pointer(ptr), &pinned));
        return pinned != 0;
      },
      py::arg("ptr"), "True if `ptr` lies in pinned host memory from host_alloc.");
//< ch11 bind-init
//> ch19 bind-activity
  m.def(
      "activity_enable", [](int enable) { check(acmeActivityEnable(enable)); },
      py::arg("enable"), "Start (1) or stop (0) recording device activity.");
  m.def(
      "activity_flush",
      [] {
        static const char* const kinds[] = {"kernel", "memcpy", "memset", "host_call"};
        py::list records;
        acmeActivityRecord batch[256];
        size_t count = 0;
        do {
          check(acmeActivityFlush(batch, 256, &count));
          for (size_t i = 0; i < count; ++i) {
            const acmeActivityRecord& r = batch[i];
            py::dict d;
            d["kind"] = kinds[r.kind];
            d["name"] = std::string(r.name);
            d["device"] = r.device;
            d["stream"] = r.stream;
            d["thread"] = r.thread;
            d["correlation"] = r.correlation;
            d["external_id"] = r.externalId;
            d["start"] = r.start;
            d["end"] = r.end;
            d["bytes"] = r.bytes;
            records.append(d);
          }
        } while (count);
        return records;
      },
      "The records kept since the last flush, as dicts, oldest first.");
  m.def(
      "activity_dropped",
      [] {
        uint64_t dropped = 0;
        check(acmeActivityDropped(&dropped));
        return dropped;
      },
      "How many records were lost since tracing started.");
  m.def(
      "push_external_id", [](uint64_t id) { check(acmeActivityPushExternalId(id)); },
      py::arg("id"), "Work this thread queues from now on carries `id`.");
  m.def(
      "pop_external_id", [] { check(acmeActivityPopExternalId()); },
      "Pop this thread's latest pushed id.");
  m.def(
      "timestamp",
      [] {
        uint64_t now = 0;
        check(acmeGetTimestamp(&now));
        return now;
      },
      "The runtime clock, in nanoseconds.");
//< ch19 bind-activity
}
