"""docs/versions.md's generated half (tools/versions.py): the page is what the
recorded facts render to, the facts of the running release are what its headers
and sources say today, and the header parser reads what a backend must see."""

from __future__ import annotations

import inspect
import json
import re
import sys
from pathlib import Path

import torch
from torch.amp import autocast_mode

from tools import versions


def test_page_is_rendered_from_the_recorded_facts():
    facts = json.loads(versions.FACTS.read_text())
    assert list(facts) == versions.RELEASES
    assert versions.PAGE.read_text() == versions.render(facts) + "\n", \
        "stale: run python tools/versions.py --write"


def test_recorded_facts_of_the_running_release_are_current():
    release = torch.__version__.split("+")[0]
    assert release in versions.RELEASES
    recorded = json.loads(versions.FACTS.read_text())[release]
    assert versions.facts(release, python=sys.executable) == recorded


def test_header_parser_sees_virtual_members_by_their_types(tmp_path):
    header = tmp_path / "iface.h"
    header.write_text("""
    struct TORCH_API Other { virtual void f() = 0; };
    struct C10_API Iface : public Base {
      // a comment with virtual void fake();
      virtual ~Iface() = default;
      virtual void a(int device /*unused*/) const = 0;
      virtual bool b([[maybe_unused]] const c10::Storage& s, size_t n = 4) const { return true; }
      void not_virtual();
     private:
      virtual std::pair<size_t, size_t> c(
          c10::DeviceIndex) override;
    };""")
    members = versions.cpp_members(tmp_path, "iface.h", "Iface", "virtual")
    assert members == {
        "~Iface": ["~Iface() = default"],
        "a": ["void a(int) const = 0"],
        "b": ["bool b(const c10::Storage&, size_t = 4) const"],
        "c": ["std::pair<size_t, size_t> c(c10::DeviceIndex)"],
    }
    other = dict(members, a=["void a(int, int) const = 0"])
    rows = versions.compare({"C++": {"DeviceGuardImplInterface": members}, **_empty()},
                            {"C++": {"DeviceGuardImplInterface": other}, **_empty()})
    assert [r[:3] for r in rows] == [("DeviceGuardImplInterface", "a", "changed")]


def _empty() -> dict:
    return {"torch.accelerator": {}, "registration points": {}, "device module attributes": {}}


def test_the_readme_and_the_index_page_name_the_release_the_book_pins():
    pinned = versions.pinned_release()
    assert f"PyTorch {pinned}" in (versions.ROOT / "README.md").read_text()
    index = (versions.ROOT / "docs" / "index.md").read_text()
    assert f"**PyTorch {pinned}**" in index
    assert all(release in index for release in versions.RELEASES), versions.RELEASES


def test_the_index_pages_older_advice_is_out_of_date_on_this_release():
    # The rows of docs/index.md's "Advice you may have read elsewhere", each read
    # from the running release's sources.
    index = (versions.ROOT / "docs" / "index.md").read_text()
    assert "## Advice you may have read elsewhere" in index
    include = Path(torch.__file__).parent / "include"
    # Autocast asks a PrivateUse1 device module for one function only.
    source = inspect.getsource(autocast_mode.autocast.__init__)
    assert set(re.findall(r"custom_device_mod\.(\w+)", source)) == {"get_amp_supported_dtype"}
    # The generator macro's registry serves getNewGenerator's default; nothing
    # serves getDefaultGenerator but the backend's hooks.
    hooks = (include / "ATen/detail/PrivateUse1HooksInterface.h").read_text()
    default = re.search(r"getDefaultGenerator\(.*?\{(.*?)\}", hooks, re.S).group(1)
    new = re.search(r"Generator getNewGenerator\(.*?\{(.*?)\n  \}", hooks, re.S).group(1)
    assert "FAIL_PRIVATEUSE1HOOKS_FUNC" in default and "GetGeneratorPrivate" not in default
    assert "GetGeneratorForPrivateuse1" in new
    # AutoNonVariableTypeMode warns that it is deprecated.
    legacy = (include / "ATen/core/LegacyTypeDispatch.h").read_text()
    assert "AutoNonVariableTypeMode is deprecated" in legacy
    # Tensor pickling singles out only PrivateUse1 tensors *without* storage;
    # those with storage take the generic route (test_serialization.py saves
    # and loads them, nothing patched).
    reduce = inspect.getsource(torch.Tensor._reduce_ex_internal)
    assert "not torch._C._has_storage(self)" in reduce and "_get_privateuse1_backend_name" in reduce


def test_inductor_still_declares_cuda_backend_without_cpp():
    # Chapter 20 sets cuda_backend = "cpp" for acme's graphs, a value outside
    # the declared Literal that works only because nothing validates it. A
    # release that adds "cpp" (or starts validating) must be read again.
    import typing

    import torch._inductor.config as inductor_config

    declared = typing.get_args(inductor_config.__annotations__["cuda_backend"])
    assert "cpp" not in declared and "triton" in declared, declared
