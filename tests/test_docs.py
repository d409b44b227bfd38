"""The documentation holds together: every relative link in the repository's Markdown points at a
file that exists and, for a Markdown file, at a heading it has (GitHub's anchors); the README's
first screen has the setup, the main job and the test command (issue 50)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LINK = re.compile(r"\]\(([^)\s]+)\)")


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    in_code = False
    for line in path.read_text().split("\n"):
        in_code ^= line.startswith("```")
        if not in_code and (m := re.match(r"^#{1,6} (.*)", line)):
            a = slug(m.group(1))
            out.add(a if a not in seen else f"{a}-{seen[a]}")
            seen[a] = seen.get(a, 0) + 1
    return out


def markdown_files() -> list[Path]:
    out = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard", "*.md"],
        cwd=ROOT, capture_output=True, text=True,
    )  # fmt: skip
    if out.returncode != 0:
        pytest.skip("not a git checkout")
    # results files are records of their run, written by code at the time: not documentation
    return [ROOT / f for f in out.stdout.split() if "/results/" not in f]


def broken_links(path: Path) -> list[str]:
    bad, in_code = [], False
    for i, line in enumerate(path.read_text().split("\n"), 1):
        in_code ^= line.startswith("```")
        if in_code:
            continue
        for target in LINK.findall(line):
            if target.startswith(("http://", "https://", "mailto:")):
                continue
            file, _, anchor = target.partition("#")
            dest = (path.parent / file) if file else path
            if not dest.exists():
                bad.append(f"{path.relative_to(ROOT)}:{i}: no file {target}")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                bad.append(f"{path.relative_to(ROOT)}:{i}: no heading #{anchor} in {file or 'it'}")
    return bad


def test_slug_is_githubs():
    assert slug("GEAR at one forward's cost (issue 48)") == "gear-at-one-forwards-cost-issue-48"
    assert slug("Signals: reverse KL + entropy (`benchmarks/signals.py`)") == (
        "signals-reverse-kl--entropy-benchmarkssignalspy"
    )


def test_the_checker_sees_a_broken_link(tmp_path, monkeypatch):
    monkeypatch.setattr(__import__(__name__), "ROOT", tmp_path)
    (tmp_path / "a.md").write_text("# Title\n[ok](#title) [gone](b.md) [no](a.md#nowhere)\n")
    assert len(broken_links(tmp_path / "a.md")) == 2


def test_every_relative_link_resolves():
    bad = [b for f in markdown_files() for b in broken_links(f)]
    assert not bad, "\n".join(bad)


def test_readme_first_screen():
    lines = (ROOT / "README.md").read_text().split("\n")
    assert len(lines) <= 150, f"README.md has {len(lines)} lines"
    head = "\n".join(lines[:40])
    for command in ("bash scripts/setup.sh", ".venv/bin/gear train", "python -m pytest -q"):
        assert command in head, f"README's first 40 lines lack {command!r}"


def test_benchmarks_has_no_study_sections():
    """BENCHMARKS.md is speed and memory: no section names a study script."""
    text = (ROOT / "BENCHMARKS.md").read_text()
    sections = [h for h in re.findall(r"^## (.*)", text, flags=re.M) if "studies" in h]
    assert not sections, sections
