"""The documentation stands on its own: every relative link in README.md and docs/*.md
resolves (file and anchor), every "docs/design.md §N" the code cites is a section of
that page, and no tracked file points outside the repository.

Pure file reading; no ranks, no imports of the package. The `file.py:function` names of
the docs (docs/architecture.md follows one step by them) are checked against the code,
parsed, not imported.
"""
import ast
import pathlib
import re
import subprocess

REPO = pathlib.Path(__file__).resolve().parents[2]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
OUTSIDE = "../" + "shared"   # spelled in two parts so that this file does not match itself

_FENCE = re.compile(r"^```.*?^```", re.S | re.M)
_CODE = re.compile(r"`[^`\n]*`")
_LINK = re.compile(r"\[[^\]\n]*\]\(([^)\s]+)\)")
_HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$", re.M)
_ID = re.compile(r"""<a\s+(?:id|name)=["']([^"']+)["']""")
_SECTION = re.compile(r"^#{2,6}\s+(§\d+(?:\.\d+)*)\s", re.M)
_CITED = re.compile(r"docs/design\.md (§\d+(?:\.\d+)*)")


def _prose(text: str) -> str:
    """Markdown without code blocks and code spans (a link there is an example)."""
    return _CODE.sub("", _FENCE.sub("", text))


def github_slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces to '-'."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "")
    text = "".join(c for c in text.lower() if c.isalnum() or c in " -_")
    return text.replace(" ", "-")


def anchors(path: pathlib.Path) -> set[str]:
    text = _FENCE.sub("", path.read_text())
    found, seen = set(_ID.findall(text)), {}
    for heading in _HEADING.findall(text):
        slug = github_slug(heading)
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        found.add(slug if n == 0 else f"{slug}-{n}")
    return found


def broken_links(page: pathlib.Path) -> list[str]:
    bad = []
    for target in _LINK.findall(_prose(page.read_text())):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):   # http:, https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        dest = (page.parent / file_part).resolve() if file_part else page
        where = f"{page.relative_to(REPO)}: ({target})"
        if not dest.exists():
            bad.append(f"{where}: {file_part} does not exist")
        elif REPO not in dest.parents and dest != REPO:
            bad.append(f"{where}: points outside the repository")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            bad.append(f"{where}: no anchor #{anchor} in {dest.relative_to(REPO)}")
    return bad


def _tracked_files() -> list[pathlib.Path]:
    out = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True)
    return [REPO / name for name in out.stdout.decode().split("\0") if name]


def test_every_relative_link_resolves():
    assert len(PAGES) > 5, f"expected README.md and the docs/ pages, found {PAGES}"
    bad = [b for page in PAGES for b in broken_links(page)]
    assert not bad, "broken links:\n" + "\n".join(bad)


def test_design_sections_cited_by_the_code_exist():
    sections = set(_SECTION.findall((REPO / "docs" / "design.md").read_text()))
    assert {"§1", "§2", "§3", "§4", "§5", "§6"} <= sections, sorted(sections)
    missing = []
    for path in _tracked_files():
        if path.suffix not in (".py", ".sh", ".md") or not path.is_file():
            continue
        for cited in _CITED.findall(path.read_text(errors="replace")):
            if cited not in sections:
                missing.append(f"{path.relative_to(REPO)} cites docs/design.md {cited}")
    assert not missing, ("sections docs/design.md does not have "
                         f"({sorted(sections)}):\n" + "\n".join(missing))


def test_no_tracked_file_points_outside_the_repository():
    hits = [str(p.relative_to(REPO)) for p in _tracked_files()
            if p.is_file() and OUTSIDE.encode() in p.read_bytes()]
    assert not hits, f"files that name {OUTSIDE}: {hits}"


def test_the_checks_see_a_broken_link_and_a_missing_anchor(tmp_path):
    page = tmp_path / "page.md"
    (tmp_path / "other.md").write_text("# Title\n\n## A `code` heading: yes\n<a id=\"s9\"></a>\n")
    page.write_text("[ok](other.md#a-code-heading-yes) [ok](other.md#s9) [ok](#here)\n\n"
                    "## Here\n\n[bad](missing.md) [bad](other.md#nowhere)\n"
                    "`[example](not-checked.md)`\n")
    global REPO
    saved, REPO = REPO, tmp_path
    try:
        bad = broken_links(page)
    finally:
        REPO = saved
    assert [b.split(": ", 1)[1] for b in bad] == [
        "(missing.md): missing.md does not exist",
        "(other.md#nowhere): no anchor #nowhere in other.md"], bad


_NAMED = re.compile(r"`((?:[\w/]+/)?\w+\.py):(\w+(?:\.\w+)*)`")


def _defined(tree, names: list[str]) -> bool:
    """Whether ``a.b.c`` is a function, class or assignment nested that way in the parsed module."""
    scope = tree.body
    for i, name in enumerate(names):
        found = None
        for node in scope:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == name:
                found = node
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                    found = node
        if found is None:
            return False
        scope = getattr(found, "body", [])
    return True


def missing_names(page: pathlib.Path, package: pathlib.Path) -> list[str]:
    """The `file.py:Name.attr` spans of ``page`` whose file (under ``package``, else under the
    repository root above it) or name does not exist."""
    bad = []
    for path, dotted in _NAMED.findall(_FENCE.sub("", page.read_text())):
        source = package / path
        if not source.is_file() and (package.parent / path).is_file():
            source = package.parent / path
        if not source.is_file():
            bad.append(f"{path}:{dotted}: no file {source.relative_to(package.parent)}")
        elif not _defined(ast.parse(source.read_text()), dotted.split(".")):
            bad.append(f"{path}:{dotted}: {dotted} is not defined in {path}")
    return bad


def test_file_function_names_in_the_docs_exist_in_the_code():
    named = _NAMED.findall((REPO / "docs" / "architecture.md").read_text())
    assert len(named) > 20, f"docs/architecture.md names only {len(named)} file:function places"
    bad = [f"{page.relative_to(REPO)}: {b}" for page in PAGES
           for b in missing_names(page, REPO / "megatron_lbp")]
    assert not bad, "the docs name what the code does not have:\n" + "\n".join(bad)


def test_the_name_check_sees_a_missing_file_and_a_missing_function(tmp_path):
    (tmp_path / "pkg" / "engine").mkdir(parents=True)
    (tmp_path / "pkg" / "engine" / "a.py").write_text("class A:\n    def run(self):\n        pass\nX = 1\n")
    page = tmp_path / "page.md"
    page.write_text("`engine/a.py:A.run` `engine/a.py:X` `engine/a.py:A.gone` `engine/b.py:f`\n")
    bad = missing_names(page, tmp_path / "pkg")
    assert [b.split(": ")[0] for b in bad] == ["engine/a.py:A.gone", "engine/b.py:f"], bad
