"""The page: Gradio builds it (a Voice tab and the Case study tab); the voice tab is plain HTML that
app/static/app.js fills and drives over the WebSocket, looking every element up by its id.
"""

from __future__ import annotations

import html
import importlib
import importlib.abc
import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

from pipeline.timeline import STAGES
from specdec.metrics import DEFINITIONS

if TYPE_CHECKING:
    import gradio

STATIC_DIR = Path(__file__).parent / "static"
K_CHOICES = tuple(range(1, 9))  # the K menu's fixed values, beside "adaptive"


class _NoStubRewrite(importlib.abc.MetaPathFinder):
    """Loads gradio.component_meta with its create_or_modify_pyi made a no-op. At import, every Gradio component
    class re-parses its module's source to rewrite its .pyi stub (a task for Gradio's developers): 1.3-1.9 s of each
    start here, measured. The stubs serve type checkers only; nothing at run time reads them."""

    MODULE = "gradio.component_meta"

    def find_spec(self, name: str, path: object = None, target: object = None) -> importlib.machinery.ModuleSpec | None:
        if name != self.MODULE:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def run(module: ModuleType) -> None:
            exec_module(module)
            if hasattr(module, "create_or_modify_pyi"):  # a Gradio that renamed it gets no new name (a test sees it)
                module.create_or_modify_pyi = lambda *args: None  # type: ignore[attr-defined]

        spec.loader.exec_module = run  # type: ignore[method-assign]
        return spec


def import_gradio() -> ModuleType:
    """gradio, imported without rewriting its type stubs (_NoStubRewrite)."""
    if "gradio" in sys.modules:
        return sys.modules["gradio"]
    finder = _NoStubRewrite()
    sys.meta_path.insert(0, finder)
    try:
        return importlib.import_module("gradio")
    finally:
        if finder in sys.meta_path:  # a gradio without that module: leave the import system as it was
            sys.meta_path.remove(finder)


def _definition(name: str) -> str:
    return f'<div class="sv-def">{html.escape(DEFINITIONS[name])}</div>'


def controls_html(max_text_chars: int, max_ab_repeats: int, max_background: int) -> str:
    return _talk_controls_html(max_text_chars) + _run_controls_html(max_text_chars, max_ab_repeats, max_background)


def _talk_controls_html(max_text_chars: int) -> str:
    """The status, the microphone and the text box, the speculation controls."""
    k_options = "".join(f'<option value="{k}">{k}</option>' for k in ("adaptive", *map(str, K_CHOICES)))
    return f"""
<div class="sv-card" id="sv-status-card">
  <div id="model-status" class="sv-status">Connecting…</div>
  <progress id="model-progress" max="1" value="0"></progress>
  <div id="model-steps" class="sv-def"></div>
  <div id="sv-messages" role="status" aria-live="polite"></div>
</div>
<div class="sv-card">
  <h3>Talk</h3>
  <div class="sv-row">
    <button id="handsfree" class="sv-btn" aria-pressed="false">● Hands-free: off</button>
    <button id="ptt" class="sv-btn">Hold to talk</button>
    <button id="stop-answer" class="sv-btn sv-secondary">Stop</button>
  </div>
  <div class="sv-row"><meter id="mic-level" min="0" max="0.3" value="0"></meter>
    <span id="vad-state">mic off</span></div>
  <div id="partial-transcript"></div>
  <div class="sv-row">
    <input id="text-input" type="text" maxlength="{max_text_chars}" placeholder="…or type a message, Enter sends"
      autocomplete="off">
    <button id="send-text" class="sv-btn">Send</button>
  </div>
</div>
<div class="sv-card">
  <h3>Speculative decoding</h3>
  <label class="sv-switch"><input type="checkbox" id="speculation" checked> speculation</label>
  <label>drafter <select id="drafter"><option value="draft-model">draft model</option>
    <option value="heads">draft heads</option><option value="ngram">n-gram</option></select></label>
  <label>K <select id="k-policy">{k_options}</select></label>
  <label class="sv-switch"><input type="checkbox" id="load-aware" checked> load-aware K</label>
  <label>temperature <input id="temperature" type="range" min="0" max="1.5" step="0.1" value="0">
    <output id="temperature-value">0.0</output></label>
</div>
"""


def _run_controls_html(max_text_chars: int, max_ab_repeats: int, max_background: int) -> str:
    """The background load, the A/B, the export."""
    return f"""
<div class="sv-card" id="sv-load-card">
  <h3>Load: other conversations at once</h3>
  <label>background conversations <input id="background" type="range" min="0" max="{max_background}" step="1"
    value="0">
    <output id="background-value">0</output></label>
  <div class="sv-def">Simulated users answering prompts back to back on this server, batched with yours into the
    same target forwards. One user: drafts ride a memory-bound forward nearly free. Many: every drafted token costs
    compute, and the load-aware K drops drafts where the measured forward costs say they lose (untick "load-aware
    K" to draft your K whatever the load).</div>
</div>
<div class="sv-card">
  <h3>A/B: the same utterance, speculation off vs on</h3>
  <div class="sv-row">
    <input id="ab-text" type="text" maxlength="{max_text_chars}" placeholder="(the last utterance)">
    <label>× <input id="ab-repeats" type="number" min="1" max="{max_ab_repeats}" value="3"></label>
    <button id="ab-run" class="sv-btn">Run A/B</button>
  </div>
  <div class="sv-def">Each run starts from the same conversation state (KV cache rolled back to the system prompt,
    A/B turns not remembered); the order alternates. A spoken utterance is replayed in real time through VAD and ASR,
    so its TTFA has every stage; typed text starts when it is submitted (no VAD/ASR).</div>
  {_definition("ttfa_ratio_on_off")}
  <div id="ab-results"></div>
</div>
<div class="sv-card">
  <h3>Export</h3>
  <div class="sv-row"><a id="export-report" class="sv-btn" href="#" download="specvoice-report.html">Report (HTML)</a>
    <a id="export-csv" href="#" download="specvoice-turns.csv">CSV</a>
    <a id="export-json" href="#" download="specvoice-turns.json">JSON</a></div>
</div>"""


def panels_html() -> str:
    legend = "".join(f'<span class="sv-stage sv-stage-{i}">{html.escape(name)}</span>' for i, name in enumerate(STAGES))
    return f"""
<div class="sv-metrics">
  <div class="sv-metric"><div class="sv-label">TTFA (server)</div>
    <div class="sv-value"><span id="ttfa-ms">–</span> <small>ms</small></div>{_definition("ttfa_ms")}
    <div class="sv-sub">stalls <span id="stall-ms">–</span> ms</div>{_definition("stall_ms")}</div>
  <div class="sv-metric"><div class="sv-label">TTFA (heard)</div>
    <div class="sv-value"><span id="ttfa-heard-ms">–</span> <small>ms</small></div>
    <div class="sv-sub">heard delay <span id="heard-delay-ms">–</span> ms</div>{_definition("heard_delay_ms")}</div>
  <div class="sv-metric"><div class="sv-label">tokens/s</div>
    <div class="sv-value"><span id="tokens-per-s">–</span></div>{_definition("tokens_per_s")}</div>
  <div class="sv-metric"><div class="sv-label">draft acceptance rate</div>
    <div class="sv-value"><span id="acceptance-rate">–</span></div>{_definition("draft_acceptance_rate")}</div>
  <div class="sv-metric"><div class="sv-label">tokens per target forward</div>
    <div class="sv-value"><span id="tokens-per-forward">–</span></div>{_definition("tokens_per_target_forward")}</div>
  <div class="sv-metric"><div class="sv-label">batch size</div>
    <div class="sv-value"><span id="batch-size">–</span></div>{_definition("batch_size")}</div>
  <div class="sv-metric"><div class="sv-label">K chosen</div>
    <div class="sv-value"><span id="k-chosen">–</span></div>{_definition("k_chosen")}</div>
</div>
<div class="sv-card"><h3>Where the TTFA went <small id="waterfall-mode"></small></h3>
  <div id="waterfall"></div><div id="ttfa-saved" class="sv-sub"></div><div id="early-answers" class="sv-sub"></div>
  <div class="sv-legend">{legend}</div>{_definition("end_of_turn_probability")}
  {_definition("end_of_message_probability")}
  {_definition("held_open")}</div>
<div class="sv-card" id="sv-story"><h3>Why speculation pays here, or not</h3>
  <div class="sv-plots">
    <div><canvas id="plot-verify" width="460" height="200"></canvas>
      <div id="verify-costs" class="sv-sub"></div>{_definition("verify_cost_curve")}</div>
    <div>
      <div class="sv-metric"><div class="sv-label">predicted speedup</div>
        <div class="sv-value"><span id="speedup-predicted">–</span></div>
        <div id="speedup-inputs" class="sv-sub"></div>{_definition("predicted_speedup")}</div>
      <div class="sv-metric"><div class="sv-label">measured speedup</div>
        <div class="sv-value"><span id="speedup-measured">–</span></div>
        <div id="speedup-rates" class="sv-sub"></div>{_definition("measured_speedup")}</div>
    </div>
  </div>
  <p class="sv-story">Speculation lets one target forward check K drafted tokens at once. That pays when the forward
    costs about what a one-token step costs: a memory-bound target (a GPU serving one user) spends each forward
    reading its weights, however many tokens it feeds, so v(n) stays near 1 and the speedup approaches the tokens per
    forward E. A compute-bound target (this CPU's int8 matrix multiplies, or a GPU under a large batch) pays arithmetic
    for every token it feeds, so v(n) climbs towards n: each verified draft costs a fraction of a forward, drafts pay
    less, and rejected ones are pure cost. The curve is this machine's, measured at start; the predicted speedup
    puts it together with your turns' acceptance, the measured one is what your turns got.</p>
</div>
<div class="sv-plots">
  <div class="sv-card"><h3>This answer, per target step</h3><canvas id="plot-steps" width="460" height="200">
    </canvas></div>
  <div class="sv-card"><h3>TTFA per turn</h3><canvas id="plot-ttfa" width="460" height="200"></canvas></div>
</div>
<div class="sv-card"><h3>Transcript</h3>
  <div class="sv-legend"><span class="tok-draft">from an accepted draft</span>
    <span class="tok-target">from the target</span><span class="tok-unknown">not reported</span></div>
  <div id="transcript"></div></div>"""


def head_html(static_path: str) -> str:
    """The page's stylesheet and its entry module (which imports the other modules next to it)."""
    return (
        f'<link rel="stylesheet" href="{static_path}/app.css">'
        f'<script type="module" src="{static_path}/app.js"></script>'
    )


def build_blocks(max_text_chars: int, max_ab_repeats: int, max_background: int) -> gradio.Blocks:
    from .casestudy import build_tab

    gr = import_gradio()

    with gr.Blocks(title="specvoice") as demo:
        with gr.Tab("Voice agent"):
            with gr.Row(equal_height=False):
                with gr.Column(scale=2, min_width=320):
                    controls = controls_html(max_text_chars, max_ab_repeats, max_background)
                    gr.HTML(controls, elem_id="sv-controls", js_on_load=None)
                with gr.Column(scale=3, min_width=420):
                    gr.HTML(panels_html(), elem_id="sv-panels", js_on_load=None)
        build_tab()
    return demo
