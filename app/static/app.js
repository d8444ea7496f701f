// specvoice page script (the entry module): one WebSocket per tab carries mic PCM up, answer PCM and live metrics
// down. Panels are plain HTML inside Gradio's gr.HTML blocks; every event is delegated to the document, so it keeps
// working if Gradio re-renders a block.
import { ensureMic, flushPlayback, resumeAudio, setupAudio } from './audio.js';
import { render, setText } from './render.js';
import { connect, send, sendMicFrame, sendSettings } from './socket.js';
import { $, S } from './state.js';

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

function sendText() {
  const input = $('text-input');
  const text = input ? input.value.trim() : '';
  if (!text) return;
  resumeAudio();
  send({ type: 'text', text });
  input.value = '';
}

document.addEventListener('pointerdown', (e) => {
  resumeAudio();
  if (e.target.closest?.('#ptt')) {
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
  const el = e.target.closest?.('button, a');
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
  if (['speculation', 'drafter', 'k-policy', 'temperature', 'background', 'load-aware'].includes(id)) {
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
  if (e.target.id === 'background') setText('background-value', e.target.value);
});

setupAudio({ heard: send, micFrame: sendMicFrame });
connect();
render();
