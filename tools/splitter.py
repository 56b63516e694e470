"""Derive per-chapter stages, snippets and diffs from the final source tree.

One tree holds the finished code; chapter markers in comments say which chapter
added (or later replaced) which lines, so "stage N" is exactly what a reader has
after chapter N.  Marker grammar (L is the file's comment leader, // or #):

    L@ chNN [< chMM]             first line only: file exists iff NN <= stage (< MM)
    L> chNN name  ...  L< chNN name                 lines exist iff stage >= NN
    L> chNN name < chMM other|-  ...  L< chNN name  lines exist iff NN <= stage < MM;
                                 inner lines are commented out as `indent + L [code]`

Usage: python tools/splitter.py --root . --out _build [--stage N]
"""
from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import math
import re
import sys
import textwrap
import tomllib
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import stage_readme  # noqa: E402

SNAPSHOT_ROOTS = ("csrc", "src", "build_support", "CMakeLists.txt", "pyproject.toml")
SKIP_SUFFIXES = {".pyc", ".so", ".o"}
RECORD = ".snapshot-files"
C_LIKE = {".h", ".hpp", ".c", ".cc", ".cpp", ".cu"}
HASH_LIKE = {".py", ".txt", ".cmake", ".toml", ".cfg", ".sh", ".ini", ".in"}
LANGUAGES = {".py": "python", ".cmake": "cmake", ".toml": "toml", **{s: "cpp" for s in C_LIKE}}
NAME = r"[a-z0-9][a-z0-9_-]*"
LOOKS_LIKE_MARKER = re.compile(r"^(//|#)[<>@]\s*ch")
OPEN = re.compile(rf"^>\s*ch(\d\d)\s+({NAME})(?:\s*<\s*ch(\d\d)\s+({NAME}|-))?$")
CLOSE = re.compile(rf"^<\s*ch(\d\d)\s+({NAME})$")
TAG = re.compile(r"^@\s*ch(\d\d)(?:\s*<\s*ch(\d\d))?$")


class SplitError(Exception):
    """A malformed tree; the message is always `path:line: message`."""


@dataclasses.dataclass(frozen=True)
class Chapter:
    number: int
    slug: str
    title: str


@dataclasses.dataclass
class Block:
    chapter: int
    name: str
    until: int | None  # chapter that removes the block (replaced blocks only)
    other: str | None  # block of `until` replacing it, or "-"
    path: str
    line: int
    indent: str
    hi: float  # inner lines are visible iff chapter <= stage < hi (enclosing blocks included)
    start: int = 0  # slice of SourceFile.items holding the inner lines
    end: int = 0


@dataclasses.dataclass
class SourceFile:
    leader: str | None
    lo: float  # file-level tag; -inf/inf when untagged
    hi: float
    items: list = dataclasses.field(default_factory=list)  # (lo, hi, text) per output line
    blocks: list = dataclasses.field(default_factory=list)  # closed Blocks, in closing order


@dataclasses.dataclass
class Tree:
    chapters: list[Chapter]
    files: dict[str, SourceFile]
    blocks: list[Block]


def load_manifest(root) -> list[Chapter]:
    path = Path(root) / "chapters" / "chapters.toml"
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise SplitError(f"chapters/chapters.toml:1: cannot load manifest: {exc}") from exc
    chapters = []
    for entry in data.get("chapter", []):
        number, slug, title = entry.get("number"), entry.get("slug"), entry.get("title")
        if type(number) is not int or not isinstance(slug, str) or not isinstance(title, str):
            raise SplitError(f"chapters/chapters.toml:1: bad chapter entry {entry!r}")
        chapters.append(Chapter(number, slug, title))
    chapters.sort(key=lambda c: c.number)
    numbers = [c.number for c in chapters]
    if len(set(numbers)) != len(numbers):
        raise SplitError(f"chapters/chapters.toml:1: duplicate chapter numbers in {numbers}")
    return chapters


def leader_for(path: str) -> str | None:
    p = Path(path)
    if p.suffix in C_LIKE:
        return "//"
    return "#" if p.suffix in HASH_LIKE or p.name == "CMakeLists.txt" else None


def _lines(text: str) -> list[str]:
    # Keep line endings so untouched lines round-trip byte for byte (str.splitlines
    # would also split on form feeds and friends).
    return re.findall(r"[^\n]*\n|[^\n]+", text)


def parse_file(path: str, text: str, known: set[int]) -> SourceFile:
    leader = leader_for(path)
    src = SourceFile(leader, -math.inf, math.inf)
    if leader is None:
        src.items.append((-math.inf, math.inf, text))
        return src
    stack = []

    def fail(lineno, message):
        raise SplitError(f"{path}:{lineno}: {message}")

    def chapter(lineno, digits):
        if int(digits) not in known:
            fail(lineno, f"unknown chapter ch{digits} (not in chapters.toml)")
        return int(digits)

    for lineno, line in enumerate(_lines(text), 1):
        body = line.rstrip("\r\n")
        ending, stripped = line[len(body):], body.strip()
        top = stack[-1] if stack else None
        if LOOKS_LIKE_MARKER.match(stripped):
            if not stripped.startswith(leader):
                fail(lineno, f"marker {stripped!r} must use this file's comment leader {leader!r}")
            rest = stripped[len(leader):]
            if rest[0] == "@":
                if lineno != 1:
                    fail(lineno, f"file tag {stripped!r} is only allowed on the first line")
                if not (m := TAG.match(rest)):
                    fail(lineno, f"malformed file tag {stripped!r}")
                src.lo = chapter(lineno, m[1])
                src.hi = chapter(lineno, m[2]) if m[2] else math.inf
                if src.hi <= src.lo:
                    fail(lineno, f"file tag removes the file before it is added: {stripped!r}")
            elif rest[0] == ">":
                if not (m := OPEN.match(rest)):
                    fail(lineno, f"malformed opening marker {stripped!r}")
                if top and top.until is not None:
                    fail(lineno, f"block ch{m[1]} {m[2]} nested inside replaced block "
                                 f"ch{top.chapter:02d} {top.name} (line {top.line})")
                ch = chapter(lineno, m[1])
                until = chapter(lineno, m[3]) if m[3] else None
                outer_lo, outer_hi = (top.chapter, top.hi) if top else (src.lo, src.hi)
                if ch < outer_lo:
                    fail(lineno, f"block ch{m[1]} {m[2]} is older than its enclosing "
                                 f"{'block' if top else 'file tag'} (ch{int(outer_lo):02d})")
                if until is not None and until <= ch:
                    fail(lineno, f"block ch{m[1]} {m[2]} must be replaced by a later chapter")
                hi = min(outer_hi, until if until is not None else math.inf)
                if ch >= hi:
                    fail(lineno, f"block ch{m[1]} {m[2]} would never be visible")
                stack.append(Block(ch, m[2], until, m[4], path, lineno,
                                   body[: len(body) - len(body.lstrip())], hi,
                                   start=len(src.items)))
            else:
                if not (m := CLOSE.match(rest)):
                    fail(lineno, f"malformed closing marker {stripped!r}")
                if top is None:
                    fail(lineno, f"closing marker ch{m[1]} {m[2]} has no open block")
                if (int(m[1]), m[2]) != (top.chapter, top.name):
                    fail(lineno, f"closing marker ch{m[1]} {m[2]} does not match open block "
                                 f"ch{top.chapter:02d} {top.name} (line {top.line})")
                top.end = len(src.items)
                src.blocks.append(stack.pop())
            continue
        if top and top.until is not None:
            # Replaced code is commented out in the final tree; uncomment it.
            prefix = top.indent + leader
            if body == prefix:
                body = ""
            elif body.startswith(prefix + " "):
                body = top.indent + body[len(prefix) + 1:]
            else:
                fail(lineno, f"line in replaced block ch{top.chapter:02d} {top.name} "
                             f"must be {prefix!r} followed by a space and code")
            src.items.append((top.chapter, top.hi, body + ending))
        else:
            src.items.append((top.chapter, top.hi, line) if top else (src.lo, src.hi, line))
    if stack:
        fail(stack[-1].line, f"block ch{stack[-1].chapter:02d} {stack[-1].name} is never closed")
    return src


def _source_paths(root: Path):
    for entry in SNAPSHOT_ROOTS:
        base = root / entry
        for p in sorted(base.rglob("*")) if base.is_dir() else [base] if base.is_file() else []:
            rel = p.relative_to(root)
            if p.is_file() and "__pycache__" not in rel.parts and p.suffix not in SKIP_SUFFIXES:
                yield rel.as_posix(), p


def parse_tree(root) -> Tree:
    root = Path(root)
    chapters = load_manifest(root)
    known = {c.number for c in chapters}
    files, blocks = {}, []
    for rel, p in _source_paths(root):
        with open(p, encoding="utf-8", errors="surrogateescape", newline="") as f:
            files[rel] = parse_file(rel, f.read(), known)
        blocks += sorted(files[rel].blocks, key=lambda b: b.line)
    seen = {}
    for b in blocks:  # (chapter, name) may repeat within one file, never across files
        first = seen.setdefault((b.chapter, b.name), b)
        if first.path != b.path:
            raise SplitError(f"{b.path}:{b.line}: block ch{b.chapter:02d} {b.name} "
                             f"already defined in {first.path}:{first.line}")
    for b in blocks:
        if b.other not in (None, "-") and (b.until, b.other) not in seen:
            raise SplitError(f"{b.path}:{b.line}: replacement block ch{b.until:02d} "
                             f"{b.other} does not exist")
    return Tree(chapters, files, blocks)


def _check_stage(tree: Tree, stage: int):
    if stage not in {c.number for c in tree.chapters}:
        raise SplitError(f"chapters/chapters.toml:1: stage {stage} is not a chapter")


def _render_file(src: SourceFile, stage: int) -> str | None:
    if not src.lo <= stage < src.hi:
        return None
    return "".join(text for lo, hi, text in src.items if lo <= stage < hi)


def render_tree(tree: Tree, stage: int) -> dict[str, str]:
    _check_stage(tree, stage)
    out = {rel: _render_file(src, stage) for rel, src in tree.files.items()}
    return {rel: text for rel, text in sorted(out.items()) if text is not None}


def render(root, stage: int) -> dict[str, str]:
    return render_tree(parse_tree(root), stage)


def sync_dir(outdir, files: dict[str, str]) -> tuple[int, int, int]:
    """Make outdir hold `files`; returns (written, unchanged, removed).

    Unchanged files are not touched so their mtime survives (incremental builds);
    only files recorded in RECORD by an earlier run are ever deleted.
    """
    outdir = Path(outdir)
    record = outdir / RECORD
    previous = set(record.read_text(encoding="utf-8").splitlines()) if record.is_file() else set()
    written = unchanged = removed = 0
    for rel, text in files.items():
        target, data = outdir / rel, text.encode("utf-8", "surrogateescape")
        if target.is_file() and target.read_bytes() == data:
            unchanged += 1
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
        written += 1
    for rel in sorted(previous - set(files)):
        target = outdir / rel
        if Path(rel).is_absolute() or ".." in Path(rel).parts or not target.is_file():
            continue  # never delete outside outdir or anything we did not write
        target.unlink()
        removed += 1
        parent = target.parent
        while parent != outdir and not any(parent.iterdir()):
            parent.rmdir()
            parent = parent.parent
    listing = "".join(f"{rel}\n" for rel in sorted(files))
    if not record.is_file() or record.read_text(encoding="utf-8") != listing:
        outdir.mkdir(parents=True, exist_ok=True)
        record.write_text(listing, encoding="utf-8")
    return written, unchanged, removed


def write_snapshot(root, stage: int, outdir, tree: Tree | None = None) -> tuple[int, int, int]:
    return sync_dir(outdir, render_tree(tree or parse_tree(root), stage))


def _language(path: str) -> str:
    p = Path(path)
    return "cmake" if p.name == "CMakeLists.txt" else LANGUAGES.get(p.suffix, "text")


def collect_snippets(tree: Tree, upto: int | None = None) -> dict[str, str]:
    """Snippet files (relative to snippets/) plus index.json, for chapters <= upto."""
    parts, index, files = {}, {}, {}
    for b in tree.blocks:  # each part is what the reader sees in the block's chapter
        src = tree.files[b.path]
        text = "".join(t for lo, hi, t in src.items[b.start:b.end] if lo <= b.chapter < hi)
        parts.setdefault((b.chapter, b.name, b.path), []).append(textwrap.dedent(text))
    entries = [(ch, name, path, "block", f"{name}{Path(path).suffix}",
                f"{tree.files[path].leader} ...\n".join(texts))
               for (ch, name, path), texts in parts.items()]
    entries += [(int(src.lo), Path(path).name, path, "file", Path(path).name,
                 _render_file(src, int(src.lo)))
                for path, src in tree.files.items() if src.lo != -math.inf]
    for ch, key, path, kind, filename, text in sorted(entries, key=lambda e: e[:2]):
        if upto is not None and ch > upto:
            continue
        rel = f"ch{ch:02d}/{filename}"
        if rel in files:
            raise SplitError(f"{path}:1: snippet {rel} is produced twice")
        files[rel] = text
        index.setdefault(f"ch{ch:02d}", {})[key] = {
            "file": path, "snippet": f"snippets/{rel}", "language": _language(path), "kind": kind}
    files["index.json"] = json.dumps(index, indent=2, sort_keys=True) + "\n"
    return files


def write_snippets(root, outdir, upto: int | None = None, tree: Tree | None = None):
    return sync_dir(Path(outdir) / "snippets", collect_snippets(tree or parse_tree(root), upto))


def diff_trees(old: dict[str, str], new: dict[str, str]) -> tuple[str, dict]:
    """Unified diff old -> new (a/ and b/ headers, /dev/null for added/removed) and stats."""
    out, stat = [], {"added": [], "removed": [], "changed": [], "insertions": 0, "deletions": 0}
    for path in sorted(set(old) | set(new)):
        a, b = old.get(path), new.get(path)
        if a == b:
            continue
        kind = "added" if a is None else "removed" if b is None else "changed"
        stat[kind].append(path)
        fa = "/dev/null" if a is None else f"a/{path}"
        fb = "/dev/null" if b is None else f"b/{path}"
        lines = list(difflib.unified_diff(_lines(a or ""), _lines(b or ""), fa, fb, n=3))
        for i, line in enumerate(lines or [f"--- {fa}\n", f"+++ {fb}\n"]):
            if i >= 2 and line[0] in "+-":  # the first two lines are the file headers
                stat["insertions" if line[0] == "+" else "deletions"] += 1
            out.append(line if line.endswith("\n") else line + "\n\\ No newline at end of file\n")
    return "".join(out), stat


def collect_diffs(tree: Tree, upto: int | None = None) -> dict[str, str]:
    files, previous = {}, {}
    for c in tree.chapters:
        if upto is not None and c.number > upto:
            break
        current = render_tree(tree, c.number)
        text, stat = diff_trees(previous, current)
        files[f"stage-{c.number:02d}.diff"] = text
        files[f"stage-{c.number:02d}.stat.json"] = json.dumps(stat, indent=2) + "\n"
        previous = current
    return files


def write_diffs(root, outdir, upto: int | None = None, tree: Tree | None = None):
    return sync_dir(Path(outdir) / "diffs", collect_diffs(tree or parse_tree(root), upto))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", default=".", help="repository root (holds chapters/)")
    parser.add_argument("--out", default="_build", help="output directory")
    parser.add_argument("--stage", type=int, help="only build stages up to this chapter")
    args = parser.parse_args(argv)
    try:
        tree = parse_tree(args.root)
        if args.stage is not None:
            _check_stage(tree, args.stage)
        out = Path(args.out)
        for c in tree.chapters:
            if args.stage is not None and c.number > args.stage:
                break
            stage_dir = out / "stages" / f"stage-{c.number:02d}"
            files = render_tree(tree, c.number)
            # Every snapshot explains itself to the vendor who copies it.
            files["README.md"] = stage_readme.render(tree.chapters, c.number, sorted(files))
            w, u, r = sync_dir(stage_dir, files)
            print(f"stage {c.number:02d} {c.slug}: {w} written, {u} unchanged, {r} removed")
        w, u, r = write_snippets(args.root, out, args.stage, tree)
        dw, du, dr = write_diffs(args.root, out, args.stage, tree)
        print(f"snippets: {w} written, {u} unchanged, {r} removed; "
              f"diffs: {dw} written, {du} unchanged, {dr} removed")
    except SplitError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
