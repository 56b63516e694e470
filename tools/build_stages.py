"""Build every stage of the backend in one ninja graph.

Each stage snapshot (written by tools/splitter.py into OUT/stages/stage-NN) stays
a clean source tree a vendor can copy; its build goes beside it, into
OUT/packages/stage-NN/torch_acme: the Python files, ``libacme_runtime.so``, the
extension module ``_C`` and ``_build_info.py`` (put OUT/packages/stage-NN on
sys.path to import that stage). A translation unit is compiled once for all the
stages in which it is identical: objects are named after a hash of the source,
the project headers it includes (transitively) and its rule, so stage 3 and
stage 7 share ``allocator-<hash>.o`` when nothing in between touched it. (The
flags are the same for every object of a rule in one build folder; ninja
rebuilds an object whose command line changed.)

Usage: python tools/build_stages.py [--upto N] [--out _build] [--kernels] [--sanitize]

--sanitize builds into OUT/sanitize instead, with AddressSanitizer and
UndefinedBehaviorSanitizer (see `nox -s sanitize`, which runs the tests there).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tools import splitter  # noqa: E402

INCLUDE_RE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)
SYSTEM_INCLUDE_RE = re.compile(r"^\s*#\s*include\s+<([^>]+)>", re.M)
# Precompiled headers, per rule. Most translation units of the torch glue read
# the first two, and the bindings the third, directly or through a project
# header; parsing them is a good part of each compile. A unit whose includes
# already hold its rule's headers is compiled with them precompiled (gcc's
# -include and .gch): the same code, since it reads them anyway, so a missing
# #include still fails here as in a vendor's build. (Not with ccache, which
# cannot cache such compiles without settings of its own.) The snapshots' own
# CMake build does not do this.
PCH_HEADERS = {"cxx_torch": ("ATen/core/Tensor.h", "torch/library.h"),
               "cxx_kineto": ("ATen/core/Tensor.h", "torch/library.h"),
               "cxx_python": ("pybind11/pybind11.h",)}
# Glue that plugs into torch.profiler (chapter 19) also reads Kineto's headers.
KINETO_RE = re.compile(r"^\s*#\s*include\s+<torch/csrc/profiler/", re.M)
CXXFLAGS = ["-std=c++20", "-O2", "-g0", "-fPIC", "-fvisibility-inlines-hidden", "-Wall"]
# --sanitize: appended to CXXFLAGS (the later -O1 and -g win), and given to the
# links, which then depend on libasan: Python must LD_PRELOAD it (nox -s sanitize).
SANITIZE_FLAGS = ["-fsanitize=address,undefined", "-fno-omit-frame-pointer", "-O1", "-g"]


def torch_flags() -> tuple[list[str], list[str]]:
    import torch
    from torch.utils import cpp_extension

    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    includes = [f"-isystem{p}" for p in cpp_extension.include_paths()]
    libs = [f"-L{p}" for p in cpp_extension.library_paths()]
    return includes + [f"-D_GLIBCXX_USE_CXX11_ABI={abi}"], libs + ["-lc10", "-ltorch", "-ltorch_cpu", "-ltorch_python"]


def layer_of(rel: str) -> str:
    """csrc/<layer>/file.cpp: which layer a translation unit belongs to."""
    parts = Path(rel).parts
    return parts[1] if len(parts) > 2 and parts[0] == "csrc" else "other"


class Graph:
    def __init__(self, out: Path):
        self.out = out
        # object -> (rule, source, csrc, compiled with the precompiled headers?)
        self.objects: dict[Path, tuple[str, Path, Path, bool]] = {}
        self.precompile = shutil.which("ccache") is None
        self.links: list[str] = []
        self.all_targets: list[str] = []

    def header_closure(self, stage_dir: Path, source: Path) -> list[Path]:
        seen: list[Path] = []
        todo = [source]
        while todo:
            text = todo.pop().read_text()
            for inc in INCLUDE_RE.findall(text):
                path = stage_dir / "csrc" / inc
                if path.exists() and path not in seen:
                    seen.append(path)
                    todo.append(path)
        return sorted(seen)

    def object_for(self, stage_dir: Path, source: Path, rule: str) -> Path:
        # The include root differs per stage but is not part of the identity:
        # the content of every project header the TU reads is (its code only,
        # when it holds nothing but declarations: see identity_text).
        digest = hashlib.sha256(rule.encode())
        for path in [source, *self.header_closure(stage_dir, source)]:
            digest.update(path.relative_to(stage_dir).as_posix().encode() + b"\0")
            digest.update(identity_text(path))
        obj = self.out / "obj" / f"{source.stem}-{digest.hexdigest()[:16]}.o"
        if obj not in self.objects:
            read = set()
            for path in [source, *self.header_closure(stage_dir, source)]:
                read |= set(SYSTEM_INCLUDE_RE.findall(path.read_text()))
            pch = self.precompile and set(PCH_HEADERS.get(rule, ["-"])) <= read
            self.objects[obj] = (rule, source, stage_dir / "csrc", pch)
        return obj


_TOKENS = re.compile(r'//[^\n]*|/\*.*?\*/|"(?:\\.|[^"\\\n])*"|\'(?:\\.|[^\'\\\n])*\'', re.S)
# Code in a header (a function body, a macro call at file scope) would bring
# the header's own line numbers into the object (__LINE__ in TORCH_CHECK, say).
_CODE = re.compile(r"\)\s*(?:const\s*)?(?:noexcept\s*)?(?:override\s*)?(?:->[^{;]*)?\{"
                   r"|^\s*[A-Z][A-Z0-9_]{2,}\s*\(|__LINE__|__builtin_LINE|source_location", re.M)
_DIRECTIVE = re.compile(r"^\s*#")


def identity_text(path: Path) -> bytes:
    """What of a file decides the object compiled from it.

    A source file, or a header with code in it: every byte. A header that only
    declares (the vendor runtime's C API is one): its text without comments and
    blank lines. With -g0 an object does not record where a declaration stood,
    so a chapter that only adds or rewrites comments in such a header (chapter
    12 documents two settings in acme_runtime.h) recompiles nothing that reads it.
    """
    data = path.read_bytes()
    if path.suffix != ".h" or b'R"' in data:
        return data
    text = data.decode()
    # Comments become a space, as the preprocessor makes them; strings stay whole.
    code = _TOKENS.sub(lambda m: " " if m.group().startswith("/") else m.group(), text)
    if _CODE.search("\n".join(line for line in code.splitlines() if not _DIRECTIVE.match(line))):
        return data
    return "\n".join(line.strip() for line in code.splitlines() if line.strip()).encode()


def package_dir(out: Path, number: int) -> Path:
    """Where stage `number`'s build lives: its parent goes on sys.path."""
    return out / "packages" / f"stage-{number:02d}" / "torch_acme"


def plan_stage(graph: Graph, stage_dir: Path, pkg: Path, torch_libs: str) -> None:
    csrc = stage_dir / "csrc"
    runtime = sorted((csrc / "runtime").glob("*.cpp"))
    glue = sorted((csrc / "aten").glob("*.cpp"))
    python = sorted((csrc / "python").glob("*.cpp"))
    stable = sorted((csrc / "stable").glob("*.cpp"))  # chapter 17: the stable ABI

    runtime_objs = [graph.object_for(stage_dir, s, "cxx_runtime") for s in runtime]
    ext_objs = [graph.object_for(stage_dir, s, "cxx_kineto" if KINETO_RE.search(s.read_text())
                                 else "cxx_torch") for s in glue]
    ext_objs += [graph.object_for(stage_dir, s, "cxx_python") for s in python]

    lib = pkg / "libacme_runtime.so"
    ext = pkg / f"_C{sysconfig.get_config_var('EXT_SUFFIX')}"
    # Until the glue exists (chapter 0) the extension does not link PyTorch at all.
    torch_libs = f"{torch_libs} -fopenmp" if glue else ""
    graph.links.append(f"build {lib}: link_runtime {' '.join(map(str, runtime_objs))}")
    graph.links.append(
        f"build {ext}: link_ext {' '.join(map(str, ext_objs))} | {lib}\n"
        f"  libdir = {pkg}\n  torch_libs = {torch_libs}"
    )
    graph.all_targets += [str(lib), str(ext)]
    if stable:
        objs = [graph.object_for(stage_dir, s, "cxx_stable") for s in stable]
        library = pkg / "libacme_stable.so"
        shim = " ".join([f for f in torch_libs.split() if f.startswith("-L")] + ["-ltorch_cpu"])
        graph.links.append(f"build {library}: link_stable {' '.join(map(str, objs))} | {lib}\n"
                           f"  libdir = {pkg}\n  stable_libs = {shim}")
        graph.all_targets.append(str(library))


# A stand-in third-party library (chapter 15): its own package, linked against
# PyTorch only, never against acme.
THIRD_PARTY = ROOT / "tests" / "third_party" / "boxkit"


def plan_third_party(graph: Graph, out: Path, torch_libs: str) -> Path:
    package = out / "third_party" / "boxkit"
    package.mkdir(parents=True, exist_ok=True)
    write_if_changed(package / "__init__.py", (THIRD_PARTY / "__init__.py").read_text())
    obj = graph.object_for(THIRD_PARTY, THIRD_PARTY / "nms.cpp", "cxx_torch")
    library = package / "_boxkit.so"
    graph.links.append(f"build {library}: link_plugin {obj}\n  torch_libs = {torch_libs}")
    graph.all_targets.append(str(library))
    return package.parent


def write_ninja(graph: Graph, flags: dict[str, list[str]], sanitize: bool = False) -> Path:
    cc = "g++" if graph.precompile else "ccache g++"  # Graph looked for ccache
    lines = [
        "ninja_required_version = 1.10",
        f"cxx = {cc}",
        f"base = {' '.join(CXXFLAGS + (SANITIZE_FLAGS if sanitize else []))}",
        f"ldflags = {SANITIZE_FLAGS[0] if sanitize else ''}",
        *(f"{rule}_flags = {' '.join(f)}" for rule, f in flags.items()),
        "",
    ]
    # -MD, not -MMD: the depfile lists the system headers too (torch's come in
    # with -isystem), so reinstalling PyTorch in the environment rebuilds every
    # object and precompiled header that read its headers.
    for rule in ("runtime", "torch", "kineto", "python", "stable"):
        # __FILE__ is part of the stable ABI checks' messages: csrc/..., as in CMake's build.
        relative = " -ffile-prefix-map=$csrc/=csrc/" if rule == "stable" else ""
        lines += [
            f"rule cxx_{rule}",
            f"  command = $cxx $base -I$csrc ${rule}_flags{relative} $pch -MD -MF $out.d -c $in -o $out",
            "  depfile = $out.d",
            "  deps = gcc",
            f"  description = CXX ({rule}) $in",
            "",
        ]
    lines += [
        "rule link_runtime",
        "  command = g++ -shared $ldflags -o $out $in -Wl,-soname,libacme_runtime.so",
        "  description = LINK $out",
        "",
        "rule link_plugin",
        "  command = g++ -shared $ldflags -o $out $in $torch_libs",
        "  description = LINK $out",
        "",
        # The stable-ABI kernels link the C shim's library (libtorch_cpu) alone.
        "rule link_stable",
        "  command = g++ -shared $ldflags -o $out $in -L$libdir -lacme_runtime $stable_libs"
        " '-Wl,-rpath,$$ORIGIN'",
        "  description = LINK $out",
        "",
        "rule link_ext",
        "  command = g++ -shared $ldflags -o $out $in -L$libdir -lacme_runtime $torch_libs"
        " '-Wl,-rpath,$$ORIGIN'",
        "  description = LINK $out",
        "",
    ]
    pch_rules = sorted({rule for rule, _, _, pch in graph.objects.values() if pch})
    for rule in pch_rules:
        header = graph.out / "pch" / rule / "acme_pch.h"
        header.parent.mkdir(parents=True, exist_ok=True)
        write_if_changed(header, "".join(f"#include <{h}>\n" for h in PCH_HEADERS[rule]))
        lines += [
            f"rule pch_{rule}",
            f"  command = $cxx $base ${rule.removeprefix('cxx_')}_flags -x c++-header -MD"
            " -MF $out.d $in -o $out",
            "  depfile = $out.d",
            "  deps = gcc",
            f"  description = PCH ({rule.removeprefix('cxx_')}) $in",
            "",
            f"build {header}.gch: pch_{rule} {header}",
            "",
        ]
    for obj, (rule, source, csrc, pch) in graph.objects.items():
        header = graph.out / "pch" / rule / "acme_pch.h"
        lines.append(f"build {obj}: {rule} {source}" + (f" | {header}.gch" if pch else "")
                     + f"\n  csrc = {csrc}"
                     + (f"\n  pch = -include {header} -Winvalid-pch" if pch else ""))
    lines += graph.links
    lines.append(f"default {' '.join(graph.all_targets)}")
    path = graph.out / "build.ninja"
    text = "\n".join(lines) + "\n"
    if not path.exists() or path.read_text() != text:
        path.write_text(text)
    return path


def write_if_changed(path: Path, text: str) -> None:
    if not path.exists() or path.read_text() != text:
        path.write_text(text)


def snapshot_digest(stage_dir: Path) -> str:
    files = (stage_dir / ".snapshot-files").read_text().split()
    digest = hashlib.sha256()
    for rel in sorted(files):
        digest.update(rel.encode() + b"\0" + (stage_dir / rel).read_bytes())
    return digest.hexdigest()[:16]


def copy_python(stage_dir: Path, pkg: Path) -> None:
    """The snapshot's Python files beside the libraries; stale copies are removed."""
    source = stage_dir / "src" / "torch_acme"
    wanted = {p.relative_to(source) for p in source.rglob("*")
              if p.is_file() and "__pycache__" not in p.parts}
    for rel in wanted:
        target = pkg / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        data = (source / rel).read_bytes()
        if not target.exists() or target.read_bytes() != data:
            target.write_bytes(data)
    for path in pkg.rglob("*.py"):
        if path.relative_to(pkg) not in wanted and path.name not in ("_build_info.py",
                                                                      "_built_against.py"):
            path.unlink()


def install_kernel(number: int, stage_dir: Path, out: Path) -> None:
    """A Jupyter kernel per stage, so a chapter can only run against its own build.

    The kernels live in the build folder (found through JUPYTER_PATH=<out>/jupyter),
    so two build folders never overwrite each other's kernels.
    """
    kernel_dir = out / "jupyter" / "kernels" / f"acme-stage-{number:02d}"
    kernel_dir.mkdir(parents=True, exist_ok=True)
    spec = {
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": f"acme stage {number}",
        "language": "python",
        "env": {
            # The stage's build, then the book's helpers (tools/chapter_support.py),
            # so a chapter's notebook runs from any folder.
            "PYTHONPATH": os.pathsep.join([str(package_dir(out, number).parent),
                                           str(Path(__file__).resolve().parent)]),
            "ACME_STAGE_DIR": str(stage_dir),
            "TORCH_DEVICE_BACKEND_AUTOLOAD": "0",
        },
    }
    write_if_changed(kernel_dir / "kernel.json", json.dumps(spec, indent=1) + "\n")


def build(upto: int | None, out: Path, kernels: bool, jobs: int, sanitize: bool = False) -> list[Path]:
    chapters = [c for c in splitter.load_manifest(ROOT) if upto is None or c.number <= upto]
    if not chapters:
        raise SystemExit(f"no chapter numbered <= {upto} in chapters/chapters.toml")
    out.mkdir(parents=True, exist_ok=True)
    (out / "obj").mkdir(exist_ok=True)
    split_args = ["--root", str(ROOT), "--out", str(out)]
    if splitter.main(split_args + ([] if upto is None else ["--stage", str(upto)])):
        raise SystemExit("the splitter failed (see above)")

    torch_inc, torch_libs = torch_flags()
    # -fopenmp: ATen's at::parallel_for is an OpenMP loop compiled into the
    # glue (CMakeLists.txt, ch05 openmp). Stages before chapter 5 call none.
    glue = torch_inc + ["-fopenmp"]
    flags = {
        "runtime": [],  # the vendor runtime must build without PyTorch
        "torch": glue,
        "kineto": glue + [f"-isystem{Path(torch_inc[0].removeprefix('-isystem')) / 'kineto'}"],
        # pybind11 ships inside torch's include dir
        "python": torch_inc + [f"-isystem{sysconfig.get_paths()['include']}"],
        "stable": [i for i in torch_inc if i.startswith("-isystem")],
    }
    graph = Graph(out)
    stage_dirs = []
    for chapter in chapters:
        stage_dir = (out / "stages" / f"stage-{chapter.number:02d}").resolve()
        pkg = package_dir(out, chapter.number)
        pkg.mkdir(parents=True, exist_ok=True)
        plan_stage(graph, stage_dir, pkg, " ".join(torch_libs))
        stage_dirs.append((chapter.number, stage_dir))
    plan_third_party(graph, out, " ".join(torch_libs))
    ninja_path = write_ninja(graph, flags, sanitize)
    ninja = shutil.which("ninja") or "ninja"
    subprocess.run([ninja, "-f", str(ninja_path), f"-j{jobs}"], check=True, cwd=out)

    for number, stage_dir in stage_dirs:
        # Builds before chapter 17 wrote their libraries into the snapshot itself.
        for stale in (stage_dir / "src" / "torch_acme").glob("*.so"):
            stale.unlink()
        (stage_dir / "src" / "torch_acme" / "_build_info.py").unlink(missing_ok=True)
        copy_python(stage_dir, package_dir(out, number))
        write_if_changed(
            package_dir(out, number) / "_build_info.py",
            f'"""Written by tools/build_stages.py: which stage this build is."""\n'
            f"STAGE = {number}\nSOURCE_DIGEST = {snapshot_digest(stage_dir)!r}\n",
        )
        if number >= 17:  # what CMake writes from chapter 17 on (CMakeLists.txt, ch17 built-against)
            import torch
            write_if_changed(package_dir(out, number) / "_built_against.py",
                             "# Written by CMake: the PyTorch release the libraries were compiled "
                             f'against.\nTORCH = "{torch.__version__}"\n')
        if kernels:
            install_kernel(number, stage_dir, out)
    return [d for _, d in stage_dirs]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--upto", type=int, default=None, help="last stage to build")
    parser.add_argument("--out", type=Path, default=ROOT / "_build")
    parser.add_argument("--kernels", action="store_true", help="write a Jupyter kernel per stage into OUT/jupyter")
    parser.add_argument("-j", "--jobs", type=int, default=os.cpu_count() or 2)
    parser.add_argument("--sanitize", action="store_true",
                        help="build into OUT/sanitize with -fsanitize=address,undefined")
    args = parser.parse_args()
    out = args.out.resolve() / "sanitize" if args.sanitize else args.out.resolve()
    build(args.upto, out, args.kernels, args.jobs, args.sanitize)


if __name__ == "__main__":
    main()
