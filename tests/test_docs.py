"""The front door: README.md stays short and names its two commands, every relative link of the
README, docs/ and examples/ leads to a file (and heading) that exists, and the flag list of
docs/usage.md is what `python -m fairseq_rope` prints."""

import contextlib
import io
import re
import unicodedata

import pytest
from support.commands import REPO

README_LIMIT = 12_000
PAGES = sorted([REPO / "README.md", *(REPO / "docs").glob("*.md"), *(REPO / "examples").rglob("*.md")])
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)


def prose(markdown):
    """The text outside fenced and inline code, where a bracket is not a link."""
    return re.sub(r"`[^`\n]*`", "", FENCE.sub("", markdown))


def heading_anchors(markdown):
    """The anchors GitHub gives a page's headings: lower case, punctuation dropped, spaces as
    hyphens, a repeated anchor numbered -1, -2, ..."""
    anchors, seen = set(), {}
    for heading in re.findall(r"^#{1,6} +(.+?) *#*$", FENCE.sub("", markdown), re.M):
        text = re.sub(r"[`*]|\[([^\]]*)\]\([^)]*\)", lambda m: m.group(1) or "", heading).strip().lower()
        slug = "".join(c for c in text if c in " -_" or unicodedata.category(c)[0] in "LN").replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        anchors.add(slug if count == 0 else f"{slug}-{count}")
    return anchors


def relative_links(page):
    return [target for target in LINK.findall(prose(page.read_text(encoding="utf-8")))
            if not re.match(r"[a-z][a-z0-9+.-]*:", target)]  # http:, https:, mailto: ...


def test_the_readme_is_short_and_its_two_commands_are_make_demo_and_make_test():
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    assert len(readme) <= README_LIMIT, f"README.md has {len(readme)} characters: move depth to docs/"
    two_commands = readme.split("## Two commands", 1)[1].split("\n## ", 1)[0]
    assert re.findall(r"^make (\w+)", two_commands, re.M) == ["demo", "test"]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_resolves(page):
    broken = []
    for target in relative_links(page):
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        if not resolved.exists():
            broken.append(f"{target}: no such file")
        elif anchor and resolved.suffix == ".md" and anchor not in heading_anchors(resolved.read_text(encoding="utf-8")):
            broken.append(f"{target}: no heading with that anchor in {resolved.relative_to(REPO)}")
    assert not broken, f"{page.relative_to(REPO)}: " + "; ".join(broken)


def test_the_link_check_finds_what_is_broken(tmp_path):
    page = tmp_path / "page.md"
    (tmp_path / "other.md").write_text("# Other page\n\n## Length extrapolation: `--rope-scaling`\n## Shaw: `transformer_rpe`\n"
                                       "## Other page\n")
    page.write_text("[a](other.md#length-extrapolation---rope-scaling) [b](other.md#nope) [c](missing.md)\n"
                    "`[d](in-code.md)` [e](https://example.org/x)\n```\n[f](in-fence.md)\n```\n")
    assert relative_links(page) == ["other.md#length-extrapolation---rope-scaling", "other.md#nope", "missing.md"]
    assert heading_anchors((tmp_path / "other.md").read_text()) == \
        {"other-page", "length-extrapolation---rope-scaling", "shaw-transformer_rpe", "other-page-1"}


def test_the_usage_page_lists_the_flags_python_m_fairseq_rope_prints():
    from fairseq_rope.__main__ import main

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        main()
    usage = (REPO / "docs" / "usage.md").read_text(encoding="utf-8")
    documented = re.search(r"<!-- python -m fairseq_rope -->\n```\n(.*?)```", usage, re.S)
    assert documented, "docs/usage.md lost its `python -m fairseq_rope` block"
    assert documented.group(1) == printed.getvalue(), \
        "docs/usage.md's flag list differs from `python -m fairseq_rope`: paste the command's output there"


def test_every_test_file_the_docs_and_code_name_exists():
    """tests/ is shaped like the code: a page or a docstring naming a test file names it where it is."""
    named = set()
    for path in [*PAGES, *sorted((REPO / "fairseq_rope").rglob("*.py")), *sorted((REPO / "fairseq_rope_tools").rglob("*.py")),
                 *sorted((REPO / "tests").rglob("*.py")), REPO / "scripts" / "setup_env.sh"]:
        named.update(re.findall(r"\btests/[\w/]+\.py\b", path.read_text(encoding="utf-8")))
    assert named and sorted(name for name in named if not (REPO / name).is_file()) == []
