"""The project's own docs: the package cites docs/ pages (not notes outside the repository), and every page and
section it cites exists."""

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"
FOREIGN = re.compile(r"\.\./shared|ARCHITECTURE\.md|CPU-NOTES|ZERO3-EP|K3-FORMATS")
# "docs/architecture.md 2.1", "docs/architecture.md section 7", "docs/cpu.md"
CITATION = re.compile(r"docs/([A-Za-z0-9_.-]+?\.md)(?: (?:sections? )?(\d+(?:\.\d+)?)\b)?")
CITING = ("moe_plugin", "tests", "benchmarks", "scripts", "docs")


TEXT_SUFFIXES = (".py", ".md", ".cfg", ".sh", ".txt", ".json")


def _files(root: str):
    for path in sorted((REPO / root).rglob("*")):
        if path.is_file() and path.suffix in TEXT_SUFFIXES and "__pycache__" not in path.parts:
            yield path


def _citations():
    """(file, line number, page, section or None) for every docs/<page>.md citation."""
    citing = [p for root in CITING for p in _files(root)] + [REPO / "README.md", REPO / "setup.cfg"]
    for path in citing:
        if path == Path(__file__).resolve():
            continue
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            for match in CITATION.finditer(line):
                yield path.relative_to(REPO), number, match.group(1), match.group(2)


def test_the_package_cites_no_notes_outside_the_repository():
    found = [
        f"{p.relative_to(REPO)}:{n}: {line.strip()}"
        for p in _files("moe_plugin")
        for n, line in enumerate(p.read_text(errors="replace").splitlines(), 1)
        if FOREIGN.search(line)
    ]
    assert found == [], (
        "cite the docs/ page instead (docs/architecture.md, cpu.md, zero3-ep.md, k3-formats.md):\n" + "\n".join(found)
    )


def test_every_cited_page_and_section_exists():
    citations = list(_citations())
    pages = {page for _, _, page, _ in citations}
    assert {"architecture.md", "cpu.md"} <= pages, f"the regex must find the code's citations, found {pages}"
    missing = []
    for path, number, page, section in citations:
        target = DOCS / page
        if not target.is_file():
            missing.append(f"{path}:{number}: docs/{page} does not exist")
        elif section is not None:
            headings = re.findall(r"^#{2,3} (\d+(?:\.\d+)?)\.? ", target.read_text(), flags=re.M)
            if section not in headings:
                missing.append(f"{path}:{number}: docs/{page} has no section {section} (it has {headings})")
    assert missing == [], "\n".join(missing)
