//@ ch01
// Turns a failing runtime call into a C++ exception that PyTorch surfaces in
// Python as a RuntimeError carrying the runtime's own detailed message.
#pragma once

#include <c10/util/Exception.h>

#include "runtime/acme_runtime.h"

#define ACME_CHECK(call)                                                    \
  do {                                                                      \
    const acmeError_t acme_err_ = (call);                                   \
    TORCH_CHECK(acme_err_ == acmeSuccess, acmeGetErrorName(acme_err_), ": ", \
                acmeGetLastErrorMessage());                                 \
  } while (0)
