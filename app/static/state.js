// The page's state, one object shared by the modules and exposed as window.specvoice (debugging, browser tests),
// and the small helpers every module uses.

export const S = {
  ws: null, connected: false, token: null, exportBase: null, status: null, statusAt: 0,
  colors: {}, stages: [],
  ctx: null, player: null, capture: null, micStream: null, audioReady: null, audioError: null,
  micMode: null, pttHeld: false, micLevel: 0, vad: 'mic off', partial: '', framesSent: 0,
  framesPlayed: 0, buffered: 0, playing: false, audioPackets: 0,
  turns: {}, order: [], current: null, heardReports: [], ab: {}, abOrder: [], messages: [],
  touched: new Set(), downloads: 0, arrivals: {}, early: { started: 0, kept: 0, discarded: 0 },
};
window.specvoice = S;

export const $ = (id) => document.getElementById(id);
export const esc = (s) => String(s).replace(/[&<>"']/g, (c) => ({ '&': '&amp;', '<': '&lt;', '>': '&gt;',
  '"': '&quot;', "'": '&#39;' })[c]);
export const fmt = (v, digits = 0) => (v === null || v === undefined || Number.isNaN(v) ? '–' : Number(v).toFixed(digits));
export const pct = (v) => (v === null || v === undefined ? '–' : `${(100 * v).toFixed(0)}%`);
