// The tab's WebSocket (app/protocol.py): what the server says updates S; sending, and reconnecting after a drop.
import { flushPlayback, onAudio } from './audio.js';
import { DEFAULT_PLAYBACK_RATE, WS_PATH } from './protocol.js';
import { note, render } from './render.js';
import { $, S } from './state.js';

export function send(obj) {
  if (S.ws && S.ws.readyState === WebSocket.OPEN) S.ws.send(JSON.stringify(obj));
}

export function sendMicFrame(pcm) {
  if (S.ws && S.ws.readyState === WebSocket.OPEN) {
    S.ws.send(pcm);
    S.framesSent += 1;
  }
}

export function connect() {
  const proto = location.protocol === 'https:' ? 'wss:' : 'ws:';
  const ws = new WebSocket(`${proto}//${location.host}${WS_PATH}`);
  ws.binaryType = 'arraybuffer';
  S.ws = ws;
  ws.onopen = () => {
    S.connected = true;
    send({ type: 'hello', sample_rate: S.ctx ? S.ctx.sampleRate : DEFAULT_PLAYBACK_RATE });
    sendSettings();
    render();
  };
  ws.onmessage = (e) => (typeof e.data === 'string' ? onJson(JSON.parse(e.data)) : onAudio(e.data));
  ws.onclose = (e) => {
    S.connected = false;
    S.status = null;
    S.micMode = null;
    render();
    // 1013: the server is full (its session caps); 1008: this tab was refused or stopped reading. Say why.
    if (e.code === 1013 || e.code === 1008) note(e.reason || 'The server closed this tab.', 'error');
    setTimeout(connect, e.code === 1013 ? 10000 : 1500);
  };
}

function onJson(m) {
  switch (m.type) {
    case 'ping':
      send({ type: 'pong', ts: m.ts, tc: performance.now() });
      return;
    case 'hello':
      S.token = m.token;
      S.exportBase = m.export;
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
        specSteps: 0, rejections: 0, tokensPerS: null, data: null, heard: null };
      S.order.push(m.turn);
      S.current = m.turn;
      break;
    case 'token': {
      const t = S.turns[m.turn];
      if (!t) return;
      t.pieces.push(...m.pieces);
      t.tokensPerS = m.tokens_per_s;
      // Live running figures (one message per target forward); the final ones come from the server's SpecStats.
      t.proposed += m.drafted;
      t.accepted += m.accepted;
      t.emitted += m.step_tokens;
      t.forwards += 1;
      // specdec.metrics' alpha and mean_k, for the predicted speedup: a step a drafter ran for, and one it lost
      if (m.k_chosen > 0) t.specSteps += 1;
      if (m.accepted < m.drafted) t.rejections += 1;
      t.batchSize = m.batch_size;
      t.kChosen = m.k_chosen;
      t.steps.push({
        rate: m.step_tokens_per_s,
        acceptance: m.drafted > 0 ? m.accepted / m.drafted : null,
        batchSize: m.batch_size,
      });
      break;
    }
    case 'done': {
      const t = S.turns[m.turn];
      if (t) t.data = m.data;
      if (t && m.data.ttfa_heard_ms !== null && m.data.ttfa_heard_ms !== undefined) t.heard = m.data;
      break;
    }
    case 'heard': {
      const t = S.turns[m.turn];
      if (t) t.heard = m;
      break;
    }
    case 'early': // an answer started at the user's pause: kept if the turn ends on those words, else thrown away
      if (Object.hasOwn(S.early, m.event)) S.early[m.event] += 1;
      break;
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

export function sendSettings() {
  const spec = $('speculation');
  const msg = { type: 'settings', speculation: spec ? spec.checked : true };
  const loadAware = $('load-aware');
  if (loadAware && S.touched.has('load-aware')) msg.load_aware = loadAware.checked;
  const background = $('background');
  if (background && S.touched.has('background')) msg.background = Number(background.value);
  const fields = { drafter: 'drafter', k: 'k-policy', temperature: 'temperature' };
  for (const [key, id] of Object.entries(fields)) {
    const el = $(id);
    if (el && S.touched.has(id)) msg[key] = key === 'temperature' ? Number(el.value) : el.value;
  }
  send(msg);
}
