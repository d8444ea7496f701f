// Web Audio: the answer player and the microphone capture (both AudioWorklets, worklets.js), and the "heard" time
// of each answer's first sample. What goes to the server leaves through the callbacks given to setupAudio.
import {
  AUDIO_MAGIC, FLAG_REPLAY, HEADER_BYTES, HEADER_OFFSETS, MIC_FRAME_SAMPLES, MIC_RATE,
} from './protocol.js';
import { note, render } from './render.js';
import { S } from './state.js';

let toServer = null; // setupAudio's callbacks

// out.heard(report): the page heard an answer start; out.micFrame(pcm): one Int16 mic frame.
export function setupAudio(out) {
  toServer = out;
  try {
    S.ctx = new AudioContext({ latencyHint: 'interactive' });
  } catch (e) {
    S.audioError = `no Web Audio: ${e}`;
    return;
  }
  S.audioReady = S.ctx.audioWorklet.addModule(new URL('./worklets.js', import.meta.url)).then(() => {
    const player = new AudioWorkletNode(S.ctx, 'sv-player', { numberOfInputs: 0, outputChannelCount: [2] });
    player.port.onmessage = (e) => onPlayer(e.data);
    player.connect(S.ctx.destination);
    S.player = player;
  }).catch((e) => { S.audioError = `audio worklet failed: ${e}`; render(); });
}

export function resumeAudio() {
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
  toServer.heard(report);
}

// One answer packet from the server (app/protocol.py pack_audio) → the player.
export function onAudio(buf) {
  const dv = new DataView(buf);
  const magic = String.fromCharCode(...new Uint8Array(buf, HEADER_OFFSETS.magic, AUDIO_MAGIC.length));
  if (magic !== AUDIO_MAGIC) return;
  const turn = dv.getUint32(HEADER_OFFSETS.turn, true);
  const seq = dv.getUint32(HEADER_OFFSETS.seq, true);
  const rate = dv.getUint32(HEADER_OFFSETS.rate, true);
  const flags = dv.getUint32(HEADER_OFFSETS.flags, true);
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

export function flushPlayback() {
  if (S.player) S.player.port.postMessage({ type: 'flush' });
}

export async function ensureMic() {
  if (S.capture) return true;
  if (!S.audioReady) return false;
  await S.audioReady;
  try {
    const stream = await navigator.mediaDevices.getUserMedia({
      audio: { channelCount: 1, echoCancellation: true, noiseSuppression: true, autoGainControl: true },
    });
    const source = S.ctx.createMediaStreamSource(stream);
    const capture = new AudioWorkletNode(S.ctx, 'sv-capture', {
      outputChannelCount: [1], processorOptions: { targetRate: MIC_RATE, frameSamples: MIC_FRAME_SAMPLES },
    });
    // Connected to the output through a muted gain so the graph pulls it; nothing is heard.
    const mute = S.ctx.createGain();
    mute.gain.value = 0;
    source.connect(capture).connect(mute).connect(S.ctx.destination);
    capture.port.onmessage = (e) => {
      S.micLevel = e.data.rms;
      if (S.micMode) toServer.micFrame(e.data.pcm);
    };
    S.capture = capture;
    S.micStream = stream;
    return true;
  } catch (e) {
    note(`Microphone unavailable: ${e.message || e}`, 'error');
    return false;
  }
}
