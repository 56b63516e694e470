"""Tests for tools/splitter.py on small synthetic trees (plus the real tree if present)."""
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from tools import splitter  # noqa: E402
from tools.splitter import SplitError  # noqa: E402

MANIFEST = "".join(
    f'[[chapter]]\nnumber = {n}\nslug = "s{n}"\ntitle = "Chapter {n}"\n' for n in (0, 1, 2, 3))


def make_tree(root: Path, files: dict[str, str], manifest: str = MANIFEST) -> Path:
    (root / "chapters").mkdir(parents=True, exist_ok=True)
    (root / "chapters" / "chapters.toml").write_text(manifest)
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return root


def stages(root):
    return {c.number: splitter.render(root, c.number) for c in splitter.load_manifest(root)}


CPP = """\
    #include <cstddef>
    //> ch01 alloc
    void* alloc(size_t n);
    //< ch01 alloc
    int main() {
    //> ch02 call
      alloc(1);
    //< ch02 call
    }
    """


def test_manifest_sorted(tmp_path):
    manifest = '[[chapter]]\nnumber = 2\nslug = "b"\ntitle = "B"\n' \
               '[[chapter]]\nnumber = 0\nslug = "a"\ntitle = "A"\n'
    make_tree(tmp_path, {}, manifest)
    assert splitter.load_manifest(tmp_path) == [
        splitter.Chapter(0, "a", "A"), splitter.Chapter(2, "b", "B")]


def test_added_blocks_per_stage(tmp_path):
    make_tree(tmp_path, {"csrc/a.cpp": CPP, "README.md": "not a snapshot root\n"})
    s = stages(tmp_path)
    assert s[0] == {"csrc/a.cpp": "#include <cstddef>\nint main() {\n}\n"}
    assert s[1]["csrc/a.cpp"] == "#include <cstddef>\nvoid* alloc(size_t n);\nint main() {\n}\n"
    assert s[2]["csrc/a.cpp"] == s[3]["csrc/a.cpp"] == (
        "#include <cstddef>\nvoid* alloc(size_t n);\nint main() {\n  alloc(1);\n}\n")


def test_nested_blocks_and_roots(tmp_path):
    make_tree(tmp_path, {
        "src/pkg/m.py": """\
            import os
            #> ch01 outer
            def f():
                #> ch02 inner
                print("two")
                #< ch02 inner
                return 1
            #< ch01 outer
            """,
        "CMakeLists.txt": "#> ch03 late\nproject(x)\n#< ch03 late\n",
        "pyproject.toml": "[project]\n",
        "src/pkg/__pycache__/m.cpython-311.pyc": "junk",
        "src/pkg/ext.so": "junk",
    })
    s = stages(tmp_path)
    assert sorted(s[0]) == ["CMakeLists.txt", "pyproject.toml", "src/pkg/m.py"]
    assert s[0]["src/pkg/m.py"] == "import os\n"
    assert s[0]["CMakeLists.txt"] == ""  # fully stripped files still exist
    assert s[1]["src/pkg/m.py"] == "import os\ndef f():\n    return 1\n"
    assert s[2]["src/pkg/m.py"] == 'import os\ndef f():\n    print("two")\n    return 1\n'
    assert s[3]["CMakeLists.txt"] == "project(x)\n"


def test_replaced_blocks_cpp(tmp_path):
    make_tree(tmp_path, {"csrc/r.cpp": """\
        int f() {
          //> ch01 old-body < ch02 new-body
          // int x = 1;
          //
          //   return x;
          //< ch01 old-body
          //> ch02 new-body
          return 2;
          //< ch02 new-body
        }
        """})
    s = stages(tmp_path)
    assert s[0]["csrc/r.cpp"] == "int f() {\n}\n"
    assert s[1]["csrc/r.cpp"] == "int f() {\n  int x = 1;\n\n    return x;\n}\n"
    assert s[2]["csrc/r.cpp"] == s[3]["csrc/r.cpp"] == "int f() {\n  return 2;\n}\n"


def test_removed_block_python(tmp_path):
    make_tree(tmp_path, {"src/m.py": """\
        def g():
            #> ch00 debug < ch03 -
            # print("debug")
            # # a comment stays a comment
            #< ch00 debug
            return 0
        """})
    s = stages(tmp_path)
    expected = 'def g():\n    print("debug")\n    # a comment stays a comment\n    return 0\n'
    assert s[0]["src/m.py"] == s[2]["src/m.py"] == expected
    assert s[3]["src/m.py"] == "def g():\n    return 0\n"


def test_file_tags(tmp_path):
    make_tree(tmp_path, {
        "csrc/new.cpp": "//@ ch01\nint a;\n//> ch02 more\nint b;\n//< ch02 more\n",
        "csrc/gone.cpp": "//@ ch00 < ch02\nint old;\n",
    })
    s = stages(tmp_path)
    assert s[0] == {"csrc/gone.cpp": "int old;\n"}
    assert s[1] == {"csrc/gone.cpp": "int old;\n", "csrc/new.cpp": "int a;\n"}
    assert s[2] == {"csrc/new.cpp": "int a;\nint b;\n"}


ERRORS = [
    ("unbalanced open", {"csrc/a.cpp": "x\n//> ch01 a\ny\n"}, "csrc/a.cpp:2:", "never closed"),
    ("stray close", {"csrc/a.cpp": "x\n//< ch01 a\n"}, "csrc/a.cpp:2:", "no open block"),
    ("mismatched close", {"csrc/a.cpp": "//> ch01 a\n//> ch01 b\n//< ch01 a\n//< ch01 b\n"},
     "csrc/a.cpp:3:", "ch01 a does not match open block ch01 b"),
    ("unknown chapter", {"src/a.py": "#> ch07 a\n#< ch07 a\n"}, "src/a.py:1:", "unknown chapter ch07"),
    ("unknown until", {"src/a.py": "#> ch01 a < ch09 -\n#< ch01 a\n"}, "src/a.py:1:", "unknown chapter ch09"),
    ("bad replaced line", {"csrc/a.cpp": "  //> ch01 a < ch02 -\n  // ok\n  int x;\n  //< ch01 a\n"},
     "csrc/a.cpp:3:", "replaced block ch01 a"),
    ("replaced line without space", {"src/a.py": "#> ch01 a < ch02 -\n#x = 1\n#< ch01 a\n"},
     "src/a.py:2:", "replaced block ch01 a"),
    ("nested in replaced", {"csrc/a.cpp": "//> ch01 a < ch02 -\n//> ch01 b\n//< ch01 b\n//< ch01 a\n"},
     "csrc/a.cpp:2:", "nested inside replaced block ch01 a"),
    ("inner older", {"csrc/a.cpp": "//> ch02 a\n//> ch01 b\n//< ch01 b\n//< ch02 a\n"},
     "csrc/a.cpp:2:", "older than its enclosing block"),
    ("until not later", {"csrc/a.cpp": "//> ch02 a < ch01 -\n//< ch02 a\n"},
     "csrc/a.cpp:1:", "later chapter"),
    ("duplicate across files", {"csrc/a.cpp": "//> ch01 a\n//< ch01 a\n",
                                "csrc/b.cpp": "x\n//> ch01 a\n//< ch01 a\n"},
     "csrc/b.cpp:2:", "already defined in csrc/a.cpp:1"),
    ("missing other", {"csrc/a.cpp": "x\n//> ch01 a < ch02 nope\n//< ch01 a\n"},
     "csrc/a.cpp:2:", "ch02 nope does not exist"),
    ("malformed marker", {"csrc/a.cpp": "x\n//> ch1 a\n//< ch1 a\n"}, "csrc/a.cpp:2:", "malformed"),
    ("malformed name", {"src/a.py": "#> ch01 Bad\n#< ch01 Bad\n"}, "src/a.py:1:", "malformed"),
    ("wrong leader", {"src/a.py": "//> ch01 a\n"}, "src/a.py:1:", "comment leader"),
    ("tag not first", {"csrc/a.cpp": "x\n//@ ch01\n"}, "csrc/a.cpp:2:", "first line"),
    ("malformed tag", {"CMakeLists.txt": "#@ ch01 extra\n"}, "CMakeLists.txt:1:", "malformed file tag"),
    ("block older than tag", {"csrc/a.cpp": "//@ ch02\n//> ch01 a\n//< ch01 a\n"},
     "csrc/a.cpp:2:", "older than its enclosing file tag"),
]


@pytest.mark.parametrize("files, where, message", [e[1:] for e in ERRORS], ids=[e[0] for e in ERRORS])
def test_errors(tmp_path, files, where, message):
    make_tree(tmp_path, files)
    with pytest.raises(SplitError) as info:
        splitter.render(tmp_path, 3)
    assert str(info.value).startswith(where)
    assert message in str(info.value)


def test_same_block_twice_in_one_file_is_one_snippet(tmp_path):
    make_tree(tmp_path, {"csrc/a.cpp": """\
        //> ch01 decl
        int a;
        //< ch01 decl
        int mid;
        namespace n {
          //> ch01 decl
          int b;
          //> ch02 later
          int c;
          //< ch02 later
          //< ch01 decl
        }
        """, "csrc/t.h": "//@ ch02\n#pragma once\n"})
    files = splitter.collect_snippets(splitter.parse_tree(tmp_path))
    assert files["ch01/decl.cpp"] == "int a;\n// ...\nint b;\n"
    assert files["ch02/later.cpp"] == "int c;\n"
    assert files["ch02/t.h"] == "#pragma once\n"
    index = json.loads(files["index.json"])
    assert index["ch01"]["decl"] == {"file": "csrc/a.cpp", "snippet": "snippets/ch01/decl.cpp",
                                     "language": "cpp", "kind": "block"}
    assert index["ch02"]["t.h"]["kind"] == "file"


def test_snippet_name_collision_is_an_error(tmp_path):
    # A block `alloc` in alloc.cpp and the whole-file snippet of alloc.cpp share a path.
    make_tree(tmp_path, {"csrc/alloc.cpp": "//@ ch01\n//> ch01 alloc\nx\n//< ch01 alloc\n"})
    with pytest.raises(SplitError, match=r"^csrc/alloc.cpp:1: snippet ch01/alloc.cpp"):
        splitter.collect_snippets(splitter.parse_tree(tmp_path))


def test_snippets_written_with_index(tmp_path):
    make_tree(tmp_path, {"csrc/r.cpp": """\
        int f() {
          //> ch01 old-body < ch02 new-body
          // return 1;
          //< ch01 old-body
          //> ch02 new-body
          return 2;
          //< ch02 new-body
        }
        """, "CMakeLists.txt": "#> ch00 proj\nproject(p)\n#< ch00 proj\n",
        "src/m.py": "#> ch03 main\nif True:\n    #> ch03 body\n    pass\n    #< ch03 body\n#< ch03 main\n"})
    out = tmp_path / "_build"
    splitter.write_snippets(tmp_path, out)
    assert (out / "snippets/ch01/old-body.cpp").read_text() == "return 1;\n"
    assert (out / "snippets/ch02/new-body.cpp").read_text() == "return 2;\n"
    assert (out / "snippets/ch03/body.py").read_text() == "pass\n"
    assert (out / "snippets/ch03/main.py").read_text() == "if True:\n    pass\n"
    index = json.loads((out / "snippets/index.json").read_text())
    assert index["ch00"]["proj"] == {"file": "CMakeLists.txt", "snippet": "snippets/ch00/proj.txt",
                                     "language": "cmake", "kind": "block"}
    assert index["ch03"]["main"]["language"] == "python"
    splitter.write_snippets(tmp_path, out, upto=1)  # --stage 1: later snippets go away
    assert sorted(json.loads((out / "snippets/index.json").read_text())) == ["ch00", "ch01"]
    assert not (out / "snippets/ch03").exists()


def test_unchanged_files_keep_mtime(tmp_path):
    make_tree(tmp_path, {"csrc/a.cpp": CPP, "csrc/b.cpp": "int b;\n"})
    out = tmp_path / "out"
    assert splitter.write_snapshot(tmp_path, 1, out) == (2, 0, 0)
    old = 1_000_000_000
    for name in ("a.cpp", "b.cpp"):
        os.utime(out / "csrc" / name, (old, old))
    assert splitter.write_snapshot(tmp_path, 1, out) == (0, 2, 0)
    assert (out / "csrc/a.cpp").stat().st_mtime == old
    assert splitter.write_snapshot(tmp_path, 2, out) == (1, 1, 0)
    assert (out / "csrc/a.cpp").stat().st_mtime != old
    assert "alloc(1);" in (out / "csrc/a.cpp").read_text()
    assert (out / "csrc/b.cpp").stat().st_mtime == old


def test_stale_files_removed_untracked_survive(tmp_path):
    make_tree(tmp_path, {"csrc/keep.cpp": "int k;\n",
                         "csrc/sub/gone.cpp": "//@ ch00 < ch02\nint g;\n"})
    out = tmp_path / "out"
    splitter.write_snapshot(tmp_path, 0, out)
    assert (out / ".snapshot-files").read_text() == "csrc/keep.cpp\ncsrc/sub/gone.cpp\n"
    (out / "x.so").write_text("binary")
    (out / "csrc/sub/y.o").write_text("object")
    assert splitter.write_snapshot(tmp_path, 2, out) == (0, 1, 1)
    assert not (out / "csrc/sub/gone.cpp").exists()
    assert (out / "x.so").read_text() == "binary"
    assert (out / "csrc/sub/y.o").exists()  # directory not empty, so it stays
    (out / "csrc/sub/y.o").unlink()
    splitter.write_snapshot(tmp_path, 0, out)
    splitter.write_snapshot(tmp_path, 3, out)
    assert not (out / "csrc/sub").exists()  # emptied directories are removed
    assert (out / ".snapshot-files").read_text() == "csrc/keep.cpp\n"


def test_diff_and_stat(tmp_path):
    make_tree(tmp_path, {"csrc/a.cpp": CPP, "csrc/n.h": "//@ ch02\nint n;\n",
                         "csrc/o.h": "//@ ch00 < ch02\nint o;\n"})
    out = tmp_path / "_build"
    splitter.write_diffs(tmp_path, out)
    d0 = (out / "diffs/stage-00.diff").read_text()
    assert d0.startswith("--- /dev/null\n+++ b/csrc/a.cpp\n@@ -0,0 +1,3 @@\n+#include <cstddef>\n")
    d2 = (out / "diffs/stage-02.diff").read_text()
    assert "--- a/csrc/a.cpp\n+++ b/csrc/a.cpp\n" in d2
    assert " int main() {\n+  alloc(1);\n }\n" in d2
    assert "--- /dev/null\n+++ b/csrc/n.h\n@@ -0,0 +1 @@\n+int n;\n" in d2
    assert "--- a/csrc/o.h\n+++ /dev/null\n@@ -1 +0,0 @@\n-int o;\n" in d2
    assert d2.index("csrc/a.cpp") < d2.index("csrc/n.h") < d2.index("csrc/o.h")
    stat = json.loads((out / "diffs/stage-02.stat.json").read_text())
    assert stat == {"added": ["csrc/n.h"], "removed": ["csrc/o.h"], "changed": ["csrc/a.cpp"],
                    "insertions": 2, "deletions": 1}
    assert (out / "diffs/stage-03.diff").read_text() == ""


def test_cli(tmp_path):
    root = make_tree(tmp_path / "good", {"csrc/a.cpp": CPP})
    out = tmp_path / "out"
    cmd = [sys.executable, str(REPO / "tools" / "splitter.py"), "--root", str(root), "--out", str(out)]
    run = subprocess.run(cmd + ["--stage", "1"], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines()[:2] == ["stage 00 s0: 2 written, 0 unchanged, 0 removed",
                                           "stage 01 s1: 2 written, 0 unchanged, 0 removed"]
    assert not (out / "stages/stage-02").exists() and not (out / "diffs/stage-02.diff").exists()
    assert subprocess.run(cmd, capture_output=True).returncode == 0
    assert "alloc(1);" in (out / "stages/stage-03/csrc/a.cpp").read_text()
    assert (out / "snippets/ch02/call.cpp").read_text() == "alloc(1);\n"

    bad = make_tree(tmp_path / "bad", {"csrc/a.cpp": "x\n//> ch01 open\n"})
    run = subprocess.run([sys.executable, str(REPO / "tools" / "splitter.py"), "--root", str(bad),
                          "--out", str(tmp_path / "out2")], capture_output=True, text=True)
    assert run.returncode != 0
    assert "csrc/a.cpp:2:" in run.stderr


def test_real_tree_renders_every_stage(tmp_path):
    # The real repository if it already has a manifest, otherwise a synthetic stand-in.
    root = REPO if (REPO / "chapters" / "chapters.toml").exists() else make_tree(
        tmp_path, {"csrc/a.cpp": CPP, "src/m.py": "#@ ch01\nx = 1\n"})
    tree = splitter.parse_tree(root)
    assert tree.chapters
    for chapter in tree.chapters:
        files = splitter.render_tree(tree, chapter.number)
        assert all(isinstance(text, str) for text in files.values())
    splitter.collect_snippets(tree)
    splitter.collect_diffs(tree)
