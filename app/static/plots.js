// The two canvas plots: this answer's rate and acceptance per target step, and TTFA per turn.
import { $, fmt, S } from './state.js';

// The colours are app.css's custom properties, read at each draw: the stylesheet may apply after this module runs.
function palette() {
  const css = getComputedStyle(document.documentElement);
  const get = (name) => css.getPropertyValue(`--sv-${name}`).trim();
  return { off: get('spec-off'), on: get('spec-on'), rate: get('rate'), axis: get('axis'), text: get('text-muted') };
}

function axes(ctx, colors, w, h, pad, yMax, label, rightLabel) {
  ctx.clearRect(0, 0, w, h);
  ctx.strokeStyle = colors.axis;
  ctx.fillStyle = colors.text;
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

function drawSteps(colors) {
  const c = $('plot-steps');
  if (!c) return;
  const ctx = c.getContext('2d');
  const t = S.turns[S.current];
  const w = c.width;
  const h = c.height;
  const pad = { l: 40, r: 34, t: 16, b: 20 };
  const steps = t ? t.steps : [];
  const rates = steps.map((s) => s.rate).filter((r) => r !== null);
  const yMax = Math.max(1, ...rates) * 1.1;
  axes(ctx, colors, w, h, pad, yMax, 'tokens/s (line) · acceptance (dots, right axis)', true);
  const n = Math.max(steps.length, 2);
  const x = (i) => pad.l + ((w - pad.l - pad.r) * i) / (n - 1);
  const yr = (v) => h - pad.b - ((h - pad.t - pad.b) * v) / yMax;
  const ya = (v) => h - pad.b - (h - pad.t - pad.b) * v;
  ctx.strokeStyle = colors.rate;
  ctx.beginPath();
  let started = false;
  steps.forEach((s, i) => {
    if (s.rate === null) return;
    if (started) ctx.lineTo(x(i), yr(s.rate));
    else ctx.moveTo(x(i), yr(s.rate));
    started = true;
  });
  ctx.stroke();
  ctx.fillStyle = colors.on;
  steps.forEach((s, i) => {
    if (s.acceptance === null) return;
    ctx.beginPath();
    ctx.arc(x(i), ya(s.acceptance), 2.5, 0, 2 * Math.PI);
    ctx.fill();
  });
  ctx.fillStyle = colors.text;
  ctx.fillText(`target step →  (${steps.length})`, w - pad.r - 110, h - 4);
}

function drawTtfa(colors) {
  const c = $('plot-ttfa');
  if (!c) return;
  const ctx = c.getContext('2d');
  const w = c.width;
  const h = c.height;
  const pad = { l: 40, r: 12, t: 16, b: 20 };
  const done = S.order.map((id) => S.turns[id]).filter((t) => t.data?.ttfa_ms);
  const heardVals = done.map((t) => (t.heard?.ttfa_heard_ms) || 0);
  const yMax = Math.max(100, ...done.map((t) => t.data.ttfa_ms), ...heardVals) * 1.1;
  axes(ctx, colors, w, h, pad, yMax, 'TTFA ms per turn (filled: server, ring: heard)', false);
  const n = Math.max(done.length, 2);
  const x = (i) => pad.l + 8 + ((w - pad.l - pad.r - 16) * i) / (n - 1);
  const y = (v) => h - pad.b - ((h - pad.t - pad.b) * v) / yMax;
  done.forEach((t, i) => {
    const color = t.speculation ? colors.on : colors.off;
    ctx.fillStyle = color;
    ctx.beginPath();
    ctx.arc(x(i), y(t.data.ttfa_ms), 4, 0, 2 * Math.PI);
    ctx.fill();
    if (t.heard?.ttfa_heard_ms) {
      ctx.strokeStyle = color;
      ctx.beginPath();
      ctx.arc(x(i), y(t.heard.ttfa_heard_ms), 5, 0, 2 * Math.PI);
      ctx.stroke();
    }
  });
  ctx.fillStyle = colors.off;
  ctx.fillText('● off', w - 90, pad.t + 10);
  ctx.fillStyle = colors.on;
  ctx.fillText('● on', w - 50, pad.t + 10);
}

export function drawPlots() {
  const colors = palette();
  S.colors = { off: colors.off, on: colors.on };
  drawSteps(colors);
  drawTtfa(colors);
}
