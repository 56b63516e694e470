//@ ch04
// acme's autocast policies as data (autocast.cpp), for the Python bindings:
// the table a user reads is the table the dispatcher was given.
#pragma once

#include <c10/core/ScalarType.h>

#include <span>

namespace acme {

struct AutocastRule {
  const char* op;      // "aten::name" or "aten::name.overload"
  const char* policy;  // an at::autocast::CastPolicy enumerator's name
};

// One entry per AutocastPrivateUse1 kernel acme registers, in registration order.
std::span<const AutocastRule> autocast_rules();

// The lower-precision dtypes acme's autocast accepts.
std::span<const c10::ScalarType> autocast_dtypes();

}  // namespace acme
