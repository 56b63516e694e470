//@ ch11
/* The acme runtime, chapter 11: pinned host memory. A header apart from
 * acme_runtime.h: only the code that allocates or recognises pinned memory
 * includes it. */
#ifndef ACME_HOST_H_
#define ACME_HOST_H_

#include "runtime/acme_runtime.h"

#ifdef __cplusplus
extern "C" {
#endif

//> ch11 pinned-api
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
//< ch11 pinned-api

#ifdef __cplusplus
}
#endif

#endif /* ACME_HOST_H_ */
