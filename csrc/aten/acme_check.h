//@ ch01
// Turns a failing runtime call into a C++ exception that PyTorch surfaces in
// Python as a RuntimeError carrying the runtime's own detailed message.
#pragma once

#include <c10/util/Exception.h>

#include "runtime/acme_runtime.h"

//> ch01 check < ch18 check
// #define ACME_CHECK(call)                                                    \
//   do {                                                                      \
//     const acmeError_t acme_err_ = (call);                                   \
//     TORCH_CHECK(acme_err_ == acmeSuccess, acmeGetErrorName(acme_err_), ": ", \
//                 acmeGetLastErrorMessage());                                 \
//   } while (0)
//< ch01 check
//> ch18 check
// A kernel's failure, reported late (chapter 18), is what CUDA reports as
// torch.AcceleratorError, a RuntimeError that also carries the error code.
#define ACME_CHECK(call)                                                             \
  do {                                                                               \
    const acmeError_t acme_err_ = (call);                                            \
    if (acme_err_ == acmeErrorLaunchFailure) {                                       \
      throw ::c10::AcceleratorError(                                                 \
          {__func__, __FILE__, static_cast<uint32_t>(__LINE__)}, acme_err_,          \
          ::c10::str(acmeGetErrorName(acme_err_), ": ", acmeGetLastErrorMessage())); \
    }                                                                                \
    TORCH_CHECK(acme_err_ == acmeSuccess, acmeGetErrorName(acme_err_), ": ",         \
                acmeGetLastErrorMessage());                                          \
  } while (0)
//< ch18 check
