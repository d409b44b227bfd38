"""gear.viz: credit records, the HTML viewer, PNG plots (and a headless-Chromium screenshot)."""

from __future__ import annotations

import json
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import pytest
import torch

from gear.credit import credit_details
from gear.viz import (
    credit_record_path,
    credit_rows,
    plot_learning_curves,
    plot_metrics,
    plot_trajectory,
    read_credit_records,
    render_credit_html,
    write_credit_html,
    write_credit_record,
)

WORDS = ("Let", " x", " be", " the", " number", ".", " Then", " 3", "x", " =", " 12", ",", " so",
         " x", " =", " 4", ".\n", "Check", ":", " 3", "·", "4", " =", " 12", ".", " \\boxed{4}")  # fmt: skip
EVIL = "<script>alert(1)</script>"


def make_batch(seed: int = 0, N: int = 4, T: int = 40):
    """A batch with a tool gap (invalid tokens 14..18 in row 0), a turn start after it, padding
    at the end of rows 1-3, and an injection attempt among the tokens. Returns a dict."""
    g = torch.Generator().manual_seed(seed)
    lengths = [T, T - 6, T - 11, T - 3]
    valid = torch.zeros(N, T, dtype=torch.bool)
    real = torch.zeros(N, T, dtype=torch.bool)  # policy + observation tokens (not padding)
    for i, n in enumerate(lengths):
        valid[i, :n] = real[i, :n] = True
    valid[0, 14:19] = False  # tool observation inside row 0
    turn_starts = torch.zeros(N, T, dtype=torch.bool)
    turn_starts[0, 19] = True
    turn_starts[1, 20] = True
    kl = torch.rand(N, T, generator=g) ** 4 * 0.3
    kl[:, [5, 11, 22, 30]] += torch.tensor([1.5, 0.9, 1.2, 0.7])
    entropy = torch.rand(N, T, generator=g) * 0.5 + 0.2
    entropy[:, [9, 26]] += 1.5
    advantages = torch.tensor([0.9, -0.7, 0.0, 1.1])
    tokens = [[WORDS[(t + i) % len(WORDS)] for t in range(T)] for i in range(N)]
    tokens[0][14:19] = ["<tool_response>", '{"x": 4}', "\n", "</tool_response>", "\n"]
    tokens[1][3] = EVIL
    details = credit_details(advantages, valid, kl=kl, entropy=entropy, turn_starts=turn_starts)
    rows = credit_rows(
        details, tokens=tokens, rewards=[1.0, 0.0, 0.5, 1.0], advantages=advantages,
        prompts=[[{"role": "user", "content": f"Solve 3x = 12 (#{i}) & <b>"}] for i in range(N)],
        completions=["".join(t) for t in tokens], step=7, method="gear",
        kl=kl, entropy=entropy, token_ids=torch.arange(N * T).view(N, T), completion_mask=real,
    )  # fmt: skip
    return {"details": details, "rows": rows, "lengths": lengths, "valid": valid}


def test_credit_rows_drop_padding_keep_tool_tokens_invalid_and_match_details():
    b = make_batch()
    rows, details = b["rows"], b["details"]
    assert [r["row"] for r in rows] == [0, 1, 2, 3]
    keys = ("tokens", "token_ids", "valid", "kl", "entropy", "kl_norm", "entropy_norm", "onset",
            "segment_id", "weight", "token_advantage")  # fmt: skip
    for r, n in zip(rows, b["lengths"], strict=True):
        assert {len(r[k]) for k in keys} == {n}
        assert r["step"] == 7 and r["method"] == "gear"
        assert r["prompt"].startswith("user: Solve")
    r0 = rows[0]
    assert r0["valid"][14:19] == [False] * 5 and r0["tokens"][14] == "<tool_response>"
    assert all(w == 1.0 for w in r0["weight"][14:19])
    assert all(s == -1 for s in r0["segment_id"][14:19])
    assert any(r0["onset"]) and max(r0["segment_id"]) >= 1
    assert r0["weight"] == pytest.approx(details.weights[0].tolist(), rel=1e-5)
    assert r0["token_advantage"][:5] == pytest.approx(
        details.token_advantages[0, :5].tolist(), rel=1e-5
    )
    assert rows[2]["token_advantage"] == [0.0] * b["lengths"][2]  # A = 0 -> no credit
    # without completion_mask, trailing padding goes; a chosen subset of rows
    sub = credit_rows(b["details"], tokens=[r["tokens"] + ["<pad>"] * 40 for r in rows],
                      rewards=[0] * 4, advantages=[0] * 4, prompts=["p"] * 4,
                      completions=["c"] * 4, step=1, method="gear", rows=[3, 1])  # fmt: skip
    assert [r["row"] for r in sub] == [3, 1] and len(sub[0]["tokens"]) == b["lengths"][3]
    assert sub[0]["kl"] == [None] * b["lengths"][3]


def test_records_written_then_read_are_equal_and_strict_json(tmp_path: Path):
    rows = make_batch()["rows"]
    later = [dict(r, step=12) for r in rows[:2]]
    write_credit_record(credit_record_path(tmp_path, 12), later)
    path = write_credit_record(credit_record_path(tmp_path, 7), rows)
    assert path == tmp_path / "credit" / "step_000007.jsonl"
    assert len(path.read_text().splitlines()) == 4
    back = read_credit_records(tmp_path)
    assert back == rows + later
    assert read_credit_records(tmp_path / "credit") == back
    assert read_credit_records(path) == rows


class _Page(HTMLParser):
    """Collects the JSON block, the pre-rendered token spans and all text of script tags."""

    def __init__(self) -> None:
        super().__init__()
        self.stack: list[tuple[str, dict]] = []
        self.json_text = ""
        self.token_spans: list[dict] = []
        self.scripts: list[str] = []
        self.urls: list[str] = []

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        self.urls += [v for k, v in attrs if k in ("src", "href") and v]
        in_tokens = any(t == "div" and d.get("id") == "tokens" for t, d in self.stack)
        if tag == "span" and in_tokens and "tok" in a.get("class", "").split():
            self.token_spans.append(a)
        self.stack.append((tag, a))

    def handle_endtag(self, tag):
        while self.stack and self.stack.pop()[0] != tag:
            pass

    def handle_data(self, data):
        if self.stack and self.stack[-1][0] == "script":
            self.scripts.append(data)
            if self.stack[-1][1].get("type") == "application/json":
                self.json_text += data


def test_html_page_is_self_contained_and_escapes_token_text(tmp_path: Path):
    rows = make_batch()["rows"]
    rows[1]["prompt"] = "{{JS}} " + EVIL
    page = render_credit_html(rows, title=f"run {EVIL}")
    p = _Page()
    p.feed(page)
    data = json.loads(p.json_text)
    assert [r["row"] for r in data["records"]] == [0, 1, 2, 3]
    assert data["records"][1]["tokens"][3] == EVIL and data["records"][1]["prompt"].startswith(
        "{{JS}}"
    )
    # the first row is pre-rendered: one span per token, with onset/segment/invalid classes
    spans, r0 = p.token_spans, rows[0]
    assert len(spans) == len(r0["tokens"])
    assert [int(s["data-i"]) for s in spans] == list(range(len(r0["tokens"])))
    cls = [s["class"].split() for s in spans]
    assert [("onset" in c) for c in cls] == r0["onset"]
    assert [("inv" in c) for c in cls] == [not v for v in r0["valid"]]
    for c, seg in zip(cls, r0["segment_id"], strict=True):
        assert (f"seg-{seg}" in c) == (seg >= 0)
    assert sum("segstart" in c for c in cls) == len({s for s in r0["segment_id"] if s >= 0})
    # no injected markup anywhere, no external resources
    assert EVIL not in page and "&lt;script&gt;" in page
    assert sum(s.count("<script") for s in p.scripts) == 0
    assert p.urls == [] and "http://" not in page.replace("http://www.w3.org/2000/svg", "")
    assert "https://" not in page
    # the page is written from a run directory
    write_credit_record(credit_record_path(tmp_path, 7), rows)
    out = write_credit_html(tmp_path)
    assert out == tmp_path / "credit.html" and out.stat().st_size > 1000
    assert render_credit_html([], title="empty").count("No credit records") == 1


def _png_ok(path: Path) -> None:
    from PIL import Image

    assert path.exists() and path.stat().st_size > 0
    with Image.open(path) as im:
        assert im.size[0] > 0 and im.size[1] > 0


def test_plots_write_one_png_per_metric_and_a_learning_curve_figure(tmp_path: Path):
    rows = make_batch()["rows"]
    _png_ok(plot_trajectory(rows[0], tmp_path / "traj.png"))
    metrics = tmp_path / "metrics.jsonl"
    lines = [{"step": s, "reward": s / 10, "entropy": 1 - s / 20, "gear/kl_mean": 0.1 * s,
              "gear/weight_std_pos": 0.2, "loss": 1.0} for s in range(5)]  # fmt: skip
    lines[2]["eval/accuracy"] = 0.4
    lines[4]["eval/accuracy"] = 0.6
    metrics.write_text("".join(json.dumps(x) + "\n" for x in lines))
    paths = plot_metrics(metrics, tmp_path / "plots")
    assert [p.name for p in paths] == ["reward.png", "eval_accuracy.png", "entropy.png",
                                       "gear_kl_mean.png", "gear_weight_std_pos.png"]  # fmt: skip
    for p in paths:
        _png_ok(p)
    curves = {
        "gear": [([0, 1, 2, 3], [0.1, 0.3, 0.5, 0.6]), ([0, 1, 2, 3], [0.2, 0.3, 0.4, 0.7])],
        "grpo": [([0, 2, 4], [0.1, 0.2, 0.4]), ([0, 1, 3, 4], [0.1, 0.2, 0.3, 0.3])],
    }
    _png_ok(plot_learning_curves(curves, tmp_path / "curves.png", ylabel="accuracy"))


def _trajectory_ticks(monkeypatch, record: dict, tmp_path: Path) -> dict[int, str]:
    """Draw `record`'s trajectory plot; its x tick labels by token position."""
    import gear.viz.plots as plots

    figures = []
    monkeypatch.setattr(plots.plt, "close", figures.append)  # keep the figure to read it
    _png_ok(plot_trajectory(record, tmp_path / "traj.png"))
    ax = figures[0].axes[0]
    return {
        round(x): t.get_text() for x, t in zip(ax.get_xticks(), ax.get_xticklabels(), strict=True)
    }


def test_the_trajectory_labels_its_x_axis_with_the_rows_tokens(monkeypatch, tmp_path: Path):
    """Issue 59 item 12: a reader sees which token was blamed: each tick is the row's token as
    the viewer shows it (whitespace marked); text that reads as matplotlib math stays text."""
    from gear.viz.html import token_label

    record = dict(make_batch()["rows"][0])
    record["tokens"] = list(record["tokens"])
    record["tokens"][2:5] = ["$x^$", "", " \\boxed{4}\n"]  # math markup, empty, long
    ticks = _trajectory_ticks(monkeypatch, record, tmp_path)
    assert list(ticks) == list(range(len(record["tokens"])))  # 40 tokens: every one labelled
    assert ticks[1] == "·x" and ticks[3] == "∅" and ticks[2] == "$x^$"
    assert ticks[4] == token_label(" \\boxed{4}\n")[:9] + "…"  # cut: ·\boxed{4}↵
    assert ticks[14] == "<tool_res…" and ticks[16] == "↵"  # the tool's output, a newline


def test_a_long_trajectory_labels_every_kth_token_and_every_onset(monkeypatch, tmp_path: Path):
    record = dict(make_batch()["rows"][0])
    n = 900
    for key in ("kl_norm", "entropy_norm", "weight", "valid", "onset", "segment_id"):
        record[key] = (record[key] * (n // 40 + 1))[:n]
    record["tokens"] = [f"t{i}" for i in range(n)]
    onsets = [i for i in range(n) if record["onset"][i]]
    ticks = _trajectory_ticks(monkeypatch, record, tmp_path)
    assert 50 < len(ticks) < n / 2  # thinned, yet dense enough to read along
    assert all(ticks[i] == f"t{i}" for i in ticks) and set(onsets) <= set(ticks)


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def _chromium(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    cmd = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
           "--no-first-run", "--disable-background-networking", "--disable-component-update",
           "--disable-sync", f"--user-data-dir={tmp_path / 'profile'}", *args]  # fmt: skip
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)


@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed")
def test_html_script_runs_in_headless_chromium_and_shows_the_linked_row(tmp_path: Path):
    """The page's JS runs: the DOM after load has the selectors and the chosen row's spans;
    a screenshot is not blank."""
    from PIL import Image

    rows = make_batch()["rows"]
    page = tmp_path / "credit.html"
    page.write_text(render_credit_html(rows, title="screenshot test"), "utf-8")
    dom = _chromium(tmp_path, "--dump-dom", page.as_uri() + "#step=7&row=1&mode=weight").stdout
    p = _Page()
    p.feed(dom)
    assert len(p.token_spans) == len(rows[1]["tokens"])  # the JS rendered row 1
    assert dom.count("<option") == 1 + len(rows)  # one step, four rows
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in dom and EVIL not in dom
    png = tmp_path / "shot.png"
    _chromium(tmp_path, f"--screenshot={png}", "--window-size=1200,900", page.as_uri())
    assert png.exists() and png.stat().st_size > 0
    with Image.open(png) as im:
        colours = im.convert("RGB").resize((300, 225)).getcolors(maxcolors=1 << 16)
    assert colours is not None and len(colours) > 20
