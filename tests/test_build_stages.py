"""tools/build_stages.py: when two stages may share an object file."""
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from tools.build_stages import Graph, identity_text  # noqa: E402

DECLARATIONS = """\
// The runtime's C API.
#pragma once
#define ACME_API __attribute__((visibility("default")))
typedef enum acmeError { acmeSuccess = 0, acmeErrorX = 1 } acmeError_t;
/* Frees an allocation. */
ACME_API acmeError_t acmeFree(void* p);
ACME_API const char* acmeName(void); /* "acme // A1" below is a string */
static const char* const kName = "acme // A1";
"""
SOURCE = '#include "runtime/api.h"\nint f() { return 1; }\n'


def stage(root: Path, header: str, source: str = SOURCE) -> Path:
    (root / "csrc" / "runtime").mkdir(parents=True)
    (root / "csrc" / "runtime" / "api.h").write_text(header)
    (root / "csrc" / "aten").mkdir()
    (root / "csrc" / "aten" / "user.cpp").write_text(source)
    return root


def object_names(tmp_path: Path, first: str, second: str, **kwargs) -> tuple[str, str]:
    graph = Graph(tmp_path / "out")
    names = []
    for index, header in enumerate((first, second)):
        root = stage(tmp_path / f"stage-{index}", header, **kwargs)
        names.append(graph.object_for(root, root / "csrc" / "aten" / "user.cpp", "cxx_torch").name)
    return names[0], names[1]


def test_comments_in_a_declaration_only_header_do_not_rebuild(tmp_path):
    documented = DECLARATIONS.replace("/* Frees an allocation. */",
                                      "/* Frees an allocation given its base pointer.\n"
                                      " * NULL is a no-op; it first waits for queued work. */\n")
    first, second = object_names(tmp_path, DECLARATIONS, documented + "\n\n// more prose\n")
    assert first == second


def test_code_changes_rebuild(tmp_path):
    changes = (DECLARATIONS.replace("acmeErrorX = 1", "acmeErrorX = 1, acmeErrorY = 2"),
               DECLARATIONS + "ACME_API acmeError_t acmeInit(void);\n",
               # a string that looks like a comment is code
               DECLARATIONS.replace('"acme // A1"', '"acme // A2"'))
    for case, changed in enumerate(changes):
        first, second = object_names(tmp_path / str(case), DECLARATIONS, changed)
        assert first != second, changed


def test_a_header_with_code_keeps_its_line_numbers(tmp_path):
    # An inline function's TORCH_CHECK records the header's own line: moving it
    # by a comment line changes the object.
    with_code = DECLARATIONS + 'inline int g(int x) {\n  TORCH_CHECK(x > 0, "x");\n  return x;\n}\n'
    first, second = object_names(tmp_path, with_code, "// one more line\n" + with_code)
    assert first != second
    header = tmp_path / "stage-1" / "csrc" / "runtime" / "api.h"
    assert identity_text(header) == header.read_bytes()


def test_a_comment_in_a_source_file_rebuilds_it(tmp_path):
    # TORCH_LIBRARY_IMPL and TORCH_CHECK record the source's line numbers.
    first, _ = object_names(tmp_path / "a", DECLARATIONS, DECLARATIONS)
    second, _ = object_names(tmp_path / "b", DECLARATIONS, DECLARATIONS,
                             source="// moved\n" + SOURCE)
    assert first != second
