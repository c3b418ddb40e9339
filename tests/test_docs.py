"""The documentation's links resolve and its complete scripts are run by a test.

The convention, for README.md, docs/*.md and the examples' Markdown files, whatever they say:

* **Links.** Every relative link or image (``[text](path)``, ``![alt](path)``, ``[ref]: path``,
  ``<a href="path">``, ``<img src="path">``) outside code resolves to a file or directory, relative
  to the Markdown file. A ``#anchor`` (alone or after a ``.md`` path) names a heading of that
  Markdown file, by GitHub's rule (lower case; punctuation other than ``-`` and ``_`` dropped;
  spaces become ``-``; repeats get ``-1``, ``-2``). Absolute URLs are not fetched.
* **Python blocks.** A fenced block tagged ``python`` (or ``py``, ``python3``) is a *complete
  script* when it has an ``import`` or ``from ... import`` line and no ``...``. Blocks without an
  import, or with ``...`` standing for the reader's code, are fragments and need nothing. The last
  non-blank line before a complete script's opening fence must be one of:

  - ``<!-- example: PATH -->``: PATH (from the repository root) contains the block verbatim (after
    removing the block's common indentation and trailing spaces), and a test runs PATH: some file
    under ``tests/`` names it;
  - ``<!-- not runnable: REASON -->``, with the reason.

  A marker that is not followed by a Python block is stale and fails too.
"""

from __future__ import annotations

import pathlib
import re
import textwrap
from dataclasses import dataclass

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def doc_files() -> list[pathlib.Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "examples").rglob("*.md"))]


def doc_ids() -> list[str]:
    return [str(p.relative_to(ROOT)) for p in doc_files()]


# ------------------------------------------------------------------ parsing
FENCE = re.compile(r"^( {0,3})(`{3,}|~{3,})\s*([\w+-]*)")
MARKER = re.compile(r"^<!--\s*(example|not runnable):\s*(.*?)\s*-->\s*$")
INLINE_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+[\"'(][^)]*)?\)")
REFERENCE_LINK = re.compile(r"^ {0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$")
HTML_LINK = re.compile(r"<(?:a|img)\b[^>]*?\b(?:href|src)\s*=\s*[\"']([^\"']+)[\"']", re.IGNORECASE)
CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1")
HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
PYTHON_TAGS = {"python", "py", "python3"}


@dataclass
class Block:
    lang: str
    text: str
    line: int                   # 1-based line of the opening fence
    marker: tuple[str, str] | None


@dataclass
class Doc:
    path: pathlib.Path
    prose: list[tuple[int, str]]  # (line number, text) outside fenced blocks, code spans removed
    headings: list[str]           # heading texts as written (code spans kept: GitHub's anchors keep their text)
    blocks: list[Block]
    markers: list[tuple[int, str, str]]


def parse(path: pathlib.Path) -> Doc:
    lines = path.read_text(encoding="utf-8").splitlines()
    prose, blocks, markers, headings = [], [], [], []
    i = 0
    last_nonblank: tuple[int, str] | None = None
    while i < len(lines):
        line = lines[i]
        fence = FENCE.match(line)
        if fence:
            indent, ticks, lang = fence.groups()
            body, j = [], i + 1
            while j < len(lines) and not re.match(rf"^ {{0,3}}{ticks[0]}{{{len(ticks)},}}\s*$", lines[j]):
                body.append(lines[j][len(indent):] if lines[j].startswith(indent) else lines[j].lstrip())
                j += 1
            marker = None
            if last_nonblank is not None and MARKER.match(last_nonblank[1].strip()):
                kind, value = MARKER.match(last_nonblank[1].strip()).groups()
                marker = (kind, value)
            blocks.append(Block(lang.lower(), "\n".join(body), i + 1, marker))
            last_nonblank = (i + 1, "```")
            i = j + 1
            continue
        match = MARKER.match(line.strip())
        if match:
            markers.append((i + 1, *match.groups()))
        prose.append((i + 1, CODE_SPAN.sub("", line)))
        if heading := HEADING.match(line):
            headings.append(heading.group(2))
        if line.strip():
            last_nonblank = (i + 1, line)
        i += 1
    return Doc(path=path, prose=prose, headings=headings, blocks=blocks, markers=markers)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text
    text = text.replace("`", "").replace("*", "").lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: pathlib.Path) -> set[str]:
    seen: dict[str, int] = {}
    result = set()
    for heading in parse(path).headings:
        base = slug(heading)
        count = seen.get(base, 0)
        seen[base] = count + 1
        result.add(base if count == 0 else f"{base}-{count}")
    return result


def links(doc: Doc) -> list[tuple[int, str]]:
    found = []
    for number, line in doc.prose:
        for pattern in (INLINE_LINK, REFERENCE_LINK, HTML_LINK):
            found += [(number, target) for target in pattern.findall(line)]
    return found


def shown(path: pathlib.Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def link_problem(doc_path: pathlib.Path, target: str) -> str | None:
    """Why a link target of ``doc_path`` does not resolve, or None."""
    if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target) or target.startswith("//"):
        return None  # http:, https:, mailto: ...: not fetched
    path_part, _, anchor = target.partition("#")
    resolved = (doc_path.parent / path_part).resolve() if path_part else doc_path
    if path_part and not resolved.exists():
        return f"{path_part} does not exist (relative to {shown(doc_path)})"
    if anchor and resolved.suffix == ".md" and resolved.is_file() and anchor not in anchors(resolved):
        return f"#{anchor} is no heading of {shown(resolved)}"
    return None


def is_complete_script(block: Block) -> bool:
    return block.lang in PYTHON_TAGS and "..." not in block.text and bool(
        re.search(r"^\s*(import\s+\w|from\s+[\w.]+\s+import\s)", block.text, re.MULTILINE))


def block_problem(block: Block) -> str | None:
    """Why a complete script is neither run by a test nor marked not runnable, or None."""
    if not is_complete_script(block):
        return None
    if block.marker is None:
        return ("a complete Python script without a marker: put <!-- example: PATH --> (a file a test runs that "
                "contains it) or <!-- not runnable: REASON --> on the line above its fence")
    kind, value = block.marker
    if kind == "not runnable":
        return None if value else "<!-- not runnable: --> needs a reason"
    source = ROOT / value
    if not source.is_file():
        return f"<!-- example: {value} -->: no such file"
    wanted = textwrap.dedent(block.text).strip("\n")
    have = "\n".join(line.rstrip() for line in source.read_text(encoding="utf-8").splitlines())
    if "\n".join(line.rstrip() for line in wanted.splitlines()) not in have:
        return f"<!-- example: {value} -->: the block is not in that file verbatim"
    if not any(value in test.read_text(encoding="utf-8") for test in (ROOT / "tests").rglob("*.py")):
        return f"<!-- example: {value} -->: no test under tests/ runs it (names it)"
    return None


# ------------------------------------------------------------------ the checks
@pytest.mark.parametrize("doc_path", doc_files(), ids=doc_ids())
def test_relative_links_and_anchors_resolve(doc_path):
    doc = parse(doc_path)
    problems = [f"line {n}: {problem}" for n, target in links(doc) if (problem := link_problem(doc_path, target))]
    assert problems == [], "\n".join(problems)


@pytest.mark.parametrize("doc_path", doc_files(), ids=doc_ids())
def test_complete_python_scripts_are_run_by_a_test_or_marked_not_runnable(doc_path):
    doc = parse(doc_path)
    problems = [f"line {b.line}: {problem}" for b in doc.blocks if (problem := block_problem(b))]
    used = {b.line for b in doc.blocks if b.marker is not None and b.lang in PYTHON_TAGS}
    for number, kind, value in doc.markers:
        following = [b for b in doc.blocks if b.line > number]
        if not following or following[0].line not in used:
            problems.append(f"line {number}: <!-- {kind}: {value} --> is not right above a Python block (stale?)")
    assert problems == [], "\n".join(problems)


# ------------------------------------------------------------------ the checks can fail
def write(tmp_path, text: str) -> pathlib.Path:
    path = tmp_path / "doc.md"
    path.write_text(textwrap.dedent(text))
    return path


def test_parser_finds_links_outside_code_only(tmp_path):
    path = write(tmp_path, """\
        # Title
        See [a](a.md), ![img](pic.png "title") and <img src="x/y.png"> and `[not](code.md)`.
        [ref]: ref.md
        ```python
        [not](in_block.md)
        ```
        """)
    assert sorted(t for _, t in links(parse(path))) == ["a.md", "pic.png", "ref.md", "x/y.png"]


@pytest.mark.parametrize("heading, expected", [
    ("API (`import elastic_ring as er`)", "api-import-elastic_ring-as-er"),
    ("Set-up and first run (CPU machine, about five minutes)", "set-up-and-first-run-cpu-machine-about-five-minutes"),
    ("Training state (`state`): commit, restore, sync", "training-state-state-commit-restore-sync"),
    ("Before the first `ray up`", "before-the-first-ray-up"),
    ("**Bold** and [a link](x.md)", "bold-and-a-link"),
])
def test_slug_table(heading, expected):
    assert slug(heading) == expected


def test_link_problems_are_found(tmp_path):
    (tmp_path / "other.md").write_text("# Other page\n## Other page\n### Steps: `python -m x.step`\n")
    doc = write(tmp_path, "# Here\n")
    assert link_problem(doc, "other.md#other-page-1") is None
    assert link_problem(doc, "other.md#steps-python--m-xstep") is None  # a code span's text is in the anchor
    assert link_problem(doc, "#here") is None
    assert link_problem(doc, "https://example.com/missing") is None
    assert "missing.md does not exist" in link_problem(doc, "missing.md")
    assert "#nowhere is no heading of" in link_problem(doc, "other.md#nowhere")
    assert "#elsewhere is no heading of" in link_problem(doc, "#elsewhere")


def test_block_rules(tmp_path):
    def block(text, marker=None, lang="python"):
        return Block(lang, textwrap.dedent(text), 1, marker)

    script = "import torch\nprint(torch.ones(1))\n"
    assert block_problem(block("x = 1\n")) is None                          # no import: a fragment
    assert block_problem(block("import torch\nmodel = ...\n")) is None      # ... : a fragment
    assert block_problem(block(script, lang="bash")) is None
    assert "without a marker" in block_problem(block(script))
    assert block_problem(block(script, ("not runnable", "needs a GPU cluster"))) is None
    assert "needs a reason" in block_problem(block(script, ("not runnable", "")))
    assert "no such file" in block_problem(block(script, ("example", "examples/nope.py")))
    assert "not in that file verbatim" in block_problem(block(script, ("example", "examples/quickstart.py")))
    quickstart = (ROOT / "examples/quickstart.py").read_text().splitlines()
    excerpt = "\n".join(quickstart[:30])  # quickstart.py's opening lines, imports included
    assert block_problem(block(excerpt, ("example", "examples/quickstart.py"))) is None


def test_markers_are_read_from_the_line_above_the_fence(tmp_path):
    path = write(tmp_path, """\
        <!-- not runnable: needs a cluster -->
        ```python
        import ray
        ```

        <!-- example: examples/quickstart.py -->

        Some text in between.

        ```python
        import torch
        ```
        """)
    doc = parse(path)
    assert [b.marker for b in doc.blocks] == [("not runnable", "needs a cluster"), None]
    assert [(n, k) for n, k, _ in doc.markers] == [(1, "not runnable"), (6, "example")]
