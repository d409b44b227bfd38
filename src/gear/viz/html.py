"""One self-contained HTML page that shows credit records token by token.

The page embeds the records as JSON (`<script type="application/json" id="credit-data">`), lets
the reader pick a step and a row, and colours every token by normalised KL (reds), normalised
entropy (blues) or weight (pink < 1 < green, log scale). Tool/observation tokens are grey,
onsets get a solid left bar, segments a coloured underline, and hovering a token shows all its
values. The first record is also rendered server-side, so the page reads without JavaScript.
No external URLs: inline CSS and a little vanilla JS only.
"""

from __future__ import annotations

import html
import json
import math
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gear.io import write_text
from gear.viz.record import read_credit_records

#: Colour stops (ColorBrewer Reds, Blues, PiYG), shared by the Python and JS renderers.
SCALES: dict[str, list[str]] = {
    "kl": ["#fff5f0", "#fee0d2", "#fcbba1", "#fc9272", "#fb6a4a", "#ef3b2c", "#cb181d", "#a50f15"],
    "entropy": ["#f7fbff", "#deebf7", "#c6dbef", "#9ecae1", "#6baed6", "#4292c6", "#2171b5",
                "#08519c"],
    "weight": ["#8e0152", "#c51b7d", "#de77ae", "#f1b6da", "#fde0ef", "#f7f7f7", "#e6f5d0",
               "#b8e186", "#7fbc41", "#4d9221", "#276419"],
}  # fmt: skip
#: Underline colours of segments, by segment id modulo the length (Tableau 10).
SEGMENT_COLOURS = ["#4e79a7", "#f28e2b", "#59a14f", "#b07aa1", "#edc948", "#76b7b2", "#9c755f",
                   "#ff9da7", "#e15759", "#bab0ac"]  # fmt: skip
W_LO, W_HI = 0.5, 2.0  # ends of the weight colour scale (log-symmetric; beyond them saturates)
W_CHART = 3.0  # the chart draws weight / W_CHART (the spec's default w_max)


def _hex(c: str) -> tuple[int, int, int]:
    return int(c[1:3], 16), int(c[3:5], 16), int(c[5:7], 16)


def _ramp(stops: Sequence[str], u: float) -> str:
    """Linear interpolation along colour stops, u in [0, 1] -> 'rgb(r,g,b)'."""
    u = min(max(u, 0.0), 1.0) * (len(stops) - 1)
    i = min(int(u), len(stops) - 2)
    a, b, f = _hex(stops[i]), _hex(stops[i + 1]), u - i
    r, g, bl = (round(x + (y - x) * f) for x, y in zip(a, b, strict=True))
    return f"rgb({r},{g},{bl})"


def weight_position(w: float) -> float:
    """Position of a weight on the diverging scale: 0 at W_LO, 0.5 at 1, 1 at W_HI (log)."""
    if w <= 0:
        return 0.0
    u = -math.log(w) / math.log(W_LO) if w < 1 else math.log(w) / math.log(W_HI)
    return (min(max(u, -1.0), 1.0) + 1) / 2


def token_colour(rec: dict[str, Any], i: int, mode: str) -> str | None:
    """Background of token i in mode 'kl' | 'entropy' | 'weight'; None for invalid/missing."""
    if not rec["valid"][i]:
        return None
    key = {"kl": "kl_norm", "entropy": "entropy_norm", "weight": "weight"}[mode]
    v = rec[key][i]
    if v is None:
        return None
    return _ramp(SCALES[mode], weight_position(v) if mode == "weight" else v)


def _dark(rgb: str) -> bool:
    r, g, b = (int(x) for x in rgb[4:-1].split(","))
    return 0.299 * r + 0.587 * g + 0.114 * b < 140


#: How the viewer shows whitespace in a token (the page's JS `addText` uses the same marks).
WHITESPACE_MARKS = {" ": "·", "\n": "↵", "\t": "⇥", "\r": "␍"}
EMPTY_TOKEN = "∅"  # a token that decodes to nothing


def token_label(text: str, marks: dict[str, str] = WHITESPACE_MARKS) -> str:
    """A token's text as the viewer shows it, in plain text: whitespace as its mark."""
    return "".join(marks.get(ch, ch) for ch in text) if text else EMPTY_TOKEN


def _token_text_html(text: str) -> str:
    """Escaped token text with visible whitespace: '·' for spaces, '↵' + break for newlines."""
    if text == "":
        return f'<span class="ws">{EMPTY_TOKEN}</span>'
    out = []
    for ch in text:
        if ch in WHITESPACE_MARKS:  # newlines and tabs also keep their layout
            keep = ch if ch in "\n\t" else ""
            out.append(f'<span class="ws">{WHITESPACE_MARKS[ch]}</span>{keep}')
        else:
            out.append(html.escape(ch))
    return "".join(out)


def token_classes(rec: dict[str, Any], i: int) -> list[str]:
    """CSS classes of token i: tok, inv (tool/observation), onset, seg, segstart, seg-K."""
    cls = ["tok"]
    seg = rec["segment_id"][i]
    if not rec["valid"][i]:
        cls.append("inv")
    if rec["onset"][i]:
        cls.append("onset")
    if seg >= 0:
        cls += ["seg", f"seg-{seg}"]
        if i == 0 or rec["segment_id"][i - 1] != seg:
            cls.append("segstart")
    return cls


def render_tokens_html(rec: dict[str, Any], mode: str = "kl") -> str:
    """The token spans of one record (what the page's JS renders too), one span per token."""
    spans = []
    for i, text in enumerate(rec["tokens"]):
        style = []
        bg = token_colour(rec, i, mode)
        if bg:
            style.append(f"background:{bg}")
            if _dark(bg):
                style.append("color:#fff")
        seg = rec["segment_id"][i]
        if seg >= 0:
            style.append(f"border-bottom-color:{SEGMENT_COLOURS[seg % len(SEGMENT_COLOURS)]}")
        spans.append(
            f'<span class="{" ".join(token_classes(rec, i))}" data-i="{i}" '
            f'style="{";".join(style)}">{_token_text_html(text)}</span>'
        )
    return "".join(spans)


def _fmt(x: float | None, signed: bool = False) -> str:
    return "–" if x is None else (f"{x:+.3f}" if signed else f"{x:.3f}")


def _meta_html(rec: dict[str, Any]) -> str:
    """The row's summary cards (same layout as the JS `renderMeta`)."""
    n_valid = sum(rec["valid"])
    segs = len({s for s in rec["segment_id"] if s >= 0})
    w = [x for x, v in zip(rec["weight"], rec["valid"], strict=True) if v and x is not None]
    cards = [
        ("method", str(rec.get("method", "?"))),
        ("step · row", f"{rec.get('step', '?')} · {rec.get('row', '?')}"),
        ("reward", _fmt(rec.get("reward"))),
        ("advantage", _fmt(rec.get("advantage"), signed=True)),
        ("tokens (policy / all)", f"{n_valid} / {len(rec['tokens'])}"),
        ("onsets · segments", f"{sum(rec['onset'])} · {segs}"),
        ("weight min – max", f"{min(w):.2f} – {max(w):.2f}" if w else "–"),
    ]
    if rec.get("skipped"):  # no teacher pass: the row's advantage is 0 (`skipped` rows)
        cards.append(("teacher", "skipped (advantage 0)"))
    return "".join(
        f'<div class="card"><div class="k">{html.escape(k)}</div>'
        f'<div class="v">{html.escape(v)}</div></div>'
        for k, v in cards
    )


def _json_for_script(data: Any) -> str:
    """JSON that cannot close or confuse its <script> block (<, >, & escaped as \\uXXXX)."""
    text = json.dumps(data, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def _clean(x: Any) -> Any:
    """Non-finite floats -> None, recursively (strict JSON for the browser)."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_clean(v) for v in x]
    return x


def render_credit_html(records: Sequence[dict[str, Any]], *, title: str) -> str:
    """The whole page for a list of credit records (contracts format). Returns HTML text."""
    records = [_clean(dict(r)) for r in records]
    first = records[0] if records else None
    config = {
        "scales": SCALES, "segColours": SEGMENT_COLOURS, "wLo": W_LO, "wHi": W_HI,
        "wChart": W_CHART,
    }  # fmt: skip
    tokens = render_tokens_html(first) if first else '<p class="empty">No credit records.</p>'
    parts = {
        "TITLE": html.escape(title),
        "CSS": CSS,
        "META": _meta_html(first) if first else "",
        "PROMPT": html.escape(first.get("prompt", "")) if first else "",
        "TOKENS": tokens,
        "LEGEND": _legend_html(),
        "DATA": _json_for_script({"records": records, "config": config}),
        "JS": JS,
    }
    # one pass, so text inside the parts (e.g. a prompt holding "{{JS}}") is never substituted
    return re.sub(r"\{\{([A-Z]+)\}\}", lambda m: parts[m.group(1)], PAGE)


def _legend_html() -> str:
    """The KL colour bar (the JS redraws it for the chosen mode)."""
    stops = SCALES["kl"]
    grad = ", ".join(stops)
    return (
        f'<div class="bar-grad" style="background:linear-gradient(to right, {grad})"></div>'
        '<div class="ticks"><span>0</span><span>0.5</span><span>1</span></div>'
        '<div class="cap">normalised KL d̃ (row min–max)</div>'
    )


def write_credit_html(run_dir: str | Path, out_path: str | Path | None = None) -> Path:
    """Render all credit records of a run (`RUN_DIR/credit/step_*.jsonl`) to one page.

    Args:
        run_dir: a run directory, its credit directory, or one JSONL file.
        out_path: where to write; default `RUN_DIR/credit.html` (beside a JSONL file).
    Returns:
        The path written.
    """
    run_dir = Path(run_dir)
    records = read_credit_records(run_dir)
    if out_path is None:
        out_path = run_dir.with_suffix(".html") if run_dir.is_file() else run_dir / "credit.html"
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    name = run_dir.stem if run_dir.is_file() else run_dir.resolve().name
    write_text(out_path, render_credit_html(records, title=f"GEAR credit · {name}"))
    return out_path


PAGE = """<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{{TITLE}}</title>
<style>{{CSS}}</style>
</head>
<body>
<header><h1>{{TITLE}}</h1>
<p class="sub">Per-token credit: each token coloured by its signal; hover for values.</p></header>
<nav class="controls">
  <label>Step <select id="step"></select></label>
  <label>Row <select id="row"></select></label>
  <button type="button" id="prev" title="previous row (←)">‹</button>
  <button type="button" id="next" title="next row (→)">›</button>
  <span class="modes" role="radiogroup" aria-label="colour by">
    <label><input type="radio" name="mode" value="kl" checked><span>KL</span></label>
    <label><input type="radio" name="mode" value="entropy"><span>Entropy</span></label>
    <label><input type="radio" name="mode" value="weight"><span>Weight</span></label>
  </span>
  <div id="legend" class="legend">{{LEGEND}}</div>
</nav>
<main>
<section id="meta" class="meta">{{META}}</section>
<details class="prompt" open><summary>Prompt</summary><pre id="prompt">{{PROMPT}}</pre></details>
<div class="key">
  <span><span class="tok onset sample">tok</span> onset (starts a segment)</span>
  <span><span class="tok seg segstart sample">tok</span> segment start, no onset</span>
  <span><span class="tok seg sample" style="border-bottom-color:#4e79a7">tok</span><span
    class="tok seg sample" style="border-bottom-color:#f28e2b">tok</span> underline colour =
    segment id</span>
  <span><span class="tok inv sample">tool</span> observation (no credit)</span>
  <span><span class="ws">·</span> space <span class="ws">↵</span> newline</span>
</div>
<div id="tokens" class="tokens">{{TOKENS}}</div>
<div class="chart-key"><span class="l-kl">━ d̃ KL</span> <span class="l-ent">━ H̃ entropy</span>
  <span class="l-w">┅ weight / 3 (1 = no change)</span> <span>│ onset</span> <span>▒ segment</span>
  <span class="l-inv">▒ observation</span></div>
<svg id="chart" class="chart" viewBox="0 0 100 1" preserveAspectRatio="none"></svg>
<div id="axis" class="axis"></div>
</main>
<div id="tip" class="tip" hidden></div>
<script type="application/json" id="credit-data">{{DATA}}</script>
<script>{{JS}}</script>
</body>
</html>
"""

CSS = """
:root { --fg:#1f2937; --muted:#6b7280; --line:#e5e7eb; --bg:#f8fafc; --card:#fff; }
* { box-sizing: border-box; }
body { margin:0; font:14px/1.45 system-ui, -apple-system, "Segoe UI", sans-serif;
  color:var(--fg); background:var(--bg); }
header { padding:14px 24px 6px; }
h1 { font-size:19px; margin:0; }
.sub { margin:2px 0 0; color:var(--muted); font-size:13px; }
.controls { position:sticky; top:0; z-index:2; display:flex; flex-wrap:wrap; gap:10px 16px;
  align-items:center; padding:10px 24px; background:#fff; border-bottom:1px solid var(--line);
  box-shadow:0 1px 3px rgba(0,0,0,.04); }
.controls select { font:inherit; padding:3px 6px; border:1px solid #cbd5e1; border-radius:6px;
  background:#fff; max-width:260px; }
.controls button { font:inherit; width:28px; height:28px; border:1px solid #cbd5e1;
  border-radius:6px; background:#fff; cursor:pointer; }
.controls button:hover { background:#f1f5f9; }
.modes { display:inline-flex; border:1px solid #cbd5e1; border-radius:7px; overflow:hidden; }
.modes input { display:none; }
.modes span { display:inline-block; padding:4px 12px; cursor:pointer; user-select:none; }
.modes label + label span { border-left:1px solid #cbd5e1; }
.modes input:checked + span { background:#1f2937; color:#fff; }
.legend { display:grid; grid-template-columns:260px; margin-left:auto; font-size:11px;
  color:var(--muted); }
.bar-grad { height:10px; border-radius:3px; border:1px solid #d1d5db; }
.ticks { display:flex; justify-content:space-between; }
.cap { text-align:center; }
main { max-width:1180px; padding:14px 24px 40px; }
.meta { display:flex; flex-wrap:wrap; gap:8px; }
.card { background:var(--card); border:1px solid var(--line); border-radius:8px;
  padding:6px 12px; min-width:110px; }
.card .k { font-size:11px; color:var(--muted); text-transform:uppercase; letter-spacing:.03em; }
.card .v { font-size:15px; font-weight:600; font-variant-numeric:tabular-nums; }
.prompt { margin:12px 0 6px; background:var(--card); border:1px solid var(--line);
  border-radius:8px; padding:6px 12px; }
.prompt summary { cursor:pointer; color:var(--muted); font-size:12px; }
.prompt pre { margin:6px 0 2px; white-space:pre-wrap; word-break:break-word; max-height:9em;
  overflow:auto; font:12.5px/1.45 ui-monospace, SFMono-Regular, Menlo, Consolas, monospace; }
.key { display:flex; flex-wrap:wrap; gap:6px 18px; margin:10px 0 6px; font-size:12px;
  color:var(--muted); align-items:center; }
.tokens { background:var(--card); border:1px solid var(--line); border-radius:8px;
  padding:14px 16px; white-space:pre-wrap; word-break:break-word;
  font:14px/2.15 ui-monospace, SFMono-Regular, Menlo, Consolas, monospace; }
.tok { padding:2px 1px; margin-right:1px; border-radius:3px; border-bottom:3px solid transparent;
  box-decoration-break:clone; -webkit-box-decoration-break:clone; cursor:default; }
.tok:hover, .tok.hl { outline:2px solid #111; outline-offset:0; }
.tok.inv { background:repeating-linear-gradient(135deg,#eef0f3 0 4px,#e3e6ea 4px 8px);
  color:#9ca3af; font-style:italic; }
.tok.segstart { border-left:2px dashed #475569; padding-left:2px; margin-left:2px; }
.tok.onset { border-left:3px solid #111; padding-left:2px; margin-left:3px;
  border-top-left-radius:0; border-bottom-left-radius:0; }
.tok.sample { padding:0 4px; }
.ws { opacity:.45; }
.tok .ws { font-style:normal; }
.empty { color:var(--muted); font-style:italic; }
.chart-key { margin:14px 0 2px; font-size:12px; color:var(--muted); display:flex; gap:16px;
  flex-wrap:wrap; }
.l-kl { color:#cb181d; } .l-ent { color:#2171b5; } .l-w { color:#4d9221; } .l-inv { color:#9ca3af; }
.chart { width:100%; height:130px; background:var(--card); border:1px solid var(--line);
  border-radius:8px; }
.axis { position:relative; height:16px; font-size:11px; color:var(--muted); }
.axis span { position:absolute; transform:translateX(-50%); }
.chart polyline { fill:none; stroke-width:1.6; vector-effect:non-scaling-stroke; }
.chart line { vector-effect:non-scaling-stroke; }
.tip { position:fixed; z-index:10; pointer-events:none; background:#111827; color:#f9fafb;
  border-radius:8px; padding:8px 10px; font-size:12px; box-shadow:0 6px 20px rgba(0,0,0,.25);
  max-width:340px; }
.tip table { border-collapse:collapse; font-variant-numeric:tabular-nums; }
.tip td { padding:1px 6px 1px 0; } .tip td:first-child { color:#9ca3af; }
.tip .tt { font:13px ui-monospace, Menlo, Consolas, monospace; background:#374151;
  border-radius:4px; padding:1px 5px; word-break:break-all; }
"""

JS = r"""
(function () {
  "use strict";
  const data = JSON.parse(document.getElementById("credit-data").textContent);
  const recs = data.records, cfg = data.config;
  const $ = (id) => document.getElementById(id);
  const SVG = "http://www.w3.org/2000/svg";
  let cur = 0, mode = "kl";
  if (!recs.length) return;

  const hex = (c) => [1, 3, 5].map((k) => parseInt(c.slice(k, k + 2), 16));
  function ramp(stops, u) {
    u = Math.min(Math.max(u, 0), 1) * (stops.length - 1);
    const i = Math.min(Math.floor(u), stops.length - 2), f = u - i;
    const a = hex(stops[i]), b = hex(stops[i + 1]);
    return a.map((x, k) => Math.round(x + (b[k] - x) * f));
  }
  function wpos(w) {
    if (w <= 0) return 0;
    const u = w < 1 ? -Math.log(w) / Math.log(cfg.wLo) : Math.log(w) / Math.log(cfg.wHi);
    return (Math.min(Math.max(u, -1), 1) + 1) / 2;
  }
  const KEY = { kl: "kl_norm", entropy: "entropy_norm", weight: "weight" };
  function colour(r, i) {
    if (!r.valid[i]) return null;
    const v = r[KEY[mode]][i];
    if (v === null || v === undefined) return null;
    return ramp(cfg.scales[mode], mode === "weight" ? wpos(v) : v);
  }
  const segColour = (s) => cfg.segColours[s % cfg.segColours.length];

  function addText(el, text) {
    if (text === "") { ws(el, "∅"); return; }
    for (const part of text.split(/( |\n|\t|\r)/)) {
      if (part === " ") ws(el, "·");
      else if (part === "\n") { ws(el, "↵"); el.appendChild(document.createTextNode("\n")); }
      else if (part === "\t") { ws(el, "⇥"); el.appendChild(document.createTextNode("\t")); }
      else if (part === "\r") ws(el, "␍");
      else if (part) el.appendChild(document.createTextNode(part));
    }
  }
  function ws(el, sym) {
    const s = document.createElement("span"); s.className = "ws"; s.textContent = sym;
    el.appendChild(s);
  }

  function renderTokens(r) {
    const box = $("tokens"); box.textContent = "";
    r.tokens.forEach((t, i) => {
      const s = document.createElement("span"), seg = r.segment_id[i];
      s.className = "tok"; s.dataset.i = i;
      if (!r.valid[i]) s.classList.add("inv");
      if (r.onset[i]) s.classList.add("onset");
      if (seg >= 0) {
        s.classList.add("seg", "seg-" + seg);
        if (i === 0 || r.segment_id[i - 1] !== seg) s.classList.add("segstart");
        s.style.borderBottomColor = segColour(seg);
      }
      const c = colour(r, i);
      if (c) {
        s.style.background = "rgb(" + c.join(",") + ")";
        if (0.299 * c[0] + 0.587 * c[1] + 0.114 * c[2] < 140) s.style.color = "#fff";
      }
      addText(s, t);
      box.appendChild(s);
    });
  }

  const fmt = (x, signed) => {
    if (x === null || x === undefined) return "–";
    const a = Math.abs(x), sign = signed && x >= 0 ? "+" : "";
    return sign + (a !== 0 && (a < 0.01 || a >= 1e4) ? Number(x).toExponential(2)
      : Number(x).toFixed(3));
  };
  function renderMeta(r) {
    const nValid = r.valid.filter(Boolean).length;
    const segs = new Set(r.segment_id.filter((s) => s >= 0)).size;
    const w = r.weight.filter((x, i) => r.valid[i] && x !== null);
    const cards = [
      ["method", String(r.method)], ["step · row", r.step + " · " + r.row],
      ["reward", fmt(r.reward)], ["advantage", fmt(r.advantage, true)],
      ["tokens (policy / all)", nValid + " / " + r.tokens.length],
      ["onsets · segments", r.onset.filter(Boolean).length + " · " + segs],
      ["weight min – max", w.length ? Math.min(...w).toFixed(2) + " – " +
        Math.max(...w).toFixed(2) : "–"],
    ];
    if (r.skipped) cards.push(["teacher", "skipped (advantage 0)"]);
    const meta = $("meta"); meta.textContent = "";
    for (const [k, v] of cards) {
      const c = document.createElement("div"); c.className = "card";
      const a = document.createElement("div"); a.className = "k"; a.textContent = k;
      const b = document.createElement("div"); b.className = "v"; b.textContent = v;
      c.append(a, b); meta.appendChild(c);
    }
    $("prompt").textContent = r.prompt || "";
  }

  function renderLegend() {
    const stops = cfg.scales[mode], L = $("legend"); L.textContent = "";
    const bar = document.createElement("div"); bar.className = "bar-grad";
    bar.style.background = "linear-gradient(to right, " + stops.join(", ") + ")";
    const ticks = document.createElement("div"); ticks.className = "ticks";
    const labels = mode === "weight" ? ["≤ " + cfg.wLo, "1", "≥ " + cfg.wHi] : ["0", "0.5", "1"];
    for (const t of labels) {
      const s = document.createElement("span"); s.textContent = t; ticks.appendChild(s);
    }
    const cap = document.createElement("div"); cap.className = "cap";
    cap.textContent = { kl: "normalised KL d̃ (row min–max)",
      entropy: "normalised entropy H̃ (row min–max)",
      weight: "weight w (log; < 1 less credit, > 1 more)" }[mode];
    L.append(bar, ticks, cap);
  }

  function el(tag, attrs) {
    const e = document.createElementNS(SVG, tag);
    for (const k in attrs) e.setAttribute(k, attrs[k]);
    return e;
  }
  function renderChart(r) {
    const svg = $("chart"), n = Math.max(r.tokens.length, 1), pad = 0.06;
    svg.textContent = "";
    svg.setAttribute("viewBox", "0 0 " + n + " 1");
    const y = (v) => 1 - pad - (1 - 2 * pad) * Math.min(Math.max(v, 0), 1);
    for (let i = 0; i < r.tokens.length; i++) {
      const seg = r.segment_id[i];
      if (!r.valid[i]) svg.appendChild(el("rect", { x: i, y: 0, width: 1, height: 1,
        fill: "#e5e7eb" }));
      else if (seg >= 0) svg.appendChild(el("rect", { x: i, y: 0, width: 1.02, height: 1,
        fill: segColour(seg), "fill-opacity": 0.2 }));
      if (r.onset[i]) svg.appendChild(el("line", { x1: i, x2: i, y1: 0, y2: 1,
        stroke: "#111", "stroke-width": 1.2 }));
    }
    const line = (key, colourName, scale, dash) => {  // one polyline per run of valid tokens
      let pts = [];
      const flush = () => {
        if (pts.length) {
          const p = el("polyline", { points: pts.join(" "), stroke: colourName });
          if (dash) p.setAttribute("stroke-dasharray", "4 3");
          svg.appendChild(p);
        }
        pts = [];
      };
      r[key].forEach((v, i) => {
        if (r.valid[i] && v !== null) pts.push((i + 0.5) + "," + y(v / scale));
        else flush();
      });
      flush();
    };
    line("weight", "#4d9221", cfg.wChart, true);
    line("entropy_norm", "#2171b5", 1, false);
    line("kl_norm", "#cb181d", 1, false);
    const cursor = el("line", { id: "cursor", x1: -5, x2: -5, y1: 0, y2: 1, stroke: "#f59e0b",
      "stroke-width": 2 });
    svg.appendChild(cursor);
    const axis = $("axis"); axis.textContent = "";
    const step = Math.max(1, Math.ceil(n / 10 / 5) * 5);
    for (let i = 0; i < n; i += step) {
      const t = document.createElement("span"); t.textContent = i;
      t.style.left = ((i + 0.5) / n * 100) + "%"; axis.appendChild(t);
    }
  }

  function render() {
    const r = recs[cur];
    renderMeta(r); renderTokens(r); renderLegend(); renderChart(r);
  }

  // selectors: steps, then the rows of the chosen step
  const steps = [...new Set(recs.map((r) => r.step))];
  for (const s of steps) $("step").add(new Option("step " + s, s));
  function fillRows(step) {
    const sel = $("row"); sel.textContent = "";
    recs.forEach((r, k) => {
      if (String(r.step) !== String(step)) return;
      sel.add(new Option("row " + r.row + "  ·  r=" + fmt(r.reward) + "  ·  A=" +
        fmt(r.advantage, true), k));
    });
  }
  function select(k) {
    cur = Math.min(Math.max(k, 0), recs.length - 1);
    $("step").value = String(recs[cur].step); fillRows(recs[cur].step);
    $("row").value = String(cur); render();
    history.replaceState(null, "", "#step=" + recs[cur].step + "&row=" + recs[cur].row +
      "&mode=" + mode);
  }
  $("step").addEventListener("change", (e) => {
    select(recs.findIndex((r) => String(r.step) === e.target.value));
  });
  $("row").addEventListener("change", (e) => select(Number(e.target.value)));
  $("prev").addEventListener("click", () => select(cur - 1));
  $("next").addEventListener("click", () => select(cur + 1));
  document.addEventListener("keydown", (e) => {
    if (e.target.tagName === "SELECT") return;
    if (e.key === "ArrowLeft") select(cur - 1);
    if (e.key === "ArrowRight") select(cur + 1);
  });
  for (const radio of document.querySelectorAll("input[name=mode]")) {
    radio.addEventListener("change", (e) => { mode = e.target.value; select(cur); });
  }

  // tooltip
  const tip = $("tip");
  function row(tbl, k, v) {
    const tr = tbl.insertRow(); tr.insertCell().textContent = k; tr.insertCell().textContent = v;
  }
  $("tokens").addEventListener("mousemove", (e) => {
    const s = e.target.closest(".tok");
    if (!s) { tip.hidden = true; return; }
    const r = recs[cur], i = Number(s.dataset.i);
    tip.textContent = "";
    const tt = document.createElement("div");
    const code = document.createElement("span"); code.className = "tt";
    code.textContent = JSON.stringify(r.tokens[i]);
    tt.append(code); tip.appendChild(tt);
    const tbl = document.createElement("table"); tip.appendChild(tbl);
    row(tbl, "position", i + (r.token_ids[i] !== null ? "   (id " + r.token_ids[i] + ")" : ""));
    if (!r.valid[i]) row(tbl, "type", "observation / tool (no credit)");
    row(tbl, "KL", fmt(r.kl[i])); row(tbl, "entropy", fmt(r.entropy[i]));
    row(tbl, "KL norm d̃", fmt(r.kl_norm[i])); row(tbl, "entropy norm H̃", fmt(r.entropy_norm[i]));
    row(tbl, "segment", r.segment_id[i] >= 0 ? String(r.segment_id[i]) +
      (r.onset[i] ? "  (onset)" : "") : (r.onset[i] ? "onset" : "–"));
    row(tbl, "weight w", fmt(r.weight[i])); row(tbl, "token adv Â", fmt(r.token_advantage[i], true));
    tip.hidden = false;
    const x = Math.min(e.clientX + 14, window.innerWidth - tip.offsetWidth - 8);
    const yy = e.clientY + 18 + tip.offsetHeight > window.innerHeight
      ? e.clientY - tip.offsetHeight - 12 : e.clientY + 18;
    tip.style.left = x + "px"; tip.style.top = yy + "px";
    const c = $("cursor");
    if (c) { c.setAttribute("x1", i + 0.5); c.setAttribute("x2", i + 0.5); }
  });
  $("tokens").addEventListener("mouseleave", () => { tip.hidden = true; });

  // start from the URL hash, e.g. #step=40&row=1&mode=weight
  const h = new URLSearchParams(location.hash.slice(1));
  if (KEY[h.get("mode")]) {
    mode = h.get("mode");
    document.querySelector("input[name=mode][value=" + mode + "]").checked = true;
  }
  const k = recs.findIndex((r) => String(r.step) === h.get("step") &&
    (h.get("row") === null || String(r.row) === h.get("row")));
  select(k >= 0 ? k : 0);
})();
"""
