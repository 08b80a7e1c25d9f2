"""The documentation holds together: README stays a few screens, every relative link between README, docs/ and
BENCHMARKS.md reaches an existing file (and heading, named as GitHub names headings), and README's file table names
every top-level Python file, so a new file without a line there fails."""

import re

from conftest import ROOT

README_MAX_LINES = 260
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def markdown_files():
    return [ROOT / "README.md", ROOT / "BENCHMARKS.md", *sorted((ROOT / "docs").rglob("*.md"))]


def outside_fences(text):
    """The lines of a markdown text that are not inside a fenced code block."""
    fenced = False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced:
            yield line


def anchors(path):
    """GitHub's heading ids in a markdown file: lower case, punctuation dropped, spaces to '-', repeats numbered."""
    seen, ids = {}, set()
    for line in outside_fences(path.read_text()):
        if m := re.match(r"#{1,6} (.*)", line):
            slug = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
            ids.add(f"{slug}-{seen[slug]}" if slug in seen else slug)
            seen[slug] = seen.get(slug, 0) + 1
    return ids


def test_readme_fits_a_few_screens():
    n = len((ROOT / "README.md").read_text().splitlines())
    assert n <= README_MAX_LINES, f"README.md has {n} lines (at most {README_MAX_LINES}): move the detail into docs/"


def test_relative_links_reach_a_file_and_heading():
    broken = []
    for md in markdown_files():
        for line in outside_fences(md.read_text()):
            for target in LINK.findall(re.sub(r"`[^`]*`", "", line)):  # a link inside inline code is code
                if re.match(r"[a-z]+:", target):  # https:, mailto:
                    continue
                path, _, anchor = target.partition("#")
                dest = (md.parent / path).resolve() if path else md
                where = f"{md.relative_to(ROOT)}: ({target})"
                if not dest.exists():
                    broken.append(f"{where}: no such file")
                elif anchor and (dest.is_dir() or anchor not in anchors(dest)):
                    broken.append(f"{where}: no heading #{anchor} in {dest.relative_to(ROOT)}")
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_readme_file_table_names_every_top_level_python_file():
    named = set()
    for line in outside_fences((ROOT / "README.md").read_text()):
        if line.startswith("|"):
            named.update(re.findall(r"`([^`]+)`", line.split("|")[1]))  # the first cell
    missing = sorted(p.name for p in ROOT.glob("*.py") if p.name not in named)
    assert not missing, f"README.md's file table has no line for {', '.join(missing)}"
