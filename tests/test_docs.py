"""The docs point at things that exist: every relative link in README.md and docs/*.md names a file or
folder from the page's own folder (and a heading, where it names one), every `path.py:line` citation a
line within its file, and every repository path quoted in code (`gapless/...`, `tests/...`, `bench/...`,
`docs/...`) a file or folder that is there. A page that moves, a module that is split or a file that is
renamed shows up here, by page and line, instead of in a reader's dead end.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

FENCE = re.compile(r"^\s*(```|~~~)")
INLINE_CODE = re.compile(r"`([^`\n]+)`")
LINK = re.compile(r"!?\[[^\]\n]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
CITED_SUFFIXES = "py|sh|md|toml|cfg|txt|log|json|yaml|yml"
CITATION = re.compile(rf"(?<![\w./-])((?:[\w.-]+/)*[\w.-]+\.(?:{CITED_SUFFIXES})):(\d+)(?:-(\d+))?")
PATH_PREFIXES = ("gapless/", "tests/", "bench/", "docs/", ".ci/")
EXTERNAL = ("http://", "https://", "mailto:", "ftp://")


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: its text without markup, lower case, punctuation dropped, spaces to
    dashes."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "")
    text = re.sub(r"[^\w\- ]", "", text.strip().lower())
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """Every heading anchor of a Markdown page (a repeated heading gets -1, -2, ... as on GitHub)."""
    seen: dict[str, int] = {}
    out = set()
    for line in _prose_lines(page.read_text()):
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line[1])
        if not m:
            continue
        base = slug(m.group(1))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def _prose_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) outside fenced code blocks."""
    out, fenced = [], False
    for number, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            out.append((number, line))
    return out


def _code_lines(text: str) -> list[tuple[int, str]]:
    """(line number, code) for every fenced code line and every inline code span."""
    out, fenced = [], False
    for number, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if fenced:
            out.append((number, line))
        else:
            out.extend((number, span) for span in INLINE_CODE.findall(line))
    return out


def _resolve(target: str, page: Path, root: Path) -> Path | None:
    """The file a citation names: from the repository's root (the docs' convention), else the page's
    folder."""
    for base in (root, page.parent):
        path = (base / target).resolve()
        if path.exists():
            return path
    return None


def _check_link(target: str, page: Path, root: Path) -> str | None:
    if target.startswith(EXTERNAL):
        return None
    path_part, _, fragment = target.partition("#")
    if not path_part:
        path = page
    else:
        path = (page.parent / path_part).resolve()  # as a Markdown viewer resolves it
        if not path.exists():
            return f"link to {target}: no such file"
    if fragment and path.suffix == ".md" and fragment not in anchors(path):
        return f"link to {target}: {path.name} has no heading #{fragment}"
    return None


def _check_citation(file: str, first: int, last: int, page: Path, root: Path) -> str | None:
    path = _resolve(file, page, root)
    if path is None or not path.is_file():
        return f"citation {file}:{first}: no such file"
    lines = len(path.read_text(errors="replace").splitlines())
    if not 1 <= first <= last <= lines:
        return f"citation {file}:{first}{'' if last == first else f'-{last}'}: {file} has {lines} lines"
    return None


def _quoted_paths(code: str) -> list[str]:
    """Repository paths a piece of code names: words that start with a top folder of the repository."""
    out = []
    for word in code.split():
        word = word.split("=", 1)[-1].strip("\"'(),;")
        word = re.sub(r"(::[\w\[\]-]+|:\d+(-\d+)?)$", "", word).rstrip(".:")
        if word.startswith(PATH_PREFIXES) and not re.search(r"[<>${}]", word):
            out.append(word)
    return out


def _exists(path: str, root: Path) -> bool:
    return any(root.glob(path.rstrip("/"))) if "*" in path else (root / path).exists()


def problems(page: Path, root: Path = ROOT) -> list[str]:
    """What in `page` points at nothing, as `page:line: what`."""
    text = page.read_text()
    name = page.relative_to(root) if page.is_relative_to(root) else page.name
    found = []
    for number, line in _prose_lines(text):
        for target in LINK.findall(INLINE_CODE.sub("", line)):
            if (why := _check_link(target, page, root)) is not None:
                found.append(f"{name}:{number}: {why}")
    for number, line in enumerate(text.splitlines(), 1):
        for file, first, last in CITATION.findall(line):
            why = _check_citation(file, int(first), int(last or first), page, root)
            if why is not None:
                found.append(f"{name}:{number}: {why}")
    for number, code in _code_lines(text):
        for path in _quoted_paths(code):
            if not _exists(path, root):
                found.append(f"{name}:{number}: `{path}`: no such file or folder")
    return found


def test_the_pages_are_there():
    assert (ROOT / "README.md").is_file()
    assert {p.name for p in PAGES} >= {"design.md", "serving.md", "models.md", "sampling.md", "scaling.md"}


def test_every_link_citation_and_quoted_path_resolves():
    found = [p for page in PAGES for p in problems(page)]
    assert not found, "the docs point at what is not there:\n" + "\n".join(found)


def test_the_readme_stays_short():
    lines = len((ROOT / "README.md").read_text().splitlines())
    assert lines < 250, f"README.md has {lines} lines: move reference material to docs/"


def _sample(tmp_path: Path, page: str) -> list[str]:
    (tmp_path / "docs").mkdir()
    (tmp_path / "gapless").mkdir()
    (tmp_path / "gapless" / "mod.py").write_text("a = 1\nb = 2\nc = 3\n")
    (tmp_path / "docs" / "other.md").write_text("# Other page\n\n## A `code` heading, with punctuation!\n")
    (tmp_path / "docs" / "page.md").write_text(page)
    return problems(tmp_path / "docs" / "page.md", root=tmp_path)


def test_the_checker_passes_what_resolves(tmp_path):
    page = """# Page
[other](other.md), [its heading](other.md#a-code-heading-with-punctuation), [here](#page), ![img](../docs),
[the module](../gapless/mod.py), `gapless/mod.py:3`, gapless/mod.py:1-2, `gapless/`, [web](https://x.org/a)
```bash
python gapless/mod.py   # a fenced [link](nowhere.md) is code, not a link
```
`[not a link](nowhere.md)`
"""
    assert _sample(tmp_path, page) == []


def test_the_checker_finds_what_is_broken(tmp_path):
    page = """# Page
[gone](gone.md), [from the root, not the page](gapless/mod.py), [a bad heading](other.md#no-such-heading)
[a bad anchor](#nowhere)
gapless/mod.py:4 is past the end; `gapless/mod.py:2-9` too; gapless/missing.py:1 names no file
```bash
python gapless/missing_too.py
```
`tests/gone/` and `OUT=bench/results/absent`
"""
    found = _sample(tmp_path, page)
    expected = [
        "docs/page.md:2: link to gone.md: no such file",
        "docs/page.md:2: link to gapless/mod.py: no such file",
        "docs/page.md:2: link to other.md#no-such-heading: other.md has no heading #no-such-heading",
        "docs/page.md:3: link to #nowhere: page.md has no heading #nowhere",
        "docs/page.md:4: citation gapless/mod.py:4: gapless/mod.py has 3 lines",
        "docs/page.md:4: citation gapless/mod.py:2-9: gapless/mod.py has 3 lines",
        "docs/page.md:4: citation gapless/missing.py:1: no such file",
        "docs/page.md:6: `gapless/missing_too.py`: no such file or folder",
        "docs/page.md:8: `tests/gone/`: no such file or folder",
        "docs/page.md:8: `bench/results/absent`: no such file or folder",
    ]
    assert sorted(found) == sorted(expected)


def test_slugs_follow_github():
    assert slug("Offline (`LLM`)") == "offline-llm"
    assert slug("Served vs offline") == "served-vs-offline"
    assert slug("Serving on a CPU, and llama.cpp beside it") == "serving-on-a-cpu-and-llamacpp-beside-it"
    assert slug("From `POST /v1/chat/completions` to the sampled token") == (
        "from-post-v1chatcompletions-to-the-sampled-token"
    )
