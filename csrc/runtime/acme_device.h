//@ ch11
/* The acme runtime, chapter 11: when the runtime starts, and what a device
 * is. A header apart from acme_runtime.h: only the code that initializes the
 * runtime or reads device properties includes it. */
#ifndef ACME_DEVICE_H_
#define ACME_DEVICE_H_

#include "runtime/acme_runtime.h"

#ifdef __cplusplus
extern "C" {
#endif

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
//< ch11 init-api

#ifdef __cplusplus
}
#endif

#endif /* ACME_DEVICE_H_ */
