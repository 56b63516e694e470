//@ ch19
/* The acme runtime, chapter 19: activity tracing for profilers. A header
 * apart from acme_runtime.h, as CUPTI is apart from the CUDA runtime: code
 * that traces nothing does not include it (and does not recompile when it
 * changes). */
#ifndef ACME_ACTIVITY_H_
#define ACME_ACTIVITY_H_

#include <stdint.h>

#include "runtime/acme_runtime.h"

#ifdef __cplusplus
extern "C" {
#endif

//> ch19 activity-api
/* ---- activity tracing ----
 *
 * For profilers, as CUPTI's activity API is for CUDA. While tracing is on, the
 * runtime keeps a record of every piece of device work it runs (kernels,
 * copies, memsets: timed by the device, when they ran on their stream) and of
 * every host call that queued work (timed on the calling thread). Timestamps
 * are nanoseconds of the runtime's clock, acmeGetTimestamp: a monotonic clock,
 * unrelated to the time of day, that event timings use too.
 *
 * Two numbers link records. `correlation` numbers one queued piece of work:
 * its host call's record and its device record share it. `externalId` is the
 * id the queuing thread had pushed last (acmeActivityPushExternalId), which a
 * framework uses to link device work to its own operator. */

typedef enum acmeActivityKind {
  acmeActivityKernel = 0,   /* device: a kernel ran */
  acmeActivityMemcpy = 1,   /* device: a copy ran */
  acmeActivityMemset = 2,   /* device: a memset ran */
  acmeActivityHostCall = 3  /* host: a call that queued work returned */
} acmeActivityKind;

typedef struct acmeActivityRecord {
  acmeActivityKind kind;
  char name[64];          /* the kernel's name, "Memcpy HtoD" (or DtoH, DtoD),
                             "Memset", or the host call's function name */
  int device;
  uint64_t stream;        /* the stream's handle number, as errors name it */
  uint64_t thread;        /* host calls: the calling thread's id (gettid) */
  uint64_t correlation;
  uint64_t externalId;    /* 0 if none was pushed */
  uint64_t start, end;    /* runtime clock, nanoseconds */
  uint64_t bytes;         /* copies and memsets */
} acmeActivityRecord;

/* Starts (1) or stops (0) tracing. Starting discards records nobody flushed
 * and every thread's pushed ids. Work queued in between is recorded, and
 * stopping waits until all of it has run, on every device; it does not report
 * kernel failures (the next synchronizing call does). */
ACME_API acmeError_t acmeActivityEnable(int enable);
/* Moves up to `capacity` records, in the order their work ended, into
 * `records`; *count says how many. Call until *count is 0. */
ACME_API acmeError_t acmeActivityFlush(acmeActivityRecord* records, size_t capacity,
                                       size_t* count);
/* Records lost since tracing started: the runtime keeps at most 1,048,576
 * unflushed records, and drops (and counts) the rest. */
ACME_API acmeError_t acmeActivityDropped(uint64_t* dropped);
/* A per-thread stack of ids: work this thread queues carries the top one. */
ACME_API acmeError_t acmeActivityPushExternalId(uint64_t id);
/* Pops it; acmeErrorInvalidValue if this thread's stack is empty. */
ACME_API acmeError_t acmeActivityPopExternalId(void);
/* The runtime clock now, in nanoseconds. */
ACME_API acmeError_t acmeGetTimestamp(uint64_t* nanoseconds);
//< ch19 activity-api

#ifdef __cplusplus
}
#endif

#endif /* ACME_ACTIVITY_H_ */
