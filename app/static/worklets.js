// AudioWorklet processors for specvoice: microphone capture (→ 16 kHz Int16 frames) and answer playback.
/* global sampleRate, currentTime, currentFrame, registerProcessor, AudioWorkletProcessor */

// Capture: averages the input over each 16 kHz sample period (a box low-pass, enough against aliasing for
// speech), so VAD and ASR get their native rate and the socket carries a third of 48 kHz audio.
class SvCapture extends AudioWorkletProcessor {
  constructor(options) {
    super();
    const o = options.processorOptions; // from app/protocol.py, through audio.js
    this.step = sampleRate / o.targetRate; // input samples per output sample
    this.frame = o.frameSamples; // one silero window: the VAD decides per 32 ms
    this.pos = 0;
    this.acc = 0;
    this.n = 0;
    this.sumsq = 0;
    this.k = 0;
    this.out = new Int16Array(this.frame);
  }

  process(inputs) {
    const ch = inputs[0]?.[0];
    if (!ch) return true;
    for (let i = 0; i < ch.length; i++) {
      this.acc += ch[i];
      this.n += 1;
      this.pos += 1;
      if (this.pos >= this.step) {
        this.pos -= this.step;
        const v = this.acc / this.n;
        this.acc = 0;
        this.n = 0;
        this.sumsq += v * v;
        this.out[this.k++] = Math.max(-32768, Math.min(32767, Math.round(v * 32767)));
        if (this.k === this.frame) {
          const rms = Math.sqrt(this.sumsq / this.frame);
          this.port.postMessage({ pcm: this.out.buffer, rms }, [this.out.buffer]);
          this.out = new Int16Array(this.frame);
          this.k = 0;
          this.sumsq = 0;
        }
      }
    }
    return true;
  }
}

// Playback: a queue of PCM buffers already at the context's rate, played back to back with no jitter buffer
// (TTS hands over whole sentences, so waiting would only add latency). When the first sample of an answer goes
// out it posts the context time of that sample, which the page maps to performance.now() ("heard").
class SvPlayer extends AudioWorkletProcessor {
  constructor() {
    super();
    this.queue = [];
    this.offset = 0;
    this.played = 0;
    this.lastReport = 0;
    this.wasPlaying = false;
    this.port.onmessage = (e) => {
      const m = e.data;
      if (m.type === 'pcm') this.queue.push(m);
      else if (m.type === 'flush') {
        this.queue = [];
        this.offset = 0;
      }
    };
  }

  process(_inputs, outputs) {
    const channels = outputs[0];
    const out = channels[0];
    let i = 0;
    while (i < out.length && this.queue.length) {
      const buf = this.queue[0];
      if (this.offset === 0 && buf.seq === 0 && !buf.replay) {
        this.port.postMessage({ type: 'started', turn: buf.turn, ctxTime: currentTime + i / sampleRate,
          frame: currentFrame + i });
      }
      const n = Math.min(out.length - i, buf.samples.length - this.offset);
      out.set(buf.samples.subarray(this.offset, this.offset + n), i);
      i += n;
      this.offset += n;
      this.played += n;
      if (this.offset >= buf.samples.length) {
        this.queue.shift();
        this.offset = 0;
      }
    }
    out.fill(0, i);
    for (let c = 1; c < channels.length; c++) channels[c].set(out);
    const playing = this.queue.length > 0;
    if (currentFrame - this.lastReport >= sampleRate / 10 || playing !== this.wasPlaying) {
      this.lastReport = currentFrame;
      this.wasPlaying = playing;
      let buffered = -this.offset;
      for (const b of this.queue) buffered += b.samples.length;
      this.port.postMessage({ type: 'stats', played: this.played, buffered, playing });
    }
    return true;
  }
}

registerProcessor('sv-capture', SvCapture);
registerProcessor('sv-player', SvPlayer);
