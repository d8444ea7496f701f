"""The app in real headless Chromium: speech from a fake microphone in, answer audio out through the worklet,
live panels, the speculation switch, typed turns, A/B runs, the export, and the heard delay.

Chromium's fake capture device plays an espeak-ng recording, padded with silence, once each time a page opens the
microphone; the server runs in-process with the tiny random engine (gibberish answers, real ASR and TTS).
"""

from __future__ import annotations

import json
import math
import os
import statistics
import threading

import pytest

from app.server import ModelLoader
from specdec.cost_grid import measure_forward_costs
from specdec.metrics import expected_tokens_per_step
from tests.support.browser import CHROMIUM, CHROMIUM_ARGS, gated_build, running_app, utterance_wav, wait_ready
from tests.support.speech import needs_espeak

pytestmark = [
    pytest.mark.browser,
    pytest.mark.models,  # real ASR and TTS behind the page
    needs_espeak,
    pytest.mark.skipif(not os.path.exists(CHROMIUM), reason="Debian chromium is not installed"),
]
playwright = pytest.importorskip("playwright.sync_api")

QUESTION = "What is the capital of France?"
SCREENSHOT = "/tmp/specvoice_app.png"
VOICE_TURN = "Object.values(specvoice.turns).find(t => t.kind === 'voice')"  # the one question the microphone asks


@pytest.fixture(scope="module")
def app():
    with running_app() as running:
        wait_ready(running)
        yield running


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    wav = tmp_path_factory.mktemp("audio") / "question.wav"
    utterance_wav(wav, QUESTION)
    with playwright.sync_playwright() as p:
        # %noloop: a looping file asks again ~4 s after the question ends, a barge-in that cancels an answer not
        # heard yet, so a spoken turn would be answered only if it beat that hidden deadline (a cold first run did not).
        b = p.chromium.launch(
            executable_path=CHROMIUM, args=[*CHROMIUM_ARGS, f"--use-file-for-fake-audio-capture={wav}%noloop"]
        )
        yield b
        b.close()


@pytest.fixture
def page(browser, app):
    context = browser.new_context(viewport={"width": 1400, "height": 1000}, accept_downloads=True)
    page = context.new_page()
    errors: list = []
    page.on("pageerror", lambda e: errors.append(e))
    page.goto(app.url)
    page.wait_for_function("window.specvoice && specvoice.status && specvoice.status.ready", timeout=30_000)
    yield page
    context.close()
    assert not errors, f"page errors: {errors}"


def last_turn(page) -> dict:
    return page.evaluate(
        "(() => { const t = specvoice.turns[specvoice.current]; "
        "return {...t, pieces: t.pieces.length, steps: t.steps.length}; })()"
    )


def typed_turn(page, text: str, heard: bool = True) -> dict:
    before = page.evaluate("specvoice.order.length")
    page.fill("#text-input", text)
    page.press("#text-input", "Enter")
    cond = "t.data" + (" && t.heard" if heard else "")
    page.wait_for_function(
        f"specvoice.order.length > {before} && (t => {cond})(specvoice.turns[specvoice.current])", timeout=30_000
    )
    return last_turn(page)


def number(page, selector: str) -> float:
    return float(page.inner_text(selector).replace("%", ""))


def test_loading_progress_and_a_question_asked_meanwhile(browser):
    gate = threading.Event()
    with running_app(build=gated_build(gate)) as app:
        context = browser.new_context(viewport={"width": 1400, "height": 1000})
        page = context.new_page()
        errors: list = []
        page.on("pageerror", lambda e: errors.append(e))
        page.goto(app.url)
        page.wait_for_selector("#model-status:has-text('step 1/')")
        assert "Loading models" in page.inner_text("#model-status")
        page.fill("#text-input", "Are you there?")
        page.press("#text-input", "Enter")
        page.wait_for_selector("#sv-messages:has-text('Queued')")
        gate.set()
        page.wait_for_function("(t => t && t.data)(Object.values(specvoice.turns)[0])", timeout=60_000)
        turns = page.evaluate("Object.values(specvoice.turns).map(t => t.transcript)")
        assert turns == ["Are you there?"] and page.inner_text("#model-status").startswith("Ready")
        steps = page.inner_text("#model-steps")  # how long each step took, warm-up included
        assert all(f"{step} " in steps for step in ModelLoader.STEPS), steps
        context.close()
    assert not errors, f"page errors: {errors}"


def test_spoken_turn_is_answered_heard_and_measured(page):
    page.click("#handsfree")
    page.wait_for_function(f"(t => t && t.data && t.heard)({VOICE_TURN})", timeout=45_000)
    page.click("#handsfree")
    turn = page.evaluate(VOICE_TURN)
    words = turn["transcript"].lower()
    assert "capital" in words and "france" in words, turn["transcript"]
    page.wait_for_function("specvoice.framesPlayed > 0", timeout=10_000)  # the worklet played answer audio
    page.wait_for_timeout(300)  # one render tick
    data = turn["data"]
    assert data["ttfa_ms"] > 0 and data["audio_seconds"] > 0
    # The stages are consecutive differences of the turn's marks: they add up to its TTFA, and a spoken turn's
    # final transcript came after its end was decided.
    assert abs(sum(data["stages"].values()) - data["ttfa_ms"]) < 1 and data["stages"]["asr"] > 0
    assert number(page, "#ttfa-ms") > 0 and number(page, "#tokens-per-s") > 0
    assert number(page, "#stall-ms") >= 0
    assert number(page, "#ttfa-heard-ms") >= number(page, "#ttfa-ms")
    # The acceptance shown is the turn's own: accepted ÷ proposed over the token messages it streamed.
    assert turn["proposed"] > 0 and data["draft_acceptance_rate"] == turn["accepted"] / turn["proposed"]
    assert abs(number(page, "#acceptance-rate") - 100 * turn["accepted"] / turn["proposed"]) <= 0.5
    assert "capital" in page.inner_text("#transcript").lower()
    assert page.locator("#transcript .tok-draft").count() > 0 and page.locator("#transcript .tok-target").count() > 0
    assert page.locator("#waterfall .sv-wf-row").count() >= 6  # five stages, TTFA (and heard)
    assert "accepted draft tokens" in page.inner_text("#sv-panels")  # the definition from specdec.metrics
    # the answer was started at the pause and kept: the page says what that hid
    assert "preemptive:" in page.inner_text("#ttfa-saved") and "kept" in page.inner_text("#early-answers")
    page.screenshot(path=SCREENSHOT, full_page=True)


def test_ab_replays_the_spoken_utterance_through_vad_and_asr(page):
    page.click("#handsfree")
    page.wait_for_function(f"(t => t && t.data)({VOICE_TURN})", timeout=45_000)
    page.click("#handsfree")
    page.fill("#ab-repeats", "1")
    page.click("#ab-run")  # no text: the last utterance, which was spoken
    page.wait_for_selector("#ab-results .sv-ab-diff", timeout=60_000)
    result = page.evaluate("Object.values(specvoice.ab)[0]")
    assert result["spoken"] and "spoken, replayed" in page.inner_text("#ab-results")
    for run in (result["pairs"][0]["off"], result["pairs"][0]["on"]):
        assert "capital" in run["transcript"].lower()  # heard again by the ASR, not copied
        assert run["stages"]["end_of_turn_wait"] > 0 and run["stages"]["asr"] > 0
        assert abs(sum(run["stages"].values()) - run["ttfa_ms"]) < 1


def test_push_to_talk(page, app):
    page.hover("#ptt")  # waits until the button is stable: a box read at once may be stale after the first render
    page.mouse.down()
    # Hold until the streaming ASR has heard the whole question (asked once the microphone opens), then release.
    try:
        page.wait_for_function("specvoice.partial.toLowerCase().includes('france')", timeout=20_000)
    except playwright.TimeoutError:  # once in CI: say what the page and the server were doing
        state = page.evaluate(
            "({partial: specvoice.partial, vad: specvoice.vad, pttHeld: specvoice.pttHeld, micMode: specvoice.micMode, "
            "framesSent: specvoice.framesSent, messages: specvoice.messages})"
        )
        pytest.fail(f"no partial transcript with 'france' in 20 s: {state}; free answer slots: {app.server.slots.free}")
    page.mouse.up()
    page.wait_for_function(f"(t => t && t.data)({VOICE_TURN})", timeout=30_000)
    turn = page.evaluate(VOICE_TURN)
    assert "france" in turn["transcript"].lower() and turn["data"]["ttfa_ms"] > 0
    assert page.evaluate("specvoice.micMode") is None and page.inner_text("#vad-state") == "mic off"


def test_speculation_switch_and_typed_input(page):
    page.uncheck("#speculation")
    off = typed_turn(page, "Tell me a short story.", heard=False)
    assert off["kind"] == "typed" and off["speculation"] is False
    assert off["data"]["draft_acceptance_rate"] is None
    page.wait_for_timeout(200)
    assert page.inner_text("#acceptance-rate") == "off"
    assert "Tell me a short story." in page.inner_text("#transcript")
    page.check("#speculation")
    on = typed_turn(page, "And another one.", heard=False)
    assert on["speculation"] is True and on["data"]["draft_acceptance_rate"] is not None
    page.wait_for_timeout(200)
    assert page.inner_text("#acceptance-rate").endswith("%")
    page.select_option("#drafter", "ngram")
    page.select_option("#k-policy", "2")
    ngram = typed_turn(page, "One more.", heard=False)
    settings = {"speculation": True, "drafter": "ngram", "k": "2", "temperature": None, "load_aware": None}
    assert ngram["data"]["settings"] == settings
    page.wait_for_timeout(200)  # the panels of the batch: this tab alone, and the K its last step asked for
    assert page.inner_text("#batch-size") == "1" and page.inner_text("#k-chosen").isdigit()
    page.uncheck("#load-aware")
    own = typed_turn(page, "Last one.", heard=False)
    assert own["data"]["settings"]["load_aware"] is False


def test_ab_run_gives_paired_results(page):
    page.fill("#ab-text", "Name a colour.")
    page.fill("#ab-repeats", "2")
    page.click("#ab-run")
    page.wait_for_selector("#ab-results .sv-ab-diff", timeout=60_000)
    result = page.evaluate("Object.values(specvoice.ab)[0]")
    assert len(result["pairs"]) == 2 and result["summary"]["n"] == 2
    for pair in result["pairs"]:
        assert pair["off"]["ttfa_ms"] > 0 and pair["on"]["ttfa_ms"] > 0
        assert pair["on"]["draft_acceptance_rate"] is not None
    assert "95% CI" in page.inner_text("#ab-results")
    assert page.locator("#ab-results button.sv-play").count() == 4
    played = page.evaluate("specvoice.framesPlayed")
    page.locator("#ab-results button.sv-play").first.click()  # both answers stay playable
    page.wait_for_function(f"specvoice.framesPlayed > {played}", timeout=10_000)


def test_export_downloads_a_report(page, tmp_path):
    typed_turn(page, "Hello there.", heard=False)
    with page.expect_download() as download:
        page.click("#export-report")
    path = tmp_path / "report.html"
    download.value.save_as(path)
    text = path.read_text()
    assert "specvoice session report" in text and "data:image/png;base64," in text and "Hello there." in text
    with page.expect_download() as download:
        page.click("#export-csv")
    assert "ttfa_ms" in download.value.path().read_text().splitlines()[0]


def test_heard_delay_over_five_turns(page, app):
    """Every turn is reported heard, after its server-side first audio, with figures the page and the server agree
    on. How long the delay is, is measured by `specvoice bench-heard`, not asserted here."""
    session = app.server.sessions[page.evaluate("specvoice.token")]
    for i in range(5):
        turn = typed_turn(page, f"Question number {i + 1}, please answer.")
        heard, data = turn["heard"], turn["data"]
        report = page.evaluate(f"specvoice.heardReports.find(r => r.turn === {turn['turn']})")
        assert report and report["method"] in ("getOutputTimestamp", "currentTime+outputLatency"), report
        record = next(t for t in session.turns if t["turn"] == turn["turn"])
        assert math.isfinite(heard["heard_delay_ms"]) and heard["heard_delay_ms"] >= 0, heard
        assert heard["ttfa_heard_ms"] >= record["ttfa_ms"] > 0, (heard, record["ttfa_ms"])
        assert data["ttfa_ms"] == record["ttfa_ms"] and heard["heard_method"] == report["method"]
        for key in ("heard_delay_ms", "ttfa_heard_ms", "heard_method", "clock_rtt_ms"):
            assert heard[key] == record[key], key


def test_load_control_starts_and_stops_background_conversations(page):
    def slide(n: int) -> None:
        page.eval_on_selector(
            "#background", f"el => {{ el.value = {n}; el.dispatchEvent(new Event('change', {{bubbles: true}})); }}"
        )
        page.wait_for_function(f"document.querySelector('#background-value').textContent === '{n}'", timeout=10_000)
        page.wait_for_function(f"specvoice.status && specvoice.status.background === {n}", timeout=10_000)

    slide(2)
    busy = typed_turn(page, "Hello again.", heard=False)
    assert busy["data"]["answer"]
    page.wait_for_timeout(200)
    assert page.inner_text("#batch-size").isdigit()
    batches = page.evaluate("specvoice.turns[specvoice.current].steps.map((s) => s.batchSize)")
    assert max(batches) == 3  # this tab and the two simulated conversations shared forwards
    slide(0)


@pytest.fixture
def measured_grid(app):
    """A forward-cost grid measured now on the tiny engine, as the app's warm-up measures one with the load-aware K on
    (the tiny app config has it off). A tab that keeps the load-aware K then drafts nothing on the tiny engine."""
    scheduler = app.server.loader.agent.llm.scheduler
    scheduler.costs = measure_forward_costs(scheduler.engine, batches=(1, 2, 4), trials=1)
    yield scheduler.costs
    scheduler.costs = None


def test_the_page_tells_the_latency_story(measured_grid, page):
    frames: list[dict] = []  # what the server said, read off the wire: the page's figures are checked against it
    page.on(
        "websocket", lambda ws: ws.on("framereceived", lambda f: isinstance(f, str) and frames.append(json.loads(f)))
    )
    page.reload()
    page.wait_for_function("window.specvoice && specvoice.status && specvoice.status.ready", timeout=30_000)
    page.wait_for_selector("#model-status:has-text('Ready')")
    assert "undefined" not in page.inner_text("#model-status")  # the configuration the server describes, in words
    costs = page.evaluate("specvoice.status.forward_costs")
    assert costs["grid"] == json.loads(json.dumps(measured_grid.as_dict()))
    assert costs["batch1_ms"] == pytest.approx(
        [1000 * measured_grid(1, n) for n in range(1, len(costs["batch1_ms"]) + 1)]
    )
    page.wait_for_function("document.getElementById('verify-costs').textContent.startsWith('batch 1')")
    # The curve is drawn: the batch-1 line in its own colour, which nothing else on that canvas uses.
    drawn = page.evaluate("""() => {
      const rgb = getComputedStyle(document.documentElement).getPropertyValue('--sv-rate').trim().match(/\\w\\w/g)
        .map((h) => parseInt(h, 16));
      const c = document.getElementById('plot-verify');
      const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
      let n = 0;
      for (let i = 0; i < d.length; i += 4) if (d[i] === rgb[0] && d[i + 1] === rgb[1] && d[i + 2] === rgb[2]) n++;
      return n;
    }""")
    assert drawn > 50, drawn
    shown = page.inner_text("#verify-costs")
    assert shown.startswith(f"batch 1: 1 token {costs['batch1_ms'][0]:.1f} ms (v 1.00) · 2 tokens "), shown

    page.uncheck("#load-aware")  # this tab drafts its K, so there is an acceptance to predict from
    page.uncheck("#speculation")
    typed_turn(page, "Tell me a short story.", heard=False)
    page.check("#speculation")
    typed_turn(page, "And another one.", heard=False)
    page.wait_for_timeout(200)

    # The same figures from the wire: specdec.metrics' alpha and mean_k over the speculation-on turn, then E / v(K + 1).
    on = {m["turn"] for m in frames if m["type"] == "turn" and m["speculation"]}
    steps = [m for m in frames if m["type"] == "token" and m["turn"] in on]
    accepted = sum(m["accepted"] for m in steps)
    alpha = accepted / (accepted + sum(m["accepted"] < m["drafted"] for m in steps))
    k = math.floor(sum(m["drafted"] for m in steps) / sum(m["k_chosen"] > 0 for m in steps) + 0.5)
    predicted = expected_tokens_per_step(alpha, k) / (costs["batch1_ms"][k] / costs["batch1_ms"][0])
    assert float(page.inner_text("#speedup-predicted").rstrip("×")) == pytest.approx(predicted, abs=0.006)
    assert f"α {alpha:.3f}, K {k} over 1 turn" in page.inner_text("#speedup-inputs")
    rates = {m["turn"]: m["data"]["tokens_per_s"] for m in frames if m["type"] == "done"}
    measured = statistics.median(r for t, r in rates.items() if t in on) / statistics.median(
        r for t, r in rates.items() if t not in on
    )
    assert float(page.inner_text("#speedup-measured").rstrip("×")) == pytest.approx(measured, abs=0.006)

    # What each technique saved, and the early answers: nothing shown until the server sends them.
    assert page.inner_text("#ttfa-saved") == "" and page.inner_text("#early-answers") == ""
    inject = "m => specvoice.ws.onmessage({data: JSON.stringify(m)})"  # as if the server had sent it
    for message in (
        {"type": "early", "event": "started", "text": "what is"},
        {"type": "early", "event": "discarded", "text": "what is"},
        {"type": "early", "event": "started", "text": "what is the time"},
        {"type": "early", "event": "kept", "text": "what is the time"},
        {"type": "early", "event": "started", "text": "and"},
        {"type": "early", "event": "constructor"},  # neither an event nor a type it knows breaks the page
        {"type": "from-the-future", "value": 1},
    ):
        page.evaluate(inject, message)
    turn = page.evaluate("specvoice.current")
    data = page.evaluate("specvoice.turns[specvoice.current].data")
    saved = {"preemptive": 290.0, "turn end by words": 80.0, "longer pause": -40.4}
    done = {**data, "saved_ms": saved, "prefilled_while_speaking_tokens": 14}
    page.evaluate(inject, {"type": "done", "turn": turn, "data": done})
    page.wait_for_timeout(200)
    assert page.inner_text("#ttfa-saved") == (
        "preemptive: 290 ms hidden · turn end by words: 80 ms sooner · longer pause: 40 ms later · "
        "prefill while speaking: 14 tokens ready"
    )
    assert page.inner_text("#early-answers") == "early answers: 1 kept, 1 thrown away, 1 waiting for the turn's end"
