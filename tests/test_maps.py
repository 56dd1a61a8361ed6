"""The maps of the code are true: ``spear/kernels/__init__.py`` names every module of the package, one
line each, and every file (``*.py``, ``*.md``) or BENCHMARKS.md section that a comment or docstring
in spear/ cites exists. A stale citation (``serve/layers.py`` after the layers moved, a section
renamed) sends a reader to nothing."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCES = sorted((ROOT / "spear").rglob("*.py"))
FILE = re.compile(r"(?<![\w./-])((?:[\w-]+/)*[\w-]+\.(?:py|md))\b")
SECTION = re.compile(r'BENCHMARKS(?:\.md)?,?\s*\(?\s*"([^"]+)"')
# cited names that are no file of this repository, and why
ELSEWHERE = {"SPEAR.md": "the project's design notes, kept beside the repository",
             "name.md": "a placeholder: spear.eval.report writes <name>.md"}


def _prose(path: Path) -> str:
    """The file's text with comment markers gone and its lines joined, so a citation that wraps
    over two comment lines reads whole."""
    return " ".join(re.sub(r"^\s*#\s?", "", line).strip() for line in path.read_text().splitlines())


def _repo_files() -> list[str]:
    skip = (".venv", ".git", "node_modules")
    return ["/" + p.relative_to(ROOT).as_posix() for p in ROOT.rglob("*") if p.is_file()
            and not any(part.startswith(skip) for part in p.relative_to(ROOT).parts)]


def test_the_kernels_package_names_every_module_once():
    doc = (ROOT / "spear" / "kernels" / "__init__.py").read_text()
    named = re.findall(r"^(\w+\.py)\s+\S", doc, re.M)
    modules = sorted(p.name for p in (ROOT / "spear" / "kernels").glob("*.py") if p.name != "__init__.py")
    assert sorted(named) == modules and len(named) == len(set(named))


def test_every_cited_file_exists():
    files = _repo_files()
    missing = []
    for src in SOURCES:
        for cited in set(FILE.findall(_prose(src))):
            if cited not in ELSEWHERE and not any(f.endswith("/" + cited) for f in files):
                missing.append(f"{src.relative_to(ROOT)}: {cited}")
    assert not missing, "cited files that do not exist:\n" + "\n".join(sorted(missing))


def test_every_cited_benchmarks_section_exists():
    headings = [re.sub(r"^#+\s*", "", line) for line in (ROOT / "BENCHMARKS.md").read_text().splitlines()
                if line.startswith("#")]
    missing = []
    for src in SOURCES:
        for cited in set(SECTION.findall(_prose(src))):
            if not any(h.startswith(cited) for h in headings):
                missing.append(f"{src.relative_to(ROOT)}: {cited!r}")
    assert not missing, "cited BENCHMARKS.md sections that do not exist:\n" + "\n".join(sorted(missing))
