//@ ch02
#pragma once

#include <ATen/core/dispatch/Dispatcher.h>

namespace acme {
// Warns once per operator (not per call) that `op` runs on the CPU; `how`
// finishes the sentence "<op> has no acme kernel and runs on the CPU ...".
void warn_once(const c10::OperatorHandle& op, const char* how);
}  // namespace acme
