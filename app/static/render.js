// The panels: everything on the page is rendered from S, at most every 40 ms, by looking each element up by id
// (Gradio may re-render a block at any time).
import { drawPlots } from './plots.js';
import { $, esc, fmt, pct, S } from './state.js';

export function note(text, kind = 'info') {
  S.messages.push({ text, kind, t: Date.now() });
  if (S.messages.length > 4) S.messages.shift();
  render();
}

let renderPending = false;
export function render() {
  if (renderPending) return;
  renderPending = true;
  setTimeout(() => {
    renderPending = false;
    try {
      renderAll();
    } catch (e) {
      console.error('specvoice render', e);
    }
  }, 40);
}

export function setText(id, text) {
  const el = $(id);
  if (el && el.textContent !== text) el.textContent = text;
}

function setHtml(id, html) {
  const el = $(id);
  if (el && el.dataset.html !== html) {
    el.innerHTML = html;
    el.dataset.html = html;
  }
}

function renderAll() {
  renderStatus();
  renderControls();
  renderMetrics();
  renderWaterfall();
  renderSpeedup();
  renderTranscript();
  renderAb();
  drawPlots();
}

function renderStatus() {
  const st = S.status;
  let text;
  let cls = 'loading';
  let progress = 0;
  if (!S.connected) text = 'Connecting to the server…';
  else if (!st) text = 'Waiting for the server…';
  else if (st.error) {
    text = `Model loading failed: ${st.error}`;
    cls = 'failed';
  } else if (!st.ready) {
    const secs = st.elapsed_s + (Date.now() - S.statusAt) / 1000;
    text = `Loading models — ${st.stage} (${secs.toFixed(0)} s). What you type or say now is answered when `
      + 'they are ready.';
    progress = Math.max(0, st.step) / st.steps;
    setTimeout(render, 1000); // keep the elapsed time ticking
  } else {
    const e = st.engine || {};
    text = `Ready — LLM ${e.llm}, K ${e.k}; ASR ${e.asr}; TTS ${e.tts}; ${st.end_of_turn}; `
      + (e.preemptive ? 'answers start at the pause; ' : '')
      + (e.prefill_while_speaking ? 'prefill while speaking; ' : '')
      + (e.opening_echo ? `openings ${e.opening_guesses ? 'guessed and ' : ''}drafted from the question; ` : '')
      + `first chunk ≤ ${e.first_chunk_words} words; loaded and warmed up in ${fmt(st.load_s, 1)} s`;
    cls = 'ready';
    progress = 1;
  }
  setText('model-steps', st ? st.step_s.map(([name, s]) => `${name} ${fmt(s, 1)} s`).join(' · ') : '');
  if (S.audioError) text += ` · ${S.audioError}`;
  else if (S.ctx && S.ctx.state === 'suspended') text += ' · click anywhere to enable sound';
  setText('model-status', text);
  const el = $('model-status');
  if (el) el.className = `sv-status ${cls}`;
  const bar = $('model-progress');
  if (bar) bar.value = progress;
  setHtml('sv-messages', S.messages.map((m) => `<div class="sv-msg sv-msg-${m.kind}">${esc(m.text)}</div>`)
    .join(''));
}

function renderControls() {
  const hf = $('handsfree');
  if (hf) {
    const on = S.micMode === 'handsfree';
    hf.setAttribute('aria-pressed', String(on));
    hf.classList.toggle('sv-on', on);
    setText('handsfree', `● Hands-free: ${on ? 'on' : 'off'}`);
  }
  const ptt = $('ptt');
  if (ptt) ptt.classList.toggle('sv-on', S.micMode === 'ptt');
  const level = $('mic-level');
  if (level) level.value = S.micMode ? S.micLevel : 0;
  setText('vad-state', S.micMode ? S.vad : 'mic off');
  setText('partial-transcript', S.partial ? `“${S.partial}”` : '');
  const st = S.status;
  const drafter = $('drafter');
  if (drafter && st && st.drafters) {
    for (const opt of drafter.options) opt.disabled = !st.drafters.includes(opt.value);
    if (!S.touched.has('drafter') && st.drafters.length && !st.drafters.includes(drafter.value)) {
      drafter.value = st.drafters[0];
    }
  }
  const k = $('k-policy');
  if (k && st && st.k && !S.touched.has('k-policy') && [...k.options].some((o) => o.value === st.k)) k.value = st.k;
  const temp = $('temperature');
  if (temp && st && st.temperature !== undefined && !S.touched.has('temperature')) temp.value = st.temperature;
  if (temp) setText('temperature-value', Number(temp.value).toFixed(1));
  const background = $('background');
  if (background && st && st.background !== undefined) {
    background.disabled = !st.batched;
    background.value = st.background; // the server's load, shared by every tab
    setText('background-value', String(st.background));
  }
  for (const [id, name] of [['export-report', 'report.html'], ['export-csv', 'turns.csv'],
    ['export-json', 'turns.json']]) {
    const a = $(id);
    if (a && S.exportBase) a.setAttribute('href', `${S.exportBase}/${name}`);
  }
}

function renderMetrics() {
  const t = S.turns[S.current];
  if (!t) return;
  const d = t.data;
  setText('ttfa-ms', d ? fmt(d.ttfa_ms) : '…');
  setText('stall-ms', d ? fmt(d.stall_ms) : '…');
  setText('ttfa-heard-ms', t.heard ? fmt(t.heard.ttfa_heard_ms) : (t.kind === 'ab' ? 'n/a' : '…'));
  setText('heard-delay-ms', t.heard ? fmt(t.heard.heard_delay_ms) : '–');
  setText('tokens-per-s', fmt(d ? d.tokens_per_s : t.tokensPerS, 1));
  if (!t.speculation) {
    setText('acceptance-rate', 'off');
    setText('tokens-per-forward', 'off');
  } else if (d) {
    setText('acceptance-rate', pct(d.draft_acceptance_rate));
    setText('tokens-per-forward', fmt(d.tokens_per_target_forward, 2));
  } else {
    setText('acceptance-rate', t.proposed ? pct(t.accepted / t.proposed) : '…');
    setText('tokens-per-forward', t.forwards ? fmt(t.emitted / t.forwards, 2) : '…');
  }
  setText('batch-size', t.batchSize ?? '–'); // of this answer's latest target forward
  setText('k-chosen', t.speculation ? (t.kChosen ?? '–') : 'off');
}

const SAVED_VERB = { preemptive: 'hidden' }; // a technique not named here ended the turn sooner

// What each technique saved this turn, for the keys the server sent; a negative saving waited longer than the plain
// silence rule would have. No prefill while speaking (a typed turn) says nothing.
function savedLine(d) {
  const parts = Object.entries(d?.saved_ms || {}).map(([label, ms]) => {
    const verb = ms < 0 ? 'later' : Object.hasOwn(SAVED_VERB, label) ? SAVED_VERB[label] : 'sooner';
    return `${label}: ${fmt(Math.abs(ms))} ms ${verb}`;
  });
  if (d?.prefilled_while_speaking_tokens > 0) {
    parts.push(`prefill while speaking: ${d.prefilled_while_speaking_tokens} tokens ready`);
  }
  return parts.join(' · ');
}

function renderWaterfall() {
  const t = S.turns[S.current];
  const d = t?.data;
  setText('waterfall-mode', t ? `turn ${t.turn}, speculation ${t.speculation ? 'on' : 'off'}` : '');
  setText('ttfa-saved', savedLine(d));
  const e = S.early;
  const running = e.started - e.kept - e.discarded;
  setText('early-answers', e.started + e.kept + e.discarded ? `early answers: ${e.kept} kept, ${e.discarded} thrown `
    + `away${running > 0 ? `, ${running} waiting for the turn's end` : ''}` : '');
  if (!d || !d.ttfa_ms) {
    const why = !d ? 'waiting for the first audio…' : d.cancelled ? 'interrupted before its first audio'
      : 'the answer had no audio';
    setHtml('waterfall', t ? `<div class="sv-def">${why}</div>` : '');
    return;
  }
  const heard = t.heard?.ttfa_heard_ms;
  const total = Math.max(d.ttfa_ms, heard || 0);
  let start = 0;
  const ended = d.timeline?.pauses?.find((p) => p.ended_turn);
  const rows = S.stages.map((name, i) => {
    const v = d.stages[name] || 0;
    const why = name === 'end_of_turn_wait' && ended ? ` title="${esc(ended.why)}"` : '';
    const row = `<div class="sv-wf-row"${why}><span class="sv-wf-label">${esc(name)}</span><span class="sv-wf-track">`
      + `<span class="sv-wf-bar sv-stage-${i}" style="left:${(100 * start) / total}%;width:${(100 * v) / total}%">`
      + `</span></span><span class="sv-wf-ms">${fmt(v)} ms</span></div>`;
    start += v;
    return row;
  });
  rows.push(`<div class="sv-wf-row sv-wf-total"><span class="sv-wf-label">TTFA</span><span class="sv-wf-track">`
    + `<span class="sv-wf-bar sv-wf-ttfa" style="left:0;width:${(100 * d.ttfa_ms) / total}%"></span></span>`
    + `<span class="sv-wf-ms">${fmt(d.ttfa_ms)} ms</span></div>`);
  if (heard) {
    rows.push(`<div class="sv-wf-row"><span class="sv-wf-label">heard</span><span class="sv-wf-track">`
      + `<span class="sv-wf-bar sv-wf-heard" style="left:${(100 * d.ttfa_ms) / total}%;`
      + `width:${(100 * Math.max(0, heard - d.ttfa_ms)) / total}%"></span></span>`
      + `<span class="sv-wf-ms">${fmt(heard)} ms</span></div>`);
  }
  rows.push(pausesLine(d.timeline?.pauses));
  setHtml('waterfall', rows.join(''));
}

const prob = (p) => (p === null || p === undefined ? '—' : p.toFixed(2));

// Why the end-of-turn bar is as long as it is: each pause's votes and the wait they chose.
function pausesLine(pauses) {
  if (!pauses?.length) return '';
  const items = pauses.map((p, i) => `pause ${i + 1}: Smart Turn ${prob(p.end_of_turn_probability)}, target `
    + `${prob(p.end_of_message_probability)} → wait ${fmt(p.wait_ms)} ms (${esc(p.why)})`
    + (p.ended_turn ? ', ended the turn' : `, you went on after ${fmt(p.silence_ms)} ms`)
    + (p.held_open ? (p.ended_turn ? ' once its answer could be heard' : ', before its answer could be heard') : ''));
  return `<div class="sv-sub">end of turn: ${items.join(' · ')}</div>`;
}

const turnsText = (n) => `${n} turn${n === 1 ? '' : 's'}`;

function median(xs) {
  const s = [...xs].sort((a, b) => a - b);
  const mid = Math.floor(s.length / 2);
  return s.length % 2 ? s[mid] : (s[mid - 1] + s[mid]) / 2;
}

// specdec.metrics' predicted_speedup and measured_speedup over the session's finished turns.
function speedups() {
  const done = S.order.map((id) => S.turns[id]).filter((t) => t.data);
  const on = done.filter((t) => t.speculation);
  const sum = (key) => on.reduce((total, t) => total + t[key], 0);
  const seen = sum('accepted') + sum('rejections');
  const alpha = seen ? sum('accepted') / seen : null;
  const k = sum('specSteps') ? Math.round(sum('proposed') / sum('specSteps')) : null;
  const ms = S.status?.forward_costs?.batch1_ms;
  const tokensPerForward = sum('forwards') ? sum('emitted') / sum('forwards') : null;
  const r = { alpha, k, turnsOn: on.length, tokensPerForward };
  if (alpha !== null && k && ms && k < ms.length) {
    r.e = alpha >= 1 ? k + 1 : (1 - alpha ** (k + 1)) / (1 - alpha);
    r.v = ms[k] / ms[0];
    r.predicted = r.e / r.v;
  }
  const rates = (spec) => done.filter((t) => t.speculation === spec && t.data.tokens_per_s)
    .map((t) => t.data.tokens_per_s);
  r.rateOn = rates(true);
  r.rateOff = rates(false);
  if (r.rateOn.length && r.rateOff.length) r.measured = median(r.rateOn) / median(r.rateOff);
  return r;
}

function renderSpeedup() {
  const fc = S.status?.forward_costs;
  const ms = fc?.batch1_ms;
  setText('verify-costs', ms ? `batch 1: ${fc.grid.per_sequence.map((n) => `${n} token${n > 1 ? 's' : ''} `
    + `${fmt(ms[n - 1], 1)} ms (v ${fmt(ms[n - 1] / ms[0], 2)})`).join(' · ')}`
    : 'no forward-cost grid: the app measures one only for its own engine with the load-aware K');
  const r = speedups();
  setText('speedup-predicted', r.predicted === undefined ? '–' : `${fmt(r.predicted, 2)}×`);
  setText('speedup-measured', r.measured === undefined ? '–' : `${fmt(r.measured, 2)}×`);
  setText('speedup-inputs', r.predicted === undefined ? (ms ? 'needs a finished turn with speculation on' : '')
    : `α ${fmt(r.alpha, 3)}, K ${r.k} over ${turnsText(r.turnsOn)} → E ${fmt(r.e, 3)} tokens `
      + `per forward (measured ${fmt(r.tokensPerForward, 2)}); v(${r.k + 1}) ${fmt(r.v, 3)}`);
  setText('speedup-rates', r.measured === undefined ? 'needs finished turns with speculation on and off'
    : `tokens/s ${fmt(median(r.rateOn), 1)} on (${turnsText(r.rateOn.length)}) ÷ ${fmt(median(r.rateOff), 1)} off `
      + `(${turnsText(r.rateOff.length)})`);
}

function renderTranscript() {
  const parts = S.order.slice(-50).map((id) => { // the export keeps them all
    const t = S.turns[id];
    const mode = `<span class="sv-mode sv-mode-${t.speculation ? 'on' : 'off'}">spec ${t.speculation ? 'on' : 'off'}`
      + `${t.kind === 'ab' ? ` · A/B ${t.ab}.${t.ab_repeat + 1}` : ''}</span>`;
    const spans = t.pieces.map(([text, draft]) => {
      const cls = draft === true ? 'tok-draft' : draft === false ? 'tok-target' : 'tok-unknown';
      return `<span class="${cls}">${esc(text)}</span>`;
    }).join('');
    const state = t.data ? (t.data.cancelled ? ' <em>(interrupted)</em>' : '') : ' <em>…</em>';
    const user = t.kind === 'ab' && t.ab_repeat + (t.speculation ? 1 : 0) > 0 ? ''
      : `<div class="sv-user"><b>You</b> (${esc(t.kind)}): ${esc(t.transcript)}</div>`;
    return `<div class="sv-turn" data-turn="${id}">${user}<div class="sv-agent"><b>Agent</b> ${mode} `
      + `${spans}${state}</div></div>`;
  });
  setHtml('transcript', parts.join(''));
  const el = $('transcript');
  if (el) el.scrollTop = el.scrollHeight;
}

function renderAb() {
  const parts = S.abOrder.slice().reverse().map((ab) => {
    const r = S.ab[ab];
    const s = r.summary;
    let head = `<div class="sv-ab-head"><b>A/B ${ab}</b> ${r.spoken ? 'spoken, replayed' : 'typed'} “${esc(r.text)}” — `;
    if (!r.finished) head += `running, ${r.done}/${r.repeats} pairs…`;
    else if (s?.n) {
      const ci = s.ratio_on_off_ci95;
      head += `TTFA on ÷ off: <b class="sv-ab-diff">${fmt(s.ratio_on_off_median, 2)}</b> `
        + (s.n > 1 ? `(median; 95% CI ${fmt(ci[0], 2)} to ${fmt(ci[1], 2)}, ${s.n} pairs)` : '(1 pair: no interval)');
    } else head += 'no complete pair';
    head += '</div>';
    const rows = (r.pairs || []).map((p) => `<tr><td>${p.repeat + 1}</td>`
      + `<td>${fmt(p.off.ttfa_ms)} <button class="sv-play" data-play="${p.off.turn}">▶</button></td>`
      + `<td>${fmt(p.on.ttfa_ms)} <button class="sv-play" data-play="${p.on.turn}">▶</button></td>`
      + `<td>${pct(p.on.draft_acceptance_rate)}</td></tr>`).join('');
    const table = rows ? `<table class="sv-ab-table"><tr><th>#</th><th>off TTFA ms</th><th>on TTFA ms</th>`
      + `<th>acceptance</th></tr>${rows}</table>` : '';
    return `<div class="sv-ab" data-ab="${ab}">${head}${table}</div>`;
  });
  setHtml('ab-results', parts.join(''));
}
