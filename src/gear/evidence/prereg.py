"""The pre-registration record: a study's rule counts as fixed before its results only if git
says so. The rule's first commit must be a strict ancestor of the first commit of the results it
governs (an earlier commit on the same history; the same commit does not precede).

    record = preregistered("docs/evidence/lm_recipe.md", "studies/results/lm_recipe.json")
    record["precedes"]   # True: the rule was committed before any result

A file's first commit follows renames (`git log --follow`), so moving a rule or a result keeps
its date. With `rule_text`, the rule's commit is the first one whose version of the rule file
contains that text (`git log -S`): a rule written as one section of a longer file. A rule
copied out of one file into another (not a git rename) is dated at the file it was written in.
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterable
from pathlib import Path
from typing import Any


def git(repo: str | Path, *args: str, check: bool = False) -> subprocess.CompletedProcess[str]:
    """`git -C repo args`, its output captured as text: the one way gear and its studies ask
    git. With `check`, a failure raises, naming the command and git's message."""
    out = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True)
    if check and out.returncode != 0:
        raise RuntimeError(f"git {' '.join(args)} failed in {repo}: {out.stderr.strip()}")
    return out


def head_commit(repo: str | Path = ".") -> str:
    """The full hash of `repo`'s HEAD, the commit a run records ('' outside a git repository)."""
    return git(repo, "rev-parse", "HEAD").stdout.strip()


def uncommitted(repo: str | Path, paths: Iterable[str | Path]) -> str:
    """`git status --porcelain` of `paths` in `repo`: '' when every change to them is committed
    (a run records HEAD, not the tree, so a study refuses to run on uncommitted code)."""
    return git(repo, "status", "--porcelain", "--", *map(str, paths)).stdout.strip()


def first_commit(path: str | Path, repo: str | Path = ".", text: str | None = None) -> str | None:
    """The first commit (full hash) that added `path` (followed across renames) or, with `text`,
    the first commit whose version of `path` contains `text`; None if there is none (the file
    or the text is not committed)."""
    # newest first, the oldest last (--reverse would not follow renames)
    args = ["log", "--format=%H", "--follow", *([f"-S{text}"] if text is not None else [])]
    out = git(Path(repo), *args, "--", str(path))
    if out.returncode != 0:
        raise RuntimeError(f"first_commit: git log failed in {repo}: {out.stderr.strip()}")
    commits = out.stdout.split()
    return commits[-1] if commits else None


def preregistered(
    rule: str | Path, results: str | Path, repo: str | Path = ".", rule_text: str | None = None
) -> dict[str, Any]:
    """Whether the rule in `rule` was committed before the results in `results` (paths relative
    to `repo`). Returns {"rule", "rule_commit", "results", "results_commit", "precedes"}:
    `precedes` is True only when both are committed and the rule's commit is a strict ancestor
    of the results' first commit."""
    repo = Path(repo)
    rule_commit = first_commit(rule, repo, rule_text)
    results_commit = first_commit(results, repo)
    precedes = (
        rule_commit is not None
        and results_commit is not None
        and rule_commit != results_commit
        and git(repo, "merge-base", "--is-ancestor", rule_commit, results_commit).returncode == 0
    )
    return {
        "rule": str(rule),
        "rule_commit": rule_commit,
        "results": str(results),
        "results_commit": results_commit,
        "precedes": precedes,
    }
