"""`gear compare`: does a credit method help on your task, and how sure is that? (issue 49)

A study is a directory: one `gear train` run per method and seed (`<method>-seed<s>/`, paired by
seed: the same prompts, sampling and initialisation for every method of a seed, and the same
held-out problems and draws for every run), and the rule the report follows:

    rule.json          arms, baseline, metric, seeds, alpha, the effect, the config's content
                       (`config_values`: the recipe as its runs read it, so an edit of the file
                       between invocations is a change of the rule) and the gate's trend check;
                       written before the first run. Each run directory keeps the rule's hash
                       from when it began (`rule.sha256`); a run that began under another rule,
                       or none, means the rule changed after the first run began, and no winner
                       is called.
    compare.json/.md   the analysis (`gear.evidence.compare_arms`, the one the studies use):
                       the learning gate on the baseline, each candidate - baseline paired by
                       seed (Bonferroni and 95% intervals, MDE at 80% power, greedy pass@1),
                       worst seeds, and one verdict sentence.
    compare.png        the learning curves beside the paired differences with their intervals.
    <run>/error.log    the traceback of a run that raised: the study goes on to the next run,
                       and the report names the run as failed until an attempt finishes it.

Only complete pairs are analysed; every missing, unfinished or failed run is named in the
verdict, and no arm is called a winner while its runs or the baseline's for a seed of the rule
are missing. Where the study directory is under git, `gear.evidence.preregistered` also checks
that the committed rule precedes every committed result.

A rule.json written before a field existed (`ADDED_FIELDS`) lacks it: such a study resumes (the
rest of its rule is compared), and its report says what the rule did not record.

The package: `rule` (the rule's fields, its hash and its changes, `fix_rule`), `runs` (the
study's loop, one `gear train` run per arm and seed, and the records of finished runs) and
`report` (the analysis, compare.json/.md/.png, and `plan`).
"""

from gear.app.compare.report import git_record, machine, markdown, plan, plan_text, report
from gear.app.compare.rule import (
    ADDED_FIELDS,
    ALPHA,
    ARM_NAME,
    EFFECT,
    GATE_MIN_SEEDS,
    GATE_TREND,
    RULE_FILE,
    RUN_HASH,
    begun_runs,
    check_out,
    config_values,
    fix_rule,
    make_rule,
    mark_run,
    metric_of,
    parse_arm,
    parse_arms,
    read_rule,
    rule_changes,
    rule_hash,
    run_name,
    runs_under_another_rule,
)
from gear.app.compare.runs import (
    ERROR_FILE,
    clear_failure,
    collect,
    failure,
    read_summary,
    record_failure,
    run_record,
    share_eval_before,
)

__all__ = [
    "ADDED_FIELDS", "ALPHA", "ARM_NAME", "EFFECT", "ERROR_FILE", "GATE_MIN_SEEDS", "GATE_TREND",
    "RULE_FILE", "RUN_HASH", "begun_runs", "check_out", "clear_failure", "collect",
    "config_values", "failure", "fix_rule", "git_record", "machine", "make_rule", "mark_run",
    "markdown", "metric_of", "parse_arm", "parse_arms", "plan", "plan_text", "read_rule",
    "read_summary", "record_failure", "report", "rule_changes", "rule_hash", "run_name",
    "run_record", "runs_under_another_rule", "share_eval_before",
]  # fmt: skip
