//@ ch16
/* The acme runtime, chapter 16: device memory shared between processes. A
 * header apart from acme_runtime.h: code that shares no memory does not
 * include it, and does not recompile when it changes. */
#ifndef ACME_IPC_H_
#define ACME_IPC_H_

#include "runtime/acme_runtime.h"

#ifdef __cplusplus
extern "C" {
#endif

//> ch16 ipc-api
/* ---- sharing device memory between processes ----
 *
 * As cudaIpc* does: one process gets a handle for an allocation, sends it to
 * another (the descriptor travels the way descriptors do between processes,
 * e.g. SCM_RIGHTS), and that process opens it as an allocation of its own on
 * the same device. Both see the same memory; it lives until every process
 * has freed or closed it. */
typedef struct acmeIpcMemHandle {
  int fd;       /* a descriptor for the allocation's memory */
  size_t size;  /* the allocation's size in bytes */
  int device;
} acmeIpcMemHandle;

/* The handle of the allocation devPtr points into, and devPtr's offset in it.
 * handle->fd belongs to the runtime and stays valid while the allocation
 * lives: send a duplicate, never close it. */
ACME_API acmeError_t acmeIpcGetMemHandle(acmeIpcMemHandle* handle, size_t* offset,
                                         const void* devPtr);
/* Opens a handle another process sent: *devPtr is the base of a new
 * allocation in this process (counted in its memory statistics). The runtime
 * keeps its own duplicate of handle.fd; the caller still owns handle.fd. */
ACME_API acmeError_t acmeIpcOpenMemHandle(void** devPtr, acmeIpcMemHandle handle);
/* Closes an allocation opened with acmeIpcOpenMemHandle (acmeFree refuses it). */
ACME_API acmeError_t acmeIpcCloseMemHandle(void* devPtr);
//< ch16 ipc-api

#ifdef __cplusplus
}
#endif

#endif /* ACME_IPC_H_ */
