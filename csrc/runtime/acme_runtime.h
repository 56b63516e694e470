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

#ifdef __cplusplus
}
#endif

#endif /* ACME_RUNTIME_H_ */
