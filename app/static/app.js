// specvoice page script: one WebSocket per tab carries mic PCM up, answer PCM and live metrics down.
// Panels are plain HTML inside Gradio's gr.HTML blocks; everything is looked up by id at render time and all
// events are delegated to the document, so it keeps working if Gradio re-renders a block.
(() => {
  'use strict';
  const script = document.currentScript;
  const WORKLETS = (script && script.dataset.worklets) || '/specvoice/static/worklets.js';
  const HEADER_BYTES = 28; // app/server.py AUDIO_HEADER
  const FLAG_REPLAY = 1;

  const S = {
    ws: null, connected: false, token: null, exportBase: null, status: null, statusAt: 0,
    colors: { off: '#d95f02', on: '#1b9e77' }, stages: [],
    ctx: null, player: null, capture: null, audioReady: null, audioError: null,
    micMode: null, pttHeld: false, micLevel: 0, vad: 'mic off', partial: '', framesSent: 0,
    framesPlayed: 0, buffered: 0, playing: false, audioPackets: 0,
    turns: {}, order: [], current: null, heardReports: [], ab: {}, abOrder: [], messages: [],
    touched: new Set(), downloads: 0, arrivals: {},
  };
  window.specvoice = S; // state for debugging and the browser tests

  const $ = (id) => document.getElementById(id);
  const esc = (s) => String(s).replace(/[&<>"']/g, (c) => ({ '&': '&amp;', '<': '&lt;', '>': '&gt;',
    '"': '&quot;', "'": '&#39;' })[c]);
  const fmt = (v, digits = 0) => (v === null || v === undefined || Number.isNaN(v) ? '–' : Number(v).toFixed(digits));
  const pct = (v) => (v === null || v === undefined ? '–' : `${(100 * v).toFixed(0)}%`);

  function send(obj) {
    if (S.ws && S.ws.readyState === WebSocket.OPEN) S.ws.send(JSON.stringify(obj));
  }

  function note(text, kind = 'info') {
    S.messages.push({ text, kind, t: Date.now() });
    if (S.messages.length > 4) S.messages.shift();
    render();
  }

  // ------------------------------------------------------------------------------------------ audio

  function setupAudio() {
    try {
      S.ctx = new AudioContext({ latencyHint: 'interactive' });
    } catch (e) {
      S.audioError = `no Web Audio: ${e}`;
      return;
    }
    S.audioReady = S.ctx.audioWorklet.addModule(WORKLETS).then(() => {
      const player = new AudioWorkletNode(S.ctx, 'sv-player', { numberOfInputs: 0, outputChannelCount: [2] });
      player.port.onmessage = (e) => onPlayer(e.data);
      player.connect(S.ctx.destination);
      S.player = player;
    }).catch((e) => { S.audioError = `audio worklet failed: ${e}`; render(); });
  }

  function resumeAudio() {
    if (S.ctx && S.ctx.state === 'suspended') S.ctx.resume().then(render);
  }

  function onPlayer(m) {
    if (m.type === 'stats') {
      S.framesPlayed = m.played;
      S.buffered = m.buffered;
      S.playing = m.playing;
      render();
    } else if (m.type === 'started') {
      onHeard(m);
    }
  }

  // The worklet says at which context time the answer's first sample goes out; getOutputTimestamp maps
  // context time to performance.now() at the speaker (output latency included). Without a usable timestamp
  // (no output device) fall back to the render time plus the reported output latency.
  function onHeard(m) {
    const ctx = S.ctx;
    const ts = ctx.getOutputTimestamp ? ctx.getOutputTimestamp() : null;
    let t;
    let method;
    if (ts && ts.performanceTime > 0 && ts.contextTime > 0) {
      t = ts.performanceTime + (m.ctxTime - ts.contextTime) * 1000;
      method = 'getOutputTimestamp';
    } else {
      t = performance.now() + (m.ctxTime - ctx.currentTime) * 1000 + (ctx.outputLatency || ctx.baseLatency || 0) * 1000;
      method = 'currentTime+outputLatency';
    }
    const report = {
      type: 'heard', turn: m.turn, t, method, received_t: S.arrivals[m.turn], output_latency_ms: (ctx.outputLatency || 0) * 1000,
      base_latency_ms: (ctx.baseLatency || 0) * 1000,
      output_timestamp: ts ? { contextTime: ts.contextTime, performanceTime: ts.performanceTime } : null,
    };
    S.heardReports.push(report);
    send(report);
  }

  function onAudio(buf) {
    const dv = new DataView(buf);
    if (String.fromCharCode(dv.getUint8(0), dv.getUint8(1), dv.getUint8(2), dv.getUint8(3)) !== 'SVA1') return;
    const turn = dv.getUint32(4, true);
    const seq = dv.getUint32(8, true);
    const rate = dv.getUint32(12, true);
    const flags = dv.getUint32(16, true);
    if (seq === 0 && !(flags & FLAG_REPLAY)) S.arrivals[turn] = performance.now();
    const pcm = new Int16Array(buf, HEADER_BYTES);
    let samples = new Float32Array(pcm.length);
    for (let i = 0; i < pcm.length; i++) samples[i] = pcm[i] / 32767;
    S.audioPackets += 1;
    if (!S.audioReady) return;
    S.audioReady.then(() => {
      if (!S.player) return;
      // The server resamples to our rate (hello.sample_rate); this linear fallback only guards a mismatch.
      if (rate !== S.ctx.sampleRate) samples = resampleLinear(samples, rate, S.ctx.sampleRate);
      S.player.port.postMessage({ type: 'pcm', samples, turn, seq, replay: !!(flags & FLAG_REPLAY) },
        [samples.buffer]);
      if (S.ctx.state === 'suspended') note('Click anywhere on the page to let the answer play.', 'error');
    });
  }

  function resampleLinear(x, from, to) {
    const n = Math.floor((x.length * to) / from);
    const y = new Float32Array(n);
    for (let i = 0; i < n; i++) {
      const p = (i * from) / to;
      const j = Math.floor(p);
      const f = p - j;
      y[i] = (x[j] || 0) * (1 - f) + (x[j + 1] || 0) * f;
    }
    return y;
  }

  function flushPlayback() {
    if (S.player) S.player.port.postMessage({ type: 'flush' });
  }

  async function ensureMic() {
    if (S.capture) return true;
    if (!S.audioReady) return false;
    await S.audioReady;
    try {
      const stream = await navigator.mediaDevices.getUserMedia({
        audio: { channelCount: 1, echoCancellation: true, noiseSuppression: true, autoGainControl: true },
      });
      const source = S.ctx.createMediaStreamSource(stream);
      const capture = new AudioWorkletNode(S.ctx, 'sv-capture', {
        outputChannelCount: [1], processorOptions: { targetRate: 16000, frameSamples: 512 },
      });
      // Connected to the output through a muted gain so the graph pulls it; nothing is heard.
      const mute = S.ctx.createGain();
      mute.gain.value = 0;
      source.connect(capture).connect(mute).connect(S.ctx.destination);
      capture.port.onmessage = (e) => {
        S.micLevel = e.data.rms;
        if (S.micMode && S.ws && S.ws.readyState === WebSocket.OPEN) {
          S.ws.send(e.data.pcm);
          S.framesSent += 1;
        }
      };
      S.capture = capture;
      S.micStream = stream;
      return true;
    } catch (e) {
      note(`Microphone unavailable: ${e.message || e}`, 'error');
      return false;
    }
  }

  async function toggleHandsfree() {
    resumeAudio();
    if (S.micMode === 'handsfree') {
      send({ type: 'mic', active: false, mode: 'handsfree' });
      S.micMode = null;
      S.vad = 'mic off';
    } else if (await ensureMic()) {
      send({ type: 'mic', active: true, mode: 'handsfree' });
      S.micMode = 'handsfree';
      S.vad = 'waiting for speech';
    }
    render();
  }

  async function pttDown() {
    resumeAudio();
    S.pttHeld = true;
    if (S.micMode === 'handsfree') send({ type: 'mic', active: false, mode: 'handsfree' });
    if (!(await ensureMic()) || !S.pttHeld) return;
    flushPlayback();
    send({ type: 'mic', active: true, mode: 'ptt' });
    S.micMode = 'ptt';
    S.vad = 'recording (release to send)';
    render();
  }

  function pttUp() {
    if (!S.pttHeld) return;
    S.pttHeld = false;
    if (S.micMode === 'ptt') {
      send({ type: 'mic', active: false, mode: 'ptt' });
      S.micMode = null;
      S.vad = 'mic off';
      render();
    }
  }

  // ------------------------------------------------------------------------------------------ socket

  function connect() {
    const proto = location.protocol === 'https:' ? 'wss:' : 'ws:';
    const ws = new WebSocket(`${proto}//${location.host}/specvoice/ws`);
    ws.binaryType = 'arraybuffer';
    S.ws = ws;
    ws.onopen = () => {
      S.connected = true;
      send({ type: 'hello', sample_rate: S.ctx ? S.ctx.sampleRate : 48000 });
      sendSettings();
      render();
    };
    ws.onmessage = (e) => (typeof e.data === 'string' ? onJson(JSON.parse(e.data)) : onAudio(e.data));
    ws.onclose = () => {
      S.connected = false;
      S.status = null;
      S.micMode = null;
      render();
      setTimeout(connect, 1500);
    };
  }

  function turnOf(id) {
    return S.turns[id];
  }

  function onJson(m) {
    switch (m.type) {
      case 'ping':
        send({ type: 'pong', ts: m.ts, tc: performance.now() });
        return;
      case 'hello':
        S.token = m.token;
        S.exportBase = m.export;
        S.colors = m.colors || S.colors;
        S.stages = m.stages || [];
        break;
      case 'status':
        S.status = m;
        S.statusAt = Date.now();
        break;
      case 'vad':
        S.vad = { speech_start: 'hearing speech…', listening: 'listening…', end_of_turn: 'thinking…' }[m.event]
          || m.event;
        break;
      case 'partial':
        S.partial = m.text;
        break;
      case 'transcript':
        S.partial = m.text;
        if (S.micMode === 'handsfree') S.vad = 'waiting for speech';
        break;
      case 'turn':
        S.turns[m.turn] = { ...m, pieces: [], steps: [], proposed: 0, accepted: 0, emitted: 0, forwards: 0,
          tokensPerS: null, data: null, heard: null };
        S.order.push(m.turn);
        S.current = m.turn;
        break;
      case 'token': {
        const t = turnOf(m.turn);
        if (!t) return;
        t.pieces.push(...m.pieces);
        t.tokensPerS = m.tokens_per_s;
        // Live running figures (one message per target forward); the final ones come from the server's SpecStats.
        t.proposed += m.drafted;
        t.accepted += m.accepted;
        t.emitted += m.step_tokens;
        t.forwards += 1;
        t.steps.push({ rate: m.step_tokens_per_s, acceptance: m.drafted > 0 ? m.accepted / m.drafted : null });
        break;
      }
      case 'done': {
        const t = turnOf(m.turn);
        if (t) t.data = m.data;
        if (t && m.data.ttfa_heard_ms !== null && m.data.ttfa_heard_ms !== undefined) t.heard = m.data;
        break;
      }
      case 'heard': {
        const t = turnOf(m.turn);
        if (t) t.heard = m;
        break;
      }
      case 'flush':
        flushPlayback();
        break;
      case 'busy':
        note(m.message, 'busy');
        break;
      case 'error':
        note(m.message, 'error');
        break;
      case 'info':
        note(m.message, 'info');
        break;
      case 'ab_start':
        S.ab[m.ab] = { text: m.text, spoken: m.spoken, repeats: m.repeats, done: 0, pairs: [], summary: null };
        S.abOrder.push(m.ab);
        break;
      case 'ab_progress':
        if (S.ab[m.ab]) S.ab[m.ab].done = m.done;
        break;
      case 'ab_result':
        S.ab[m.ab] = { ...(S.ab[m.ab] || {}), text: m.text, pairs: m.pairs, summary: m.summary, finished: true };
        break;
      default:
        return;
    }
    render();
  }

  function sendSettings() {
    const spec = $('speculation');
    const msg = { type: 'settings', speculation: spec ? spec.checked : true };
    const fields = { drafter: 'drafter', k: 'k-policy', temperature: 'temperature' };
    for (const [key, id] of Object.entries(fields)) {
      const el = $(id);
      if (el && S.touched.has(id)) msg[key] = key === 'temperature' ? Number(el.value) : el.value;
    }
    send(msg);
  }

  function sendText() {
    const input = $('text-input');
    const text = input ? input.value.trim() : '';
    if (!text) return;
    resumeAudio();
    send({ type: 'text', text });
    input.value = '';
  }

  // ------------------------------------------------------------------------------------------ rendering

  let renderPending = false;
  function render() {
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

  function setText(id, text) {
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
    renderTranscript();
    renderAb();
    drawSteps();
    drawTtfa();
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
      text = `Ready — LLM ${e.llm}; ASR ${e.asr}; TTS ${e.tts}; loaded and warmed up in ${fmt(st.load_s, 1)} s`;
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
    for (const [id, name] of [['export-report', 'report.html'], ['export-csv', 'turns.csv'],
      ['export-json', 'turns.json']]) {
      const a = $(id);
      if (a && S.exportBase) a.setAttribute('href', `${S.exportBase}/${name}`);
    }
  }

  function renderMetrics() {
    const t = turnOf(S.current);
    if (!t) return;
    const d = t.data;
    setText('ttfa-ms', d ? fmt(d.ttfa_ms) : '…');
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
  }

  function renderWaterfall() {
    const t = turnOf(S.current);
    const d = t && t.data;
    setText('waterfall-mode', t ? `turn ${t.turn}, speculation ${t.speculation ? 'on' : 'off'}` : '');
    if (!d || !d.ttfa_ms) {
      const why = !d ? 'waiting for the first audio…' : d.cancelled ? 'interrupted before its first audio'
        : 'the answer had no audio';
      setHtml('waterfall', t ? `<div class="sv-def">${why}</div>` : '');
      return;
    }
    const heard = t.heard && t.heard.ttfa_heard_ms;
    const total = Math.max(d.ttfa_ms, heard || 0);
    let start = 0;
    const rows = S.stages.map((name, i) => {
      const v = d.stages[name] || 0;
      const row = `<div class="sv-wf-row"><span class="sv-wf-label">${esc(name)}</span><span class="sv-wf-track">`
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
    setHtml('waterfall', rows.join(''));
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
      else if (s && s.n) {
        const ci = s.ci95_ms;
        head += `TTFA on − off: <b class="sv-ab-diff">${fmt(s.mean_diff_ms)} ms</b> `
          + (s.n > 1 ? `(95% CI ${fmt(ci[0])} to ${fmt(ci[1])} ms, ${s.n} pairs)` : '(1 pair: no interval)');
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

  function axes(ctx, w, h, pad, yMax, label, rightLabel) {
    ctx.clearRect(0, 0, w, h);
    ctx.strokeStyle = '#999';
    ctx.fillStyle = '#555';
    ctx.font = '11px sans-serif';
    ctx.beginPath();
    ctx.moveTo(pad.l, pad.t);
    ctx.lineTo(pad.l, h - pad.b);
    ctx.lineTo(w - pad.r, h - pad.b);
    ctx.stroke();
    for (let i = 0; i <= 4; i++) {
      const y = h - pad.b - ((h - pad.t - pad.b) * i) / 4;
      ctx.fillText(fmt((yMax * i) / 4), 2, y + 4);
      if (rightLabel) ctx.fillText(`${25 * i}%`, w - pad.r + 4, y + 4);
    }
    ctx.fillText(label, pad.l + 4, pad.t - 4);
  }

  function drawSteps() {
    const c = $('plot-steps');
    if (!c) return;
    const ctx = c.getContext('2d');
    const t = turnOf(S.current);
    const w = c.width;
    const h = c.height;
    const pad = { l: 40, r: 34, t: 16, b: 20 };
    const steps = t ? t.steps : [];
    const rates = steps.map((s) => s.rate).filter((r) => r !== null);
    const yMax = Math.max(1, ...rates) * 1.1;
    axes(ctx, w, h, pad, yMax, 'tokens/s (line) · acceptance (dots, right axis)', true);
    const n = Math.max(steps.length, 2);
    const x = (i) => pad.l + ((w - pad.l - pad.r) * i) / (n - 1);
    const yr = (v) => h - pad.b - ((h - pad.t - pad.b) * v) / yMax;
    const ya = (v) => h - pad.b - (h - pad.t - pad.b) * v;
    ctx.strokeStyle = '#3b6fb6';
    ctx.beginPath();
    let started = false;
    steps.forEach((s, i) => {
      if (s.rate === null) return;
      if (started) ctx.lineTo(x(i), yr(s.rate));
      else ctx.moveTo(x(i), yr(s.rate));
      started = true;
    });
    ctx.stroke();
    ctx.fillStyle = S.colors.on;
    steps.forEach((s, i) => {
      if (s.acceptance === null) return;
      ctx.beginPath();
      ctx.arc(x(i), ya(s.acceptance), 2.5, 0, 2 * Math.PI);
      ctx.fill();
    });
    ctx.fillStyle = '#555';
    ctx.fillText(`target step →  (${steps.length})`, w - pad.r - 110, h - 4);
  }

  function drawTtfa() {
    const c = $('plot-ttfa');
    if (!c) return;
    const ctx = c.getContext('2d');
    const w = c.width;
    const h = c.height;
    const pad = { l: 40, r: 12, t: 16, b: 20 };
    const done = S.order.map((id) => S.turns[id]).filter((t) => t.data && t.data.ttfa_ms);
    const heardVals = done.map((t) => (t.heard && t.heard.ttfa_heard_ms) || 0);
    const yMax = Math.max(100, ...done.map((t) => t.data.ttfa_ms), ...heardVals) * 1.1;
    axes(ctx, w, h, pad, yMax, 'TTFA ms per turn (filled: server, ring: heard)', false);
    const n = Math.max(done.length, 2);
    const x = (i) => pad.l + 8 + ((w - pad.l - pad.r - 16) * i) / (n - 1);
    const y = (v) => h - pad.b - ((h - pad.t - pad.b) * v) / yMax;
    done.forEach((t, i) => {
      const color = t.speculation ? S.colors.on : S.colors.off;
      ctx.fillStyle = color;
      ctx.beginPath();
      ctx.arc(x(i), y(t.data.ttfa_ms), 4, 0, 2 * Math.PI);
      ctx.fill();
      if (t.heard && t.heard.ttfa_heard_ms) {
        ctx.strokeStyle = color;
        ctx.beginPath();
        ctx.arc(x(i), y(t.heard.ttfa_heard_ms), 5, 0, 2 * Math.PI);
        ctx.stroke();
      }
    });
    ctx.fillStyle = S.colors.off;
    ctx.fillText('● off', w - 90, pad.t + 10);
    ctx.fillStyle = S.colors.on;
    ctx.fillText('● on', w - 50, pad.t + 10);
  }

  // ------------------------------------------------------------------------------------------ events

  document.addEventListener('pointerdown', (e) => {
    resumeAudio();
    if (e.target.closest && e.target.closest('#ptt')) {
      e.preventDefault();
      pttDown();
    }
  }, true);
  for (const type of ['pointerup', 'pointercancel']) document.addEventListener(type, pttUp, true);
  document.addEventListener('keydown', (e) => {
    if (e.target.id === 'text-input' && e.key === 'Enter') {
      e.preventDefault();
      sendText();
    }
  });
  document.addEventListener('click', (e) => {
    const el = e.target.closest && e.target.closest('button, a');
    if (!el) return;
    if (el.dataset.play) {
      resumeAudio();
      send({ type: 'play', turn: Number(el.dataset.play) });
      return;
    }
    switch (el.id) {
      case 'handsfree':
        toggleHandsfree();
        break;
      case 'send-text':
        sendText();
        break;
      case 'stop-answer':
        send({ type: 'stop' });
        flushPlayback();
        break;
      case 'ab-run': {
        const reps = $('ab-repeats');
        const text = $('ab-text');
        send({ type: 'ab', repeats: Number(reps ? reps.value : 3), text: text ? text.value.trim() : '' });
        break;
      }
      case 'export-report':
      case 'export-csv':
      case 'export-json':
        if (!S.exportBase) e.preventDefault();
        else S.downloads += 1;
        break;
      default:
    }
  });
  document.addEventListener('change', (e) => {
    const id = e.target.id;
    if (['speculation', 'drafter', 'k-policy', 'temperature'].includes(id)) {
      if (id !== 'speculation') S.touched.add(id);
      sendSettings();
      render();
    }
  });
  document.addEventListener('input', (e) => {
    if (e.target.id === 'temperature') { // dragging: keep status updates from moving the slider back
      S.touched.add('temperature');
      setText('temperature-value', Number(e.target.value).toFixed(1));
    }
  });

  setupAudio();
  connect();
  render();
})();
