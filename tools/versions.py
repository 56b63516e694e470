"""What changed between PyTorch releases in the interfaces this backend touches.

    python tools/versions.py            # the facts of every release, read from its environment
    python tools/versions.py --write    # and write them and the page docs/versions.md includes

Each release in RELEASES is read from an environment of its own (python_for
says where): the C++ interfaces from its installed headers (every virtual method of
the classes a backend derives from, or the members of the registries it calls),
and the Python side from its sources and a run (the attributes PyTorch reads
from a device module, torch.accelerator's functions, the Inductor and Dynamo
registration points). Adding the next release is one line in RELEASES. For
every change, the page says whether acme's sources name the member (so a
change there is one acme had to meet) and where.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GENERATED = ROOT / "docs" / "_generated"
FACTS = GENERATED / "versions-facts.json"  # what the last --write read, per release
PAGE = GENERATED / "versions-changes.md"   # rendered from FACTS; docs/versions.md includes it

# The releases the book has met, oldest first; the last is the book's.
RELEASES = ["2.13.0", "2.14.1", "2.15.0"]


def pinned_release() -> str:
    """The release requirements.txt pins: the one every chapter runs on."""
    lines = (ROOT / "requirements.txt").read_text().splitlines()
    return next(line.split("==")[1].strip() for line in lines if line.startswith("torch=="))
# Where each release's Python lives (python_for): ACME_TORCH_<release with
# underscores> names one, else .nox/torch-<release> (nox -s compat), else the book's.
BOOK_PYTHON = ROOT / ".nox" / "acme" / "bin" / "python"

# (what the page calls it, header under torch/include, C++ class, which members)
CPP = [
    ("DeviceGuardImplInterface", "c10/core/impl/DeviceGuardImplInterface.h",
     "DeviceGuardImplInterface", "virtual"),
    ("AcceleratorHooksInterface", "ATen/detail/AcceleratorHooksInterface.h",
     "AcceleratorHooksInterface", "virtual"),
    ("PrivateUse1HooksInterface", "ATen/detail/PrivateUse1HooksInterface.h",
     "PrivateUse1HooksInterface", "virtual"),
    ("Allocator", "c10/core/Allocator.h", "Allocator", "virtual"),
    ("DeviceAllocator", "c10/core/CachingDeviceAllocator.h", "DeviceAllocator", "virtual"),
    ("GeneratorImpl", "c10/core/GeneratorImpl.h", "GeneratorImpl", "virtual"),
    ("GraphImplInterface", "ATen/core/GraphImplInterface.h", "GraphImplInterface", "virtual"),
    ("c10d::Backend", "torch/csrc/distributed/c10d/Backend.hpp", "Backend", "virtual"),
    ("ProfilerStubs", "torch/csrc/profiler/stubs/base.h", "ProfilerStubs", "virtual"),
    ("PrivateUse1ProfilerRegistry", "torch/csrc/profiler/standalone/privateuse1_profiler.h",
     "PrivateUse1ProfilerRegistry", "all"),
    ("libkineto::IActivityProfiler", "kineto/IActivityProfiler.h", "IActivityProfiler", "virtual"),
    ("libkineto::IActivityProfilerSession", "kineto/IActivityProfiler.h",
     "IActivityProfilerSession", "virtual"),
]

# Variables PyTorch's Python calls a device module by, and the calls that return one.
_MODULE = (r"(?:device_mod|device_module|custom_device_mod|custom_backend_module|backend_module"
           r"|device_interface_mod|_get_device_module\([^()]*\)|get_device_module\([^()]*\))")
MODULE_ATTRIBUTE = re.compile(_MODULE + r"\.([A-Za-z_]\w*)")
MODULE_GETATTR = re.compile(r"(?:hasattr|getattr)\(\s*" + _MODULE + r"\s*,\s*[\"']([A-Za-z_]\w*)[\"']")

# Run inside each release's Python: the Python-side facts.
_PYTHON_FACTS = r'''
import inspect, json, sys
import torch
out = {"version": torch.__version__}
def sig(f):
    try:
        return str(inspect.signature(f))
    except (TypeError, ValueError):
        return "(...)"
acc = torch.accelerator
out["torch.accelerator"] = {n: sig(getattr(acc, n)) for n in dir(acc)
                            if not n.startswith("_") and callable(getattr(acc, n))
                            and not inspect.isclass(getattr(acc, n))
                            and getattr(getattr(acc, n), "__module__", "").startswith("torch")}
points = {}
import torch._inductor.codegen.common as common
for n in ("register_backend_for_device", "register_device_op_overrides",
          "get_scheduling_for_device", "get_wrapper_codegen_for_device", "init_backend_registration"):
    if hasattr(common, n):
        points["torch._inductor.codegen.common." + n] = sig(getattr(common, n))
import torch._dynamo.device_interface as di
for n in ("register_interface_for_device", "get_interface_for_device", "get_registered_device_interfaces"):
    if hasattr(di, n):
        points["torch._dynamo.device_interface." + n] = sig(getattr(di, n))
for n, m in inspect.getmembers(di.DeviceInterface):
    if not n.startswith("_") or n in ("__enter__", "__exit__"):
        points["DeviceInterface." + n] = sig(m) if callable(m) else type(m).__name__
import torch.utils.backend_registration as br
for n in ("rename_privateuse1_backend", "generate_methods_for_privateuse1_backend",
          "_get_custom_mod_func", "register_privateuse1_backend"):
    if hasattr(br, n):
        points["torch.utils.backend_registration." + n] = sig(getattr(br, n))
out["registration points"] = points
out["include"] = __import__("torch.utils.cpp_extension", fromlist=["x"]).include_paths()[0]
out["site"] = str(__import__("pathlib").Path(torch.__file__).parent)
print(json.dumps(out))
'''


def python_for(release: str) -> Path:
    named = os.environ.get("ACME_TORCH_" + release.replace(".", "_"))
    if named:
        return Path(named)
    compat = ROOT / ".nox" / f"torch-{release}" / "bin" / "python"
    return compat if compat.exists() else BOOK_PYTHON


# ---- C++: the members of a class, from its header ----

def _strip_comments(text: str) -> str:
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
    return re.sub(r"//[^\n]*", " ", text)


def class_body(text: str, name: str) -> str | None:
    """The text between the braces of `struct|class [API] name [final] [: bases] {`."""
    pattern = re.compile(r"\b(?:struct|class)\s+(?:[A-Z0-9_]+\s+)?" + re.escape(name)
                         + r"\b[^;{()]*\{")
    for m in pattern.finditer(text):
        depth, i = 1, m.end()
        while depth and i < len(text):
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
        return text[m.end():i - 1]
    return None


def declarations(body: str) -> list[str]:
    """Top-level declarations of a class body, each as one line (bodies dropped)."""
    out, current, depth, i = [], [], 0, 0
    while i < len(body):
        c = body[i]
        if c == "{":
            if depth == 0 and "(" in "".join(current):  # a function's body: the declaration ends here
                out.append("".join(current))
                current = []
            depth += 1
        elif c == "}":
            depth -= 1
        elif depth == 0:
            if c == ";":
                out.append("".join(current))
                current = []
            else:
                current.append(c)
        i += 1
    cleaned = []
    for d in out:
        d = re.sub(r"\b(public|protected|private)\s*:", " ", d)
        d = " ".join(d.split())
        if d and "(" in d:
            cleaned.append(d)
    return cleaned


def member_key(decl: str) -> str:
    """The member's name: the identifier before the parameter list."""
    m = re.search(r"(~?\w+|operator\s*\S+?)\s*\(", decl)
    return m.group(1) if m else decl


_TYPE_WORDS = {"const", "unsigned", "signed", "long", "short", "int", "char", "bool", "float",
               "double", "void", "struct", "class", "typename", "volatile", "auto"}


_QUALIFIERS = {"const", "unsigned", "signed", "long", "short", "struct", "class", "typename",
               "volatile"}


def _split_top(text: str, sep: str) -> list[str]:
    parts, depth, current = [], 0, []
    for c in text:
        depth += c in "(<[{"
        depth -= c in ")>]}"
        if c == sep and depth == 0:
            parts.append("".join(current))
            current = []
        else:
            current.append(c)
    parts.append("".join(current))
    return parts


def _parameter_types(params: str) -> str:
    """The parameter list without parameter names: headers that drop or comment
    out a name change nothing a backend sees."""
    kept = []
    for param in _split_top(params, ","):
        param = re.sub(r"\[\[[^\]]*\]\]", " ", param)
        head, *default = _split_top(param, "=")
        head = " ".join(head.split())
        m = re.fullmatch(r"(.*[\w>*&\]])\s+([A-Za-z_]\w*)", head)
        if m and m.group(2) not in _TYPE_WORDS and m.group(1) not in _QUALIFIERS:
            head = m.group(1)
        kept.append(" ".join([head, *(["= " + " ".join(default[0].split())] if default else [])]))
    return ", ".join(k for k in kept if k)


def normalise(decl: str) -> str:
    decl = re.sub(r"\b(virtual|inline|C10_API|TORCH_API|TORCH_NODISCARD)\s*", "", decl)
    decl = re.sub(r"\[\[\w+\]\]\s*", "", decl)
    decl = re.sub(r"\s*\b(override|final)\b", "", decl)
    decl = " ".join(decl.split())
    start = decl.find("(")
    if start < 0:
        return decl
    depth = 0
    for end in range(start, len(decl)):
        depth += decl[end] == "("
        depth -= decl[end] == ")"
        if depth == 0:
            break
    return decl[:start + 1] + _parameter_types(decl[start + 1:end]) + decl[end:]


def cpp_members(include: Path, header: str, cls: str, which: str) -> dict[str, list[str]] | None:
    path = include / header
    if not path.exists():
        return None
    body = class_body(_strip_comments(path.read_text(errors="replace")), cls)
    if body is None:
        return None
    members: dict[str, list[str]] = {}
    for decl in declarations(body):
        if which == "virtual" and not re.search(r"\bvirtual\b", decl):
            continue
        if which == "all" and re.match(r"(using|friend|typedef)\b", decl):
            continue
        members.setdefault(member_key(decl), []).append(normalise(decl))
    return {k: sorted(v) for k, v in sorted(members.items())}


# ---- Python: the attributes read from a device module ----

def module_attributes(site: Path) -> dict[str, list[str]]:
    seen: dict[str, set[str]] = {}
    for path in site.rglob("*.py"):
        rel = path.relative_to(site).as_posix()
        if rel.startswith(("testing/", "_vendor/")) or "/test" in rel:
            continue
        text = path.read_text(errors="replace")
        for regex in (MODULE_ATTRIBUTE, MODULE_GETATTR):
            for m in regex.finditer(text):
                if not m.group(1).startswith("__"):
                    seen.setdefault(m.group(1), set()).add("torch/" + rel)
    return {k: sorted(v) for k, v in sorted(seen.items())}


def facts(release: str, python: Path | None = None) -> dict:
    python = python or python_for(release)
    run = subprocess.run([str(python), "-c", _PYTHON_FACTS], capture_output=True, text=True,
                         env=dict(os.environ, TORCH_DEVICE_BACKEND_AUTOLOAD="0"))
    if run.returncode != 0:
        raise RuntimeError(f"{python} could not report on torch:\n{run.stderr[-2000:]}")
    found = json.loads(run.stdout.strip().splitlines()[-1])
    got = found["version"].split("+")[0]
    if got != release:
        raise SystemExit(f"{python} has torch {found['version']}, not {release}: install it "
                         f"(nox -s compat -- --release {release}) or name a Python in "
                         f"ACME_TORCH_{release.replace('.', '_')}")
    include = Path(found.pop("include"))
    site = Path(found.pop("site"))
    found["C++"] = {name: cpp_members(include, header, cls, which)
                    for name, header, cls, which in CPP}
    found["device module attributes"] = module_attributes(site)
    return found


# ---- the comparison ----

def acme_uses(name: str) -> list[str]:
    """acme's source files that name `name` (a member or an attribute)."""
    word = re.compile(r"\b" + re.escape(name.split(".")[-1]) + r"\b")
    hits = []
    for folder in ("csrc", "src"):
        for path in sorted((ROOT / folder).rglob("*")):
            if path.suffix in (".cpp", ".h", ".py") and word.search(path.read_text(errors="replace")):
                hits.append(path.relative_to(ROOT).as_posix())
    return hits


def compare(old: dict, new: dict) -> list[tuple[str, str, str, str, str]]:
    """Rows (interface, member, change, before, after)."""
    rows = []

    def diff(interface, a, b, show=lambda v: v):
        if a is None and b is None:
            return
        if a is None or b is None:
            rows.append((interface, "(the whole interface)", "added" if a is None else "removed", "", ""))
            return
        for key in sorted(set(a) | set(b)):
            if key not in a:
                rows.append((interface, key, "added", "", show(b[key])))
            elif key not in b:
                rows.append((interface, key, "removed", show(a[key]), ""))
            elif a[key] != b[key]:
                rows.append((interface, key, "changed", show(a[key]), show(b[key])))

    for name, *_ in CPP:
        diff(name, old["C++"].get(name), new["C++"].get(name), show=lambda v: "; ".join(v))
    diff("torch.accelerator", old["torch.accelerator"], new["torch.accelerator"])
    diff("Inductor/Dynamo/registration", old["registration points"], new["registration points"])
    # An attribute counts by its name; where PyTorch reads it is shown, not compared.
    where = lambda v: "read in " + ", ".join(v[:2]) + (" …" if len(v) > 2 else "")
    a, b = old["device module attributes"], new["device module attributes"]
    for key in sorted(set(a) ^ set(b)):
        rows.append(("device module attributes read", key, "added" if key in b else "removed",
                     "" if key in b else where(a[key]), where(b[key]) if key in b else ""))
    return rows


def _cell(text: str, limit: int = 160) -> str:
    text = text.replace("|", "\\|")
    return text if len(text) <= limit else text[:limit] + "…"


def render(all_facts: dict[str, dict]) -> str:
    releases = list(all_facts)
    lines = ["<!-- Written by tools/versions.py --write: do not edit by hand. -->", "",
             "*acme names it*: the files of this book's backend that name the member (a change "
             "there is one the backend had to meet); empty when acme does not use it.", ""]
    for old, new in zip(releases, releases[1:]):
        rows = compare(all_facts[old], all_facts[new])
        lines += [f"### {old} → {new}", ""]
        if not rows:
            lines += ["No change in these interfaces.", ""]
            continue
        counts = {}
        for r in rows:
            counts[r[0]] = counts.get(r[0], 0) + 1
        lines += ["| interface | member | change | before | after | acme names it |",
                  "| --- | --- | --- | --- | --- | --- |"]
        for interface, member, change, before, after in rows:
            uses = ", ".join(f"`{u}`" for u in acme_uses(member)) if member[0] != "(" else ""
            lines.append(f"| {interface} | `{_cell(member, 60)}` | {change} | {_cell(before)} "
                         f"| {_cell(after)} | {uses} |")
        lines.append("")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--write", action="store_true", help=f"write {FACTS.name} and {PAGE.name}")
    args = parser.parse_args(argv)
    all_facts = {r: facts(r) for r in RELEASES}
    if args.write:
        GENERATED.mkdir(exist_ok=True)
        FACTS.write_text(json.dumps(all_facts, indent=1, sort_keys=True) + "\n")
        PAGE.write_text(render(all_facts) + "\n")
        print(f"written: {FACTS.relative_to(ROOT)}, {PAGE.relative_to(ROOT)}")
    else:
        print(json.dumps(all_facts, indent=1, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
