"""LoRA in `gear train` (`lora_r`): PEFT adapters trained, saved, resumed and evaluated like the
rest of a run, on the tiny model; the held-out mean reward of k samples and the before-score
cache of the embedded model."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
import yaml
from typer.testing import CliRunner

from gear.app.cli import app
from gear.app.config import resolve_config
from gear.app.evaluate import eval_cache_key
from gear.app.rundir import learning_lines
from gear.models import load_model_and_tokenizer
from gear.testing import save_tiny_model, tiny_run_args

pytest.importorskip("peft")
runner = CliRunner()
LORA = ["--set", "lora_r=4", "--set", "learning_rate=0.05", "--set", "eval_samples=2"]
# constant: a run resumed with more steps keeps the scheduler of its checkpoint (HF), which a
# linear decay over 1 step has brought to 0
LORA += ["--set", "lr_scheduler_type=constant"]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("tiny") / "model", vocab="bytes", seed=1)


def train(*args: str) -> str:
    result = runner.invoke(app, ["train", *args])
    assert result.exit_code == 0, result.output
    return result.output


def test_a_lora_run_trains_the_adapter_only_and_resumes(tiny_dir, tmp_path):
    out = tmp_path / "run"
    # the random tiny model never solves arithmetic: every reward is 0 and GRPO's advantages
    # with it, so the adapter is trained by self-distillation (a gradient on every token)
    common = ["--model", str(tiny_dir), "--set", "loss_mode=self_distill", *tiny_run_args(), *LORA]
    train(*common, "--steps", "1", "--output-dir", str(out))
    assert yaml.safe_load((out / "config.yaml").read_text())["lora_r"] == 4
    assert (out / "checkpoint-1" / "adapter_model.safetensors").is_file()
    assert (out / "final" / "adapter_config.json").is_file()
    after_1, _ = load_model_and_tokenizer(out / "final")  # base + adapter, merged
    base, _ = load_model_and_tokenizer(tiny_dir)
    moved = [n for n, p in base.named_parameters() if not torch.equal(p, after_1.get_parameter(n))]
    assert moved and all("proj" in n for n in moved)  # linear layers only: the adapters' targets
    assert not any("embed" in n or "norm" in n for n in moved)

    output = train("--resume", str(out), "--steps", "2")
    assert "resuming from" in output and (out / "checkpoint-2").is_dir()
    after_2, _ = load_model_and_tokenizer(out / "final")
    assert any(not torch.equal(p, after_2.get_parameter(n)) for n, p in after_1.named_parameters())
    summary = json.loads((out / "summary.json").read_text())
    for when in ("eval_before", "eval_after"):
        scores = summary[when]
        assert scores["samples"] == 2 and 0.0 <= scores["mean_reward"] <= 1.0
        assert len(scores["per_problem"]["mean_reward"]) == scores["n_problems"] == 4
    # the verdicts follow the table after a blank line (else some renderers take them into it)
    assert "|\n\n- mean reward, after - before" in (out / "summary.md").read_text()


def test_bad_lora_settings_are_refused_before_any_work(tiny_dir, tmp_path):
    for setting, words in (("lora_r=-1", "lora_r"), ("lora_dropout=1.5", "lora_dropout")):
        result = runner.invoke(
            app,
            [
                "train",
                "--model",
                str(tiny_dir),
                "--set",
                setting,
                "--output-dir",
                str(tmp_path / "r"),
            ],
        )
        assert result.exit_code != 0 and words in result.output
        assert not (tmp_path / "r").exists()


def test_the_before_score_is_cached_only_for_the_embedded_model_and_keyed_by_the_evaluation():
    cfg = resolve_config(None, {"eval_n": 200, "eval_samples": 8})
    key = eval_cache_key(cfg)
    assert key == eval_cache_key(resolve_config(None, {"eval_n": 200, "eval_samples": 8}))
    assert key != eval_cache_key(dataclasses.replace(cfg, eval_n=100))
    assert key != eval_cache_key(dataclasses.replace(cfg, eval_seed=1))
    assert key != eval_cache_key(
        resolve_config(None, {"eval_n": 200, "eval_samples": 8, "temperature": 0.9})
    )
    assert key != eval_cache_key(dataclasses.replace(cfg, task_options={"mix": "1digit"}))
    assert eval_cache_key(dataclasses.replace(cfg, model="/some/model")) is None
    no_thinking = {"chat_template_kwargs": {"enable_thinking": False}}  # they change the prompts
    assert key != eval_cache_key(
        resolve_config(None, {"eval_n": 200, "eval_samples": 8, **no_thinking})
    )


def test_evaluation_renders_prompts_with_the_runs_chat_template_kwargs():
    """Qwen3 thinks unless `enable_thinking: false` reaches its template: held-out prompts get
    the kwargs training's prompts get (`chat_template_kwargs`)."""
    from gear.app.evaluate import render_prompts
    from gear.testing import byte_tokenizer

    tok = byte_tokenizer()
    tok.chat_template = (
        "{% for m in messages %}{{ m.content }}{% endfor %}"
        "{% if enable_thinking is defined and not enable_thinking %}<no-think>{% endif %}"
    )
    rows = [{"prompt": [{"role": "user", "content": "1 + 1?"}]}]
    assert render_prompts(tok, rows) == ["1 + 1?"]
    assert render_prompts(tok, rows, {"enable_thinking": False}) == ["1 + 1?<no-think>"]


def test_summary_says_whether_the_run_learned():
    before = {"per_problem": {"mean_reward": [0.25, 0.5, 0.75, 0.5], "greedy": [0, 1, 1, 0]}}
    up = {"per_problem": {"mean_reward": [0.5, 0.75, 1.0, 0.75], "greedy": [0, 1, 1, 0]}}
    down = {"per_problem": {"mean_reward": [0.0, 0.25, 0.5, 0.25], "greedy": [0, 1, 1, 0]}}
    assert "learned: the interval is above 0" in learning_lines(before, up)[0]
    assert "got worse" in learning_lines(before, down)[0]
    assert "no change" in learning_lines(before, up)[1]  # greedy: identical
    assert learning_lines(before, None) == []


@pytest.mark.parametrize("context", ["answer_only", "contrast"])
def test_gear_train_runs_each_teacher_context(tiny_dir, tmp_path, context):
    """`--set teacher_context=...` through gear train (issue 36): the contrast teacher's wrong
    answer comes from the task's hook."""
    out = tmp_path / "run"
    train(
        "--model", str(tiny_dir), "--steps", "1", "--output-dir", str(out), *tiny_run_args(),
        "--set", "eval_n=0", "--set", f"teacher_context={context}",
    )  # fmt: skip
    saved = yaml.safe_load((out / "config.yaml").read_text())
    assert saved["trainer"]["teacher_context"] == context
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert ("gear/time_contrast" in metrics[0]) == (context == "contrast")


def test_an_adapter_on_the_embedded_model_loads_where_its_saved_cache_path_does_not_exist(
    tiny_dir, tmp_path, monkeypatch
):
    """An adapter trained on the embedded model names the cache directory of the machine it was
    saved on; on another machine (or before this one dequantised it) that path does not exist,
    and this machine's cache stands for it (issue 58's committed checkpoint, on a fresh clone)."""
    import peft

    import gear.models as models

    base, _ = load_model_and_tokenizer(tiny_dir)
    lora = peft.get_peft_model(base, peft.LoraConfig(r=2, target_modules="all-linear"))
    for name, p in lora.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.3)
    adapter = tmp_path / "adapter"
    lora.save_pretrained(adapter)
    config = json.loads((adapter / "adapter_config.json").read_text())
    config["base_model_name_or_path"] = "/elsewhere/.cache/gear/" + models.CACHE_NAME
    (adapter / "adapter_config.json").write_text(json.dumps(config))
    monkeypatch.setattr(models, "smollm2_dir", lambda: tiny_dir)
    merged, _ = load_model_and_tokenizer(adapter)
    fresh, _ = load_model_and_tokenizer(tiny_dir)
    assert any(not torch.equal(p, fresh.get_parameter(n)) for n, p in merged.named_parameters())
    identity = models.model_identity(adapter)
    assert identity.endswith("+" + models.model_identity(tiny_dir))
