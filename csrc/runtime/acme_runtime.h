//@ ch00
/* The acme vendor runtime: a plain C API for the simulated "acme" accelerator,
 * in the spirit of a tiny libcudart. It knows nothing about PyTorch.
 *
 * Every function returning acmeError_t is thread-safe. On failure it also
 * records a detailed message for the calling thread (acmeGetLastErrorMessage).
 *
 * Configuration, read once from the environment on the first call:
//> ch00 device-count-doc < ch11 device-count-doc
//  *   ACME_DEVICE_COUNT   number of devices, an integer 1..16 (default 2)
//< ch00 device-count-doc
//> ch11 device-count-doc
 *   ACME_DEVICE_COUNT   number of devices, an integer 0..16 (default 2); with
 *                       0, every call but acmeGetDeviceCount, acmeCheckedMode
 *                       and the error queries fails with acmeErrorNoDevice
//< ch11 device-count-doc
 *   ACME_DEVICE_MEMORY  capacity per device in bytes, with an optional K/M/G/T
 *                       suffix such as "64M" (default 16G; committed lazily)
 *   ACME_CHECKED        1 (default): the host cannot touch device memory, and a
 *                       host access faults with a report on stderr; 0: device
 *                       memory is plain host memory (fast path for benchmarks)
//> ch12 poison-doc
 *                       2: as 1, and every new allocation is filled with 0xff
 *                       bytes (NaN as floats), so reads of memory nobody wrote
 *                       show; acmeCheckedMode() returns 2 so the layers above
 *                       can poison memory they recycle too
//< ch12 poison-doc
//> ch18 launch-blocking-doc
 *   ACME_LAUNCH_BLOCKING  0 (default): kernels and copies run asynchronously on
 *                       their stream; 1: every launch waits until its work is
 *                       done and returns its error itself (for debugging)
//< ch18 launch-blocking-doc
 * A malformed value makes every call fail with acmeErrorInitialization.
 */
#ifndef ACME_RUNTIME_H_
#define ACME_RUNTIME_H_

#include <stddef.h>

#define ACME_API __attribute__((visibility("default")))

#ifdef __cplusplus
extern "C" {
#endif

/* Every code the runtime returns, declared from the start as a driver's header
 * declares them. Codes 7 to 13 come with capabilities later chapters add:
 * streams and events, devices that may be absent, kernels, collectives. */
typedef enum acmeError {
  acmeSuccess = 0,
  acmeErrorInvalidDevice = 1,         /* device ordinal out of range */
  acmeErrorInvalidValue = 2,          /* bad argument (NULL out-pointer, bad kind, ...) */
  acmeErrorMemoryAllocation = 3,      /* device out of memory */
  acmeErrorInvalidDevicePointer = 4,  /* not (inside) a live device allocation */
  acmeErrorHostAccessToDevice = 5,    /* a host-side argument points into device memory */
  acmeErrorInitialization = 6,        /* the environment configuration is invalid */
  acmeErrorInvalidHandle = 7,         /* not a live stream or event */
  acmeErrorDeviceMismatch = 8,        /* stream and event, or two events, on different devices */
  acmeErrorNotReady = 9,              /* the work an event marks has not completed yet */
  acmeErrorNoDevice = 10,             /* the machine has no device (ACME_DEVICE_COUNT=0) */
  acmeErrorForkedChild = 11,          /* used in a child of fork() after the parent used it */
  acmeErrorLaunchFailure = 12,        /* a kernel failed while it ran */
  acmeErrorCommFailure = 13,          /* a communicator failed earlier: a rank left, timed
                                         out or disagreed */
} acmeError_t;

typedef enum acmeMemcpyKind {
  acmeMemcpyHostToHost = 0,
  acmeMemcpyHostToDevice = 1,
  acmeMemcpyDeviceToHost = 2,
  acmeMemcpyDeviceToDevice = 3
} acmeMemcpyKind;

typedef struct acmePointerAttributes {
  int device;   /* owning device, or -1 for host memory */
  int isDevice; /* 1 if ptr lies in a live device allocation */
  void* base;   /* base of that allocation (NULL for host memory) */
  size_t size;  /* its requested size in bytes (0 for host memory) */
} acmePointerAttributes;

/* ---- errors ---- */

/* The enumerator's name, e.g. "acmeErrorInvalidDevice". Never NULL. */
ACME_API const char* acmeGetErrorName(acmeError_t error);
/* A one-line description of the error code. Never NULL. */
ACME_API const char* acmeGetErrorString(acmeError_t error);
/* The detailed message of the last failing call on this thread, naming the
 * values involved; "no error" if none failed yet. Valid until the thread's
 * next failing call. */
ACME_API const char* acmeGetLastErrorMessage(void);

/* ---- devices ---- */

/* Number of devices (ACME_DEVICE_COUNT, default 2). */
ACME_API acmeError_t acmeGetDeviceCount(int* count);
/* Selects this thread's current device (each thread starts on device 0). */
ACME_API acmeError_t acmeSetDevice(int device);
/* This thread's current device. */
ACME_API acmeError_t acmeGetDevice(int* device);
//> ch00 device-sync-doc < ch06 device-sync-doc
// /* Waits for all work on the current device. Everything is synchronous for
//  * now, so this only checks that the runtime is usable. */
//< ch00 device-sync-doc
//> ch06 device-sync-doc
/* Waits until all work queued on every stream of the current device, the
 * default stream included, has completed. */
//< ch06 device-sync-doc
ACME_API acmeError_t acmeDeviceSynchronize(void);
//> ch00 checked-mode-doc < ch12 checked-mode-doc
// /* 1 if checked mode is on (the default), 0 if ACME_CHECKED=0. */
//< ch00 checked-mode-doc
//> ch12 checked-mode-doc
/* 1 if checked mode is on (the default), 2 if it also poisons new memory
 * (ACME_CHECKED=2), 0 if ACME_CHECKED=0. */
//< ch12 checked-mode-doc
ACME_API int acmeCheckedMode(void);

/* ---- memory ---- */

/* Allocates size bytes on the current device. size 0 gives *devPtr = NULL.
 * Device pointers are 4096-byte aligned in checked mode, 64 otherwise. */
ACME_API acmeError_t acmeMalloc(void** devPtr, size_t size);
/* Same as acmeMalloc, on an explicit device. */
ACME_API acmeError_t acmeMallocOnDevice(void** devPtr, size_t size, int device);
//> ch00 free-doc < ch18 free-doc
// /* Frees an allocation given its base pointer. NULL is a no-op. */
//< ch00 free-doc
//> ch18 free-doc
/* Frees an allocation given its base pointer. NULL is a no-op. It first waits
 * for the work queued on the allocation's device, which may still use it (as
 * cudaFree does). */
//< ch18 free-doc
ACME_API acmeError_t acmeFree(void* devPtr);

/* Copies count bytes. Each device-side range must lie inside one live
 * allocation; each host-side range must not touch device memory. Device to
 * device copies may cross devices. Synchronous; count 0 is a no-op. */
ACME_API acmeError_t acmeMemcpy(void* dst, const void* src, size_t count,
                                acmeMemcpyKind kind);
/* Sets count bytes of device memory to (unsigned char)value. */
ACME_API acmeError_t acmeMemset(void* devPtr, int value, size_t count);

/* Which allocation, if any, ptr points into. Host pointers (and NULL) give
 * isDevice = 0, device = -1, base = NULL, size = 0. */
ACME_API acmeError_t acmePointerGetAttributes(acmePointerAttributes* attributes,
                                              const void* ptr);
/* Free and total bytes on the current device (total = ACME_DEVICE_MEMORY). */
ACME_API acmeError_t acmeMemGetInfo(size_t* free, size_t* total);
/* Requested bytes and allocations currently live on a device, and the peak of
 * bytes in use since start. Any out-pointer may be NULL. */
ACME_API acmeError_t acmeMemoryStats(int device, size_t* bytesInUse,
                                     size_t* blocksInUse, size_t* peakBytes);

/* The device side's view of device memory: the address at which a kernel
 * "running on the device" reads and writes devPtr, which must point inside a
 * live allocation (NULL maps to NULL). The host must never dereference a
 * device pointer; kernels use this view instead. It is valid until the
 * allocation is freed. Without checked mode it equals devPtr. */
ACME_API acmeError_t acmeDeviceAccess(void** kernelView, const void* devPtr);
//> ch06 streams-api

/* ---- streams and events ----
 *
 * A stream is an in-order queue of work on one device. Work queued on it runs
 * asynchronously to the host, one item after the other; different streams run
 * concurrently. Every device has a default stream, which always exists.
//> ch06 sync-copies-doc < ch18 sync-copies-doc
//  * acmeMemcpy and acmeMemset stay synchronous: they run on the calling thread,
//  * ordered with no stream, so synchronize a stream before they touch memory its
//  * pending work uses.
//< ch06 sync-copies-doc
//> ch18 sync-copies-doc
 * acmeMemcpy and acmeMemset are synchronous: they first wait for all work
 * queued on the devices they touch (as cudaMemcpy does on the legacy default
 * stream), then run on the calling thread.
//< ch18 sync-copies-doc
 *
 * An event marks a point in a stream: acmeEventRecord queues the mark, and the
 * event completes when the stream reaches it (all work queued before it done),
 * taking a timestamp from a monotonic clock if it was created with timing. An
 * event belongs to one device. Recording it again moves the mark; queries and
 * waits concern the latest record issued before them.
 *
 * Handles are opaque and never reused: a destroyed handle stays invalid, and
 * every call given one fails with acmeErrorInvalidHandle. A NULL stream means
 * the current device's default stream. */

typedef struct acmeStream_st* acmeStream_t;
typedef struct acmeEvent_st* acmeEvent_t;

/* Flags of acmeEventCreate. */
enum { acmeEventDefault = 0, acmeEventTiming = 1 /* record timestamps */ };

/* Creates a stream on device (a worker starts serving it at once). */
ACME_API acmeError_t acmeStreamCreate(acmeStream_t* stream, int device);
/* Destroys a stream. Work already queued still runs; the call does not wait.
 * A default stream cannot be destroyed. */
ACME_API acmeError_t acmeStreamDestroy(acmeStream_t stream);
/* The default stream of device. */
ACME_API acmeError_t acmeStreamGetDefault(acmeStream_t* stream, int device);
/* The device a stream belongs to. */
ACME_API acmeError_t acmeStreamGetDevice(acmeStream_t stream, int* device);
/* *complete = 1 if all work queued on the stream so far has completed, else 0. */
ACME_API acmeError_t acmeStreamQuery(acmeStream_t stream, int* complete);
/* Blocks until all work queued on the stream before this call has completed. */
ACME_API acmeError_t acmeStreamSynchronize(acmeStream_t stream);
/* Work queued on stream after this call waits until the event's latest record
 * (issued before this call) has completed. The event may belong to another
 * device. A never-recorded event makes this a no-op. */
ACME_API acmeError_t acmeStreamWaitEvent(acmeStream_t stream, acmeEvent_t event);

/* Creates an event on device; flags is acmeEventDefault or acmeEventTiming. */
ACME_API acmeError_t acmeEventCreate(acmeEvent_t* event, int device, unsigned flags);
/* Destroys an event; records still queued complete harmlessly. */
ACME_API acmeError_t acmeEventDestroy(acmeEvent_t event);
/* Queues the event's mark on stream, which must be on the event's device. */
ACME_API acmeError_t acmeEventRecord(acmeEvent_t event, acmeStream_t stream);
/* *complete = 1 if the latest record has completed (or none was issued). */
ACME_API acmeError_t acmeEventQuery(acmeEvent_t event, int* complete);
/* Blocks until the latest record issued before this call has completed. */
ACME_API acmeError_t acmeEventSynchronize(acmeEvent_t event);
/* Milliseconds between the completions of start's and end's latest records.
 * Both need acmeEventTiming, a completed record (else acmeErrorNotReady) and
 * the same device. */
ACME_API acmeError_t acmeEventElapsedTime(float* ms, acmeEvent_t start, acmeEvent_t end);

/* Stream-ordered versions of acmeMemcpy and acmeMemset: validated now, run
 * when the stream reaches them. Device memory they use stays mapped until then
 * even if freed meanwhile; host memory must stay valid until they complete. */
//> ch18 async-copies-doc
/* Unless it is pinned (acmeHostAlloc), host memory cannot be reached by the
 * device's copy engines, so acmeMemcpyAsync treats it as real drivers do: a
 * pageable source is copied into a staging buffer before the call returns
 * (the caller may reuse it at once), and a copy into a pageable destination
 * is synchronous: it waits for the stream and reports its errors. Only copies
 * from and to pinned memory overlap with the host. */
//< ch18 async-copies-doc
ACME_API acmeError_t acmeMemcpyAsync(void* dst, const void* src, size_t count,
                                     acmeMemcpyKind kind, acmeStream_t stream);
ACME_API acmeError_t acmeMemsetAsync(void* devPtr, int value, size_t count,
                                     acmeStream_t stream);
/* A kernel that keeps the stream busy for the given time: a stand-in for real
 * device work in tests and demos (like torch.cuda._sleep). */
ACME_API acmeError_t acmeLaunchSleepKernel(acmeStream_t stream, unsigned microseconds);
//< ch06 streams-api
//> ch11 init-api

/* ---- initialization ----
 *
 * The first call that uses a device (anything but acmeGetDeviceCount,
 * acmeGetDeviceProperties, acmeCheckedMode and the error queries) initializes
 * the runtime; acmeInit does it explicitly. A process that fork()s after that
 * leaves its child without the runtime's threads, and in checked mode the
 * child would share the parent's device memory: every initializing call in
 * such a child fails with acmeErrorForkedChild. Frees still succeed there (the
 * child only lets go of its own copy). Start children with "spawn" instead. */
ACME_API acmeError_t acmeInit(void);

/* The properties of one device. */
typedef struct acmeDeviceProperties {
  char name[64];      /* marketing name, e.g. "acme A1 (simulated)" */
  size_t totalMemory; /* bytes (ACME_DEVICE_MEMORY) */
  int major, minor;   /* architecture version: what kernels may assume */
  int checked;        /* 1 if the host cannot touch device memory (ACME_CHECKED) */
} acmeDeviceProperties;

/* Fills *properties for device; does not initialize the runtime. */
ACME_API acmeError_t acmeGetDeviceProperties(acmeDeviceProperties* properties, int device);

/* ---- pinned host memory ----
 *
 * Host memory the runtime knows: on real hardware it is page-locked, so the
 * device's copy engines can read and write it while the host runs on, and only
 * copies from and to it can be asynchronous. acme's is ordinary host memory
 * the runtime registers, so it can tell pinned from pageable pointers. The
 * host may read and write it freely. */

/* Allocates size bytes of pinned host memory, 4096-byte aligned. size 0 gives
 * *ptr = NULL. */
ACME_API acmeError_t acmeHostAlloc(void** ptr, size_t size);
/* Frees it given its base pointer. NULL is a no-op. */
ACME_API acmeError_t acmeHostFree(void* ptr);
/* *isPinned = 1 if ptr lies inside a live acmeHostAlloc allocation, else 0. */
ACME_API acmeError_t acmeHostIsPinned(const void* ptr, int* isPinned);
//< ch11 init-api
//> ch18 kernels-api

/* ---- kernels ----
 *
 * A kernel is work the device runs when its stream reaches it. acme's device
 * is the host's own cores, so a kernel is a host function, called on the
 * stream's worker thread with the arguments the launch captured; it must reach
 * device memory only through acmeDeviceAccess views, as every kernel does.
 *
 * A kernel reports failure by returning nonzero after writing a message into
 * `message` (capacity `messageSize`, always at least 256). The launch has long
 * returned by then, so the failure is kept for the device and reported, as
 * acmeErrorLaunchFailure naming the kernel and its stream, by the next call
 * that synchronizes with the device: acmeStreamSynchronize,
 * acmeEventSynchronize, acmeDeviceSynchronize, acmeMemcpy, and acmeMemcpyAsync
 * into pageable memory. Only the first failure is kept until it is reported;
 * results of the failed kernel, and of work that used them, are undefined.
 * With ACME_LAUNCH_BLOCKING=1, acmeLaunchKernel waits for the kernel and
 * returns its failure itself. */
typedef int (*acmeKernelFunction)(void* args, char* message, size_t messageSize);

/* Queues `function(args, ...)` on stream (NULL: the current device's default
 * stream). `name` (its first 63 bytes copied) names the kernel in errors and
 * traces. `release`,
 * if not NULL, is called with args exactly once: after the kernel ran, on the
 * worker thread, or before acmeLaunchKernel returns if it fails to queue. */
ACME_API acmeError_t acmeLaunchKernel(acmeStream_t stream, const char* name,
                                      acmeKernelFunction function, void* args,
                                      void (*release)(void* args));
//< ch18 kernels-api

#ifdef __cplusplus
}
#endif

#endif /* ACME_RUNTIME_H_ */
