"""GEAR's settings inside a verl config, and the checks run before anything starts.

A verl run selects GEAR with two keys of the stock config and one extra section::

    algorithm.adv_estimator: gear          # or gear_token, gear_turn, ... (VERL_ESTIMATORS)
    trainer.v1.trainer_mode: gear_sync     # GEAR's trainer (teacher pass + signal plumbing)
    gear: {...}                            # GearVerlConfig below; every key has a default

`validate_verl_config` checks the whole config and raises `GearConfigError` (a `ValueError`) whose
message names the offending key. It imports nothing from verl, so the checks run (and are tested)
without verl installed.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from gear.constraints import Check, check_fields, checked, field_checks
from gear.credit import METHODS, CreditParams
from gear.credit.params import CONTEXT_FIELDS
from gear.credit.signals import TEACHER_SIGNALS
from gear.settings import setting
from gear.teacher import check_wrong_answers, uses_answer

#: verl estimator name -> gear.credit method, one per registered method: the method's own name
#: where it starts with "gear", else "gear_" + name (no bare "grpo": verl has its own).
#: "gear_grpo" is plain GRPO through GEAR's plumbing (same epsilon, same logging).
VERL_ESTIMATORS: dict[str, str] = {
    (name if name.startswith("gear") else f"gear_{name}"): name for name in METHODS
}
TRAINER_MODE = "gear_sync"
TEACHERS = ("current",)  # of gear.teacher.TEACHERS, the ones the verl integration runs
_DOTTED_PATH = Check(
    test=lambda p: isinstance(p, str) and bool(p.strip(".")),
    expect="a dotted field path such as 'reward_model.ground_truth'",
)
SUPPORTED_STRATEGIES = ("fsdp", "fsdp2")
_CREDIT_KEYS = tuple(
    f.name for f in fields(CreditParams) if f.name not in ("method", *CONTEXT_FIELDS)
)


class GearConfigError(ValueError):
    """A verl config that GEAR cannot run; the message names the key and what was expected."""


@dataclass(frozen=True)
class GearVerlConfig:
    """The `gear:` section of a verl config. Defaults follow docs/spec §1-4; the settings TRL
    shares are `gear.settings.GEARSettings`. Made with a value that its check refuses: a
    `GearConfigError` naming `gear.<key>`."""

    credit: dict[str, Any] = field(
        default_factory=dict,
        metadata={"help": "CreditParams fields except `method` (algorithm.adv_estimator)."},
    )
    ground_truth_field: str = checked(
        "reward_model.ground_truth",
        "Dotted path of the row field whose value fills the teacher hint's {ground_truth}.",
        _DOTTED_PATH,
    )
    teacher_context: str = setting("teacher_context")
    answer_field: str = checked(
        "reward_model.ground_truth",
        "Dotted path of the row field holding the final answer (verl's reward reference), which "
        "fills the hint of the teacher contexts 'answer_only' and 'contrast' in place of "
        "ground_truth_field.",
        _DOTTED_PATH,
    )
    answer_hint_template: str = setting("answer_hint_template")
    hint_kind: str = setting("hint_kind")
    math_hint_template: str = setting("math_hint_template")
    tool_hint_template: str = setting("tool_hint_template")
    teacher_max_prompt_length: int | None = setting("teacher_max_prompt_length")
    teacher: str = setting(
        "teacher",
        check=Check(
            choices=TEACHERS,
            expect=f"one of {', '.join(map(repr, TEACHERS))} (the frozen and ema teachers exist "
            "in the TRL integration only)",
        ),
    )
    kl_estimator: str = setting("kl_estimator")
    kl_topk: int = setting("kl_topk")
    signal_chunk_size: int = setting("signal_chunk_size")
    teacher_micro_batch_size_per_gpu: int = checked(
        4,
        "At most this many rows per teacher forward: verl's old-log-prob micro-batches (its "
        "log_prob_micro_batch_size_per_gpu, or use_dynamic_bsz's token budget, which the teacher "
        "forwards also honour) are split further when larger.",
        Check(ge=1, integer=True),
    )
    grpo_epsilon: float = checked(
        1e-4,
        "GRPO: (r - mean) / (std + epsilon) (spec §1); algorithm.norm_adv_by_std_in_grpo applies.",
        Check(ge=0),
    )
    skip_zero_advantage_rows: bool = checked(
        True,
        "Run the teacher and contrast forwards and the signal kernel only on the rows the credit "
        "method reads: those with a non-zero sequence advantage, decided from verl's rewards "
        "(rm_scores) and uids before the old-log-prob pass (a group whose completions all tied "
        "has advantage 0, so its token advantages are 0 under any weights). Token advantages "
        "are bit-identical either way; the credit statistics describe the scored rows and "
        "gear/rows_skipped counts the others. Methods that read every row (gear_entropy_top) "
        "and runs with algorithm.use_kl_in_reward (the reward then depends on the KL to the "
        "reference, known after the pass) score every row. false: score every row.",
        Check(test=lambda v: isinstance(v, bool), expect="true or false"),
    )
    # no records unless asked: they go to verl's checkpoint directory and cost the driver a fetch
    credit_log_steps: int = setting("credit_log_steps", default=0)
    credit_log_rows: int = setting("credit_log_rows")
    credit_log_dir: str | None = field(
        default=None,
        metadata={"help": "Run directory of the credit records; None: trainer.default_local_dir."},
    )

    def __post_init__(self) -> None:
        check_fields("gear", self, field_checks(GearVerlConfig), GearConfigError)

    def credit_params(self, method: str) -> CreditParams:
        return CreditParams(
            method=method, **self.credit, contrast=self.teacher_context == "contrast"
        )

    @property
    def hint_field(self) -> str:
        """The row field that fills the teacher hint under `teacher_context`."""
        return self.answer_field if uses_answer(self.teacher_context) else self.ground_truth_field

    @property
    def hint_setting(self) -> str:
        """The key that names `hint_field`, as errors name it."""
        return "answer_field" if uses_answer(self.teacher_context) else "ground_truth_field"


@dataclass(frozen=True)
class GearVerlSettings:
    """A validated run: the verl estimator name, its credit method and GEAR's section."""

    estimator: str
    method: str
    gear: GearVerlConfig
    params: CreditParams
    norm_adv_by_std: bool = True
    kl_in_reward: bool = False  # algorithm.use_kl_in_reward: the reward changes after the pass

    @property
    def needs_signals(self) -> bool:
        """Whether the method reads any per-token signal (every method but gear_grpo)."""
        return bool(self.params.required_signals)

    @property
    def needs_teacher(self) -> bool:
        """Whether the method reads a teacher signal (KL, teacher log-probs): all but gear_grpo
        and gear_entropy_top, which reads the student's entropy alone."""
        return bool(set(self.params.required_signals) & set(TEACHER_SIGNALS))

    @property
    def skips_tied_rows(self) -> bool:
        """Whether the pass scores only the rows with a non-zero sequence advantage: the
        setting is on, the method reads signals of advantaged rows only
        (`CreditParams.signal_rows`), and the reward is final before the pass (no KL in it)."""
        return (
            self.gear.skip_zero_advantage_rows
            and self.needs_signals
            and self.params.signal_rows == "advantaged"
            and not self.kl_in_reward
        )


def _get(cfg: Any, path: str, default: Any = None) -> Any:
    """cfg["a"]["b"] for path "a.b" on dicts or OmegaConf configs; default when absent."""
    node = cfg
    for part in path.split("."):
        if node is None:
            return default
        try:
            node = (
                node[part]
                if isinstance(node, Mapping) or hasattr(node, "keys")
                else getattr(node, part)
            )
        except (
            Exception
        ):  # KeyError, AttributeError, omegaconf's missing-key / interpolation errors
            return default
    return default if node is None else node


def _plain(x: Any) -> Any:
    """An OmegaConf node as plain Python containers (no-op for plain values)."""
    try:
        from omegaconf import DictConfig, ListConfig, OmegaConf

        if isinstance(x, DictConfig | ListConfig):
            return OmegaConf.to_container(x, resolve=True)
    except ImportError:  # pragma: no cover - omegaconf comes with verl
        pass
    return x


def gear_section(cfg: Any) -> GearVerlConfig:
    """`GearVerlConfig` from the `gear:` section of a verl config (missing section: defaults)."""
    raw = _plain(_get(cfg, "gear", {})) or {}
    if not isinstance(raw, Mapping):
        raise GearConfigError(f"gear: expected a mapping of GEAR settings, got {raw!r}")
    known = {f.name for f in fields(GearVerlConfig)}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise GearConfigError(f"gear: unknown key(s) {unknown}; valid keys: {sorted(known)}")
    values = dict(raw)
    credit = _plain(values.get("credit") or {})
    if not isinstance(credit, Mapping):
        raise GearConfigError(
            f"gear.credit: expected a mapping of CreditParams fields, got {credit!r}"
        )
    bad = sorted(set(credit) - set(_CREDIT_KEYS))
    if bad:
        hint = " (the method comes from algorithm.adv_estimator)" if "method" in bad else ""
        raise GearConfigError(
            f"gear.credit: unknown key(s) {bad}{hint}; valid keys: {sorted(_CREDIT_KEYS)}"
        )
    values["credit"] = dict(credit)
    return GearVerlConfig(**values)


def train_files(cfg: Any) -> list[str]:
    files = _plain(_get(cfg, "data.train_files"))
    if files is None:
        return []
    return [files] if isinstance(files, str) else [str(f) for f in files]


def check_ground_truth_field(
    field_path: str, files: list[str], setting: str = "ground_truth_field"
) -> None:
    """Fail early when local parquet files lack the hint's field (remote files: skipped).

    Raises `GearConfigError` naming `gear.<setting>`, the field and the columns (or sub-fields)
    that exist.
    """
    local = [f for f in files if "://" not in f and os.path.isfile(os.path.expanduser(f))]
    if not local:
        return
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:  # pragma: no cover - pyarrow comes with datasets
        return
    for path in local:
        if not path.endswith(".parquet"):
            continue
        schema = pq.read_schema(os.path.expanduser(path))
        parts = field_path.split(".")
        names = list(schema.names)
        node: Any = schema
        for depth, part in enumerate(parts):
            if part not in names:
                where = ".".join(parts[:depth]) or "the dataset"
                raise GearConfigError(
                    f"gear.{setting}={field_path!r}: {where} in {path} has no field {part!r}; "
                    f"fields present: {sorted(names)}. Set gear.{setting} to the field holding "
                    + (
                        "the final answer."
                        if setting == "answer_field"
                        else "the reference solution."
                    )
                )
            typ = node.field(part).type
            if isinstance(typ, pa.StructType):
                node, names = typ, [typ.field(i).name for i in range(typ.num_fields)]
            elif (
                depth < len(parts) - 1
            ):  # a map / string column: cannot look inside; runtime checks
                break


def validate_verl_config(cfg: Any, check_files: bool = True) -> GearVerlSettings:
    """Check a composed verl config for a GEAR run; return the validated settings.

    Raises:
        GearConfigError: naming the key that is wrong and what it should be.
    """
    estimator = _get(cfg, "algorithm.adv_estimator")
    if estimator not in VERL_ESTIMATORS:
        raise GearConfigError(
            f"algorithm.adv_estimator: expected one of {sorted(VERL_ESTIMATORS)} to train with GEAR, "
            f"got {estimator!r}"
        )
    method = VERL_ESTIMATORS[str(estimator)]
    if not _get(cfg, "trainer.use_v1", True):
        raise GearConfigError(
            "trainer.use_v1: GEAR runs on verl's v1 trainer; expected true, got false"
        )
    mode = _get(cfg, "trainer.v1.trainer_mode", "sync")
    if mode != TRAINER_MODE:
        raise GearConfigError(
            f"trainer.v1.trainer_mode: expected {TRAINER_MODE!r} (GEAR's trainer: teacher pass and "
            f"per-token signals), got {mode!r}"
        )
    strategy = _get(cfg, "actor_rollout_ref.actor.strategy", "fsdp")
    if strategy not in SUPPORTED_STRATEGIES:
        raise GearConfigError(
            f"actor_rollout_ref.actor.strategy: expected one of {list(SUPPORTED_STRATEGIES)} "
            f"(GEAR's teacher pass calls the FSDP module), got {strategy!r}"
        )
    for key in (
        "actor_rollout_ref.actor.ulysses_sequence_parallel_size",
        "actor_rollout_ref.actor.fsdp_config.ulysses_sequence_parallel_size",
    ):
        sp = _get(cfg, key, 1)
        if int(sp) != 1:
            raise GearConfigError(
                f"{key}: expected 1 with GEAR (no Ulysses sequence parallelism), got {sp!r}"
            )
    if _get(cfg, "actor_rollout_ref.model.use_fused_kernels", False):
        raise GearConfigError(
            "actor_rollout_ref.model.use_fused_kernels: expected false with GEAR (the full-vocabulary "
            "KL needs the logits, which fused kernels never form)"
        )
    n = _get(cfg, "actor_rollout_ref.rollout.n", 1)
    if int(n) < 2:
        raise GearConfigError(
            f"actor_rollout_ref.rollout.n: expected >= 2 (GRPO groups rollouts of one prompt), got {n!r}"
        )
    g = gear_section(cfg)  # checks every value (GearVerlConfig.__post_init__)
    try:
        params = g.credit_params(method)
    except ValueError as e:
        raise GearConfigError(f"gear.credit: {e}") from e
    if "influence" in params.required_signals:
        raise GearConfigError(
            f"algorithm.adv_estimator={estimator!r}: the verl integration computes no answer "
            "influence (OAR-G) yet; use TRL's GEARTrainer or the gym for this method"
        )
    if "perturbation" in params.required_signals:
        raise GearConfigError(
            f"algorithm.adv_estimator={estimator!r}: OAR-P runs one forward per masked token, "
            "a number that differs by row and by worker, and verl's actor workers run sharded "
            "(FSDP/Megatron) forwards that must be collective, in equal numbers on every rank; "
            "it also needs each row's answer span, which verl does not pass; use TRL's "
            "GEARTrainer (DDP or one process), `gear train` or the gym for this method"
        )
    if "error_mask" in params.required_signals:
        raise GearConfigError(
            f"algorithm.adv_estimator={estimator!r}: first_error reads a step checker's mask, "
            "which the verl integration does not pass yet (a checker runs on decoded text in "
            "the driver); use TRL's GEARTrainer, `gear train` or the gym for this method"
        )
    if "prefix_count" in params.required_signals:
        raise GearConfigError(
            f"algorithm.adv_estimator={estimator!r}: lambda_grpo divides each token's advantage "
            "by the rows of its group that share its prefix, which needs every row's response "
            "token ids in the advantage estimator; verl's compute_advantage passes only rewards, "
            "masks and uids, and GEAR's verl trainer does not forward the ids yet; use TRL's "
            "GEARTrainer, `gear train` or the gym for this method"
        )
    if params.contrast and "kl" not in params.required_signals:
        raise GearConfigError(
            f"gear.teacher_context: 'contrast' subtracts a second teacher's KL, and "
            f"algorithm.adv_estimator={estimator!r} reads no KL; use an estimator that does "
            "(gear, gear_token, gear_departure*, ...) or another context"
        )
    settings = GearVerlSettings(
        estimator=str(estimator),
        method=method,
        gear=g,
        params=params,
        norm_adv_by_std=bool(_get(cfg, "algorithm.norm_adv_by_std_in_grpo", True)),
        kl_in_reward=bool(_get(cfg, "algorithm.use_kl_in_reward", False)),
    )
    if check_files and settings.needs_teacher:  # only the teacher hint reads the ground truth
        check_ground_truth_field(g.hint_field, train_files(cfg), g.hint_setting)
        if params.contrast:  # every answer of the local training files gets a wrong one
            try:
                check_wrong_answers(answer_values(g.hint_field, train_files(cfg)))
            except ValueError as e:
                raise GearConfigError(f"gear.{e}") from e
    return settings


def answer_values(field_path: str, files: list[str]) -> list[Any]:
    """The values at `field_path` of every row of the local parquet `files` (remote files and
    files without the field: none), e.g. the answers a contrast teacher's wrong answer is drawn
    from (`gear.teacher.wrong_answers`' pool)."""
    try:
        import pyarrow.parquet as pq
    except ImportError:  # pragma: no cover - pyarrow comes with datasets
        return []
    out: list[Any] = []
    for path in files:
        local = os.path.expanduser(path)
        if "://" in path or not path.endswith(".parquet") or not os.path.isfile(local):
            continue
        parts = field_path.split(".")
        if parts[0] not in pq.read_schema(local).names:
            continue
        for value in pq.read_table(local, columns=[parts[0]]).column(parts[0]).to_pylist():
            for part in parts[1:]:
                value = value.get(part) if isinstance(value, dict) else None
            out.append(value)
    return out


def default_gear_section() -> dict[str, Any]:
    """The `gear:` section with every default, as written in configs/verl/gear_defaults.yaml."""
    out = dataclasses.asdict(GearVerlConfig())
    out["credit"] = {k: getattr(CreditParams(), k) for k in _CREDIT_KEYS}
    return out
