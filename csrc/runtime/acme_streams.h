//@ ch06
/* The acme runtime, chapter 6: streams, events and the work queued on them.
 * A header apart from acme_runtime.h, so code that queues no work does not
 * include it and does not recompile when it grows (CUDA declares all of this
 * in cuda_runtime_api.h). */
#ifndef ACME_STREAMS_H_
#define ACME_STREAMS_H_

#include "runtime/acme_runtime.h"

#ifdef __cplusplus
extern "C" {
#endif

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

#endif /* ACME_STREAMS_H_ */
