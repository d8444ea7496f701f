// The canvas plots: this answer's rate and acceptance per target step, TTFA per turn, and this machine's verify-cost
// curve.
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

// v(n) = forward(n)/forward(1) per batch size from the measured grid, between the two bounds that tell the story:
// v = 1 (memory-bound: drafts ride free) and v = n (compute-bound: every token fed costs a whole step).
function drawVerify(colors) {
  const c = $('plot-verify');
  if (!c) return;
  const ctx = c.getContext('2d');
  const w = c.width;
  const h = c.height;
  const pad = { l: 40, r: 40, t: 16, b: 20 };
  const grid = S.status?.forward_costs?.grid;
  const ns = grid ? grid.per_sequence : [1, 2];
  const nMax = ns[ns.length - 1];
  const yMax = 4 * Math.ceil(nMax / 4); // quarter ticks on whole numbers
  axes(ctx, colors, w, h, pad, yMax, 'v(n) = forward(n)/forward(1), bold: batch 1 (ms at its points)', false);
  ctx.fillText('tokens per sequence per forward n →', w - pad.r - 190, h - 4);
  if (!grid) {
    ctx.fillText('no forward-cost grid measured', pad.l + 20, h / 2);
    return;
  }
  const x = (n) => pad.l + ((w - pad.l - pad.r) * (n - 1)) / (nMax - 1);
  const y = (v) => h - pad.b - ((h - pad.t - pad.b) * v) / yMax;
  ctx.setLineDash([4, 4]);
  ctx.strokeStyle = colors.axis;
  for (const [v1, vMax, label] of [[1, 1, 'v = 1'], [1, nMax, 'v = n']]) {
    ctx.beginPath();
    ctx.moveTo(x(1), y(v1));
    ctx.lineTo(x(nMax), y(vMax));
    ctx.stroke();
    ctx.fillText(label, x(nMax) + 4, y(vMax) + 4);
  }
  ctx.setLineDash([]);
  grid.batches.forEach((b, i) => {
    const seconds = grid.seconds[i];
    const v = seconds.map((s) => s / seconds[0]);
    const one = b === 1;
    ctx.strokeStyle = one ? colors.rate : colors.axis;
    ctx.lineWidth = one ? 2.5 : 1;
    ctx.beginPath();
    ns.forEach((n, j) => {
      if (j) ctx.lineTo(x(n), y(v[j]));
      else ctx.moveTo(x(n), y(v[j]));
    });
    ctx.stroke();
    ctx.fillStyle = one ? colors.rate : colors.text;
    if (!one) ctx.fillText(`b${b}`, x(nMax) - 14, y(v[v.length - 1]) - 3);
    else {
      ns.forEach((n, j) => {
        ctx.beginPath();
        ctx.arc(x(n), y(v[j]), 3, 0, 2 * Math.PI);
        ctx.fill();
        ctx.fillText(`${fmt(1000 * seconds[j], 1)} ms`, x(n) - 14, y(v[j]) - 6);
      });
    }
  });
  ctx.lineWidth = 1;
}

export function drawPlots() {
  const colors = palette();
  S.colors = { off: colors.off, on: colors.on };
  drawSteps(colors);
  drawTtfa(colors);
  drawVerify(colors);
}
