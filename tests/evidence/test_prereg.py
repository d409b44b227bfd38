"""gear.evidence's pre-registration record, on a git repository built here: a rule counts as
fixed before its results only when its first commit is a strict ancestor of theirs."""

from __future__ import annotations

import subprocess

import pytest

from gear import evidence
from gear.evidence import first_commit, preregistered


def git(repo, *args: str) -> str:
    env = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t", "HOME": str(repo), "GIT_CONFIG_NOSYSTEM": "1"}  # fmt: skip
    out = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def commit(repo, files: dict[str, str], message: str) -> str:
    for name, text in files.items():
        (repo / name).parent.mkdir(parents=True, exist_ok=True)
        (repo / name).write_text(text)
        git(repo, "add", name)
    git(repo, "commit", "-q", "-m", message)
    return git(repo, "rev-parse", "HEAD")


@pytest.fixture
def repo(tmp_path):
    git(tmp_path, "init", "-q", "-b", "main")
    return tmp_path


def test_a_rule_committed_before_its_results_precedes_them(repo):
    c0 = commit(repo, {"README.md": "x\n"}, "start")
    rule = commit(repo, {"rule.md": "gate: lower bound > 0\n"}, "the rule")
    results = commit(repo, {"results.json": "{}\n"}, "the results")
    commit(repo, {"results.json": '{"n": 2}\n', "rule.md": "gate: edited later\n"}, "more")
    rec = preregistered("rule.md", "results.json", repo)
    assert rec == {"rule": "rule.md", "rule_commit": rule, "results": "results.json",
                   "results_commit": results, "precedes": True}  # fmt: skip
    assert first_commit("README.md", repo) == c0


def test_a_rule_written_with_or_after_its_results_does_not_precede(repo):
    both = commit(repo, {"rule.md": "r\n", "results.json": "{}\n"}, "together")
    same = preregistered("rule.md", "results.json", repo)
    assert same["rule_commit"] == same["results_commit"] == both and not same["precedes"]
    commit(repo, {"late_rule.md": "r\n"}, "the rule, after")
    assert not preregistered("late_rule.md", "results.json", repo)["precedes"]
    # uncommitted: no commit, never a pre-registration
    (repo / "draft.md").write_text("r\n")
    rec = preregistered("draft.md", "results.json", repo)
    assert rec["rule_commit"] is None and not rec["precedes"]


def test_a_rule_on_another_branch_does_not_precede(repo):
    commit(repo, {"README.md": "x\n"}, "start")
    git(repo, "checkout", "-q", "-b", "side")
    commit(repo, {"rule.md": "r\n"}, "rule on a side branch")
    git(repo, "checkout", "-q", "main")
    commit(repo, {"results.json": "{}\n"}, "results on main")
    git(repo, "merge", "-q", "--no-edit", "side")
    rec = preregistered("rule.md", "results.json", repo)
    assert rec["rule_commit"] and rec["results_commit"] and not rec["precedes"]


def test_a_moved_rule_keeps_its_date_and_a_section_is_found_by_its_text(repo):
    commit(repo, {"BENCHMARKS.md": "# results\n"}, "start")
    rule = commit(repo, {"BENCHMARKS.md": "# results\n## Rule\ngate: lower bound > 0\n"}, "rule")
    results = commit(repo, {"results.json": "{}\n"}, "results")
    git(repo, "mv", "BENCHMARKS.md", "docs_rule.md")
    git(repo, "commit", "-q", "-m", "move")
    rec = preregistered("docs_rule.md", "results.json", repo, rule_text="gate: lower bound > 0")
    assert (rec["rule_commit"], rec["results_commit"], rec["precedes"]) == (rule, results, True)
    assert first_commit("docs_rule.md", repo) != rule  # the file itself is older than the rule
    assert first_commit("docs_rule.md", repo, text="never written") is None


def test_the_git_helpers_record_head_and_see_uncommitted_code(repo):
    c0 = commit(repo, {"src/a.py": "x = 1\n", "notes.md": "n\n"}, "start")
    assert evidence.head_commit(repo) == c0
    assert evidence.uncommitted(repo, ["src"]) == ""
    (repo / "src" / "a.py").write_text("x = 2\n")  # the code a run executes
    (repo / "notes.md").write_text("edited\n")  # not code: not asked about
    assert evidence.uncommitted(repo, ["src"]) == "M src/a.py"
    assert evidence.git(repo, "diff", "--quiet", "--", "notes.md").returncode == 1
    with pytest.raises(RuntimeError, match="git rev-parse nope failed"):
        evidence.git(repo, "rev-parse", "nope", check=True)


def test_head_commit_outside_a_repository_is_empty(tmp_path):
    assert evidence.head_commit(tmp_path / "nowhere") == ""
