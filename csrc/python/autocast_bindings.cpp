//@ ch04
// The autocast policies acme registered, readable from Python: the chapter's
// table and torch.privateuseone.get_amp_supported_dtype() are built from these.
#include "python/autocast_bindings.h"

#include <string>

#include "aten/autocast.h"

namespace py = pybind11;

void acme_bind_autocast(py::module_& m) {
  m.def(
      "policies",
      [] {
        py::list rules;
        for (const auto& rule : acme::autocast_rules()) {
          rules.append(py::make_tuple(rule.op, rule.policy));
        }
        return rules;
      },
      "(op, policy) for every AutocastPrivateUse1 kernel acme registers.");
  m.def(
      "lower_precision_dtypes",
      [] {
        py::list names;  // "float16", ...: torch.<name> is the dtype
        for (const auto dtype : acme::autocast_dtypes()) {
          names.append(std::string(c10::getDtypeNames(dtype).first));
        }
        return names;
      },
      "Names of the dtypes acme's autocast may lower to.");
}
