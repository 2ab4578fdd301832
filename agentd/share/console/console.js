// The Keystone Agent console: the live list of the caller's sandboxes and
// the agents waiting for them, from agentd's events WebSocket, and a
// terminal (xterm.js) on a sandbox's session or a shell, over agentd's
// terminal WebSocket.
//
// Everything shown here comes from agentd, and much of it from inside a
// sandbox (names, reasons, what an agent says): it is only ever put into
// the page as text (textContent), never as markup.
'use strict';

const sandboxes = new Map(); // name -> row
const waiting = new Map(); // sandbox + '\n' + session -> waiting agent
// (A sandbox name is [a-z0-9-]: nothing to decode.)
let selected = location.hash.slice(1);

function el(tag, text, cls) {
  const e = document.createElement(tag);
  if (text !== undefined) e.textContent = String(text);
  if (cls) e.className = cls;
  return e;
}

function when(micros) {
  if (!micros) return 'never';
  return new Date(micros / 1000).toLocaleString();
}

function render() {
  const rows = document.getElementById('rows');
  rows.replaceChildren();
  const names = [...sandboxes.keys()].sort();
  document.getElementById('empty').hidden = names.length > 0;
  for (const name of names) {
    const s = sandboxes.get(name);
    const tr = el('tr');
    tr.dataset.name = name;
    if (name === selected) tr.className = 'selected';
    tr.append(el('td', s.name));
    const state = el('td', s.state_reason ? s.state + ' (' + s.state_reason + ')' : s.state);
    state.className = 'state-' + s.state;
    tr.append(state);
    tr.append(el('td', s.backend));
    const n = [...waiting.values()].filter((w) => w.sandbox === name).length;
    tr.append(el('td', n ? n + ' waiting for input' : ''));
    tr.append(el('td', s.last_sync_at ? when(s.last_sync_at) + ': ' + s.last_sync_result : 'never'));
    const open = el('td');
    const session = el('button', 'Session');
    session.type = 'button';
    session.title = 'The Zellij session of the main branch (as agentctl attach)';
    session.addEventListener('click', () => openTerminal({ sandbox: name, branch: '', shell: false }));
    const shell = el('button', 'Shell');
    shell.type = 'button';
    shell.title = 'A plain shell in the sandbox (as agentctl exec -t)';
    shell.addEventListener('click', () => openTerminal({ sandbox: name, branch: '', shell: true }));
    open.append(session, shell);
    tr.append(open);
    rows.append(tr);
  }
  const list = document.getElementById('waiting');
  list.replaceChildren();
  const waits = [...waiting.values()].sort((a, b) => a.time - b.time);
  document.getElementById('waiting-section').hidden = waits.length === 0;
  for (const w of waits) {
    const li = el('li');
    li.append(el('span', w.agent, 'agent'));
    li.append(el('span', ' in ' + w.sandbox + (w.session ? ' (session ' + w.session + ')' : '') + ', ' + when(w.time) + ': '));
    li.append(el('span', w.message, 'message'));
    list.append(li);
  }
}

function notify(w) {
  if (!('Notification' in window) || Notification.permission !== 'granted') return;
  // A notification's title and body are plain text.
  new Notification(w.agent + ' waits in ' + w.sandbox, { body: w.message, tag: w.sandbox + '\n' + w.session });
}

function take(m) {
  switch (m.type) {
    case 'list':
      sandboxes.clear();
      waiting.clear();
      for (const s of m.sandboxes) sandboxes.set(s.name, s);
      for (const w of m.waiting) waiting.set(w.sandbox + '\n' + w.session, w);
      break;
    case 'sandbox':
      sandboxes.set(m.sandbox.name, m.sandbox);
      break;
    case 'removed':
      sandboxes.delete(m.name);
      for (const k of [...waiting.keys()]) if (waiting.get(k).sandbox === m.name) waiting.delete(k);
      break;
    case 'waiting':
      waiting.set(m.sandbox + '\n' + m.session, m);
      notify(m);
      break;
    case 'answered':
      waiting.delete(m.sandbox + '\n' + m.session);
      break;
    default:
      return;
  }
  render();
}

// The session's token, read from the console that logged this page in:
// every connection must show it in its first message, or it is not that
// console (after agentd has gone, anything may listen on its port).
let proof = null;
let gone = false;

function lost(why) {
  gone = true;
  sandboxes.clear();
  waiting.clear();
  render();
  document.getElementById('status').textContent = why + ': run `agentctl console` again.';
}

let delay = 500;
function connect() {
  if (gone) return;
  const status = document.getElementById('status');
  const ws = new WebSocket((location.protocol === 'https:' ? 'wss://' : 'ws://') + location.host + '/api/events');
  let trusted = false;
  ws.onopen = () => { status.textContent = 'connecting…'; };
  ws.onmessage = (e) => {
    let m;
    try { m = JSON.parse(e.data); } catch (err) { return; }
    if (!trusted) {
      if (m.type !== 'list' || m.proof !== proof) {
        ws.close();
        lost('This is no longer the console that logged you in');
        return;
      }
      trusted = true;
      status.textContent = 'live';
      delay = 500;
    }
    take(m);
  };
  ws.onclose = () => {
    if (gone) return;
    status.textContent = 'disconnected; reconnecting…';
    setTimeout(connect, delay);
    delay = Math.min(delay * 2, 10000);
  };
}

function start() {
  fetch('/api/session', { credentials: 'same-origin' })
    .then((r) => (r.ok ? r.json() : Promise.reject(new Error('not logged in'))))
    .then((s) => { proof = s.csrf; connect(); })
    .catch(() => lost('Not logged in'));
}

// The terminal: one at a time, on the session of a branch (the same
// Zellij session `agentctl attach` joins, so it can be left and joined
// again from anywhere) or a plain shell. What the session prints goes
// only to xterm.js, which draws it; nothing of it becomes markup.
const term = { spec: null, xterm: null, fit: null, ws: null, ended: false, delay: 500 };
const encoder = new TextEncoder();
// Largest piece of typing (or paste) sent in one message: agentd reads
// at most 16 KiB at once.
const PIECE = 8192;

function termStatus(text) {
  document.getElementById('terminal-status').textContent = text;
}

function closeTerminal() {
  term.ended = true;
  if (term.ws) term.ws.close();
  if (term.xterm) term.xterm.dispose();
  term.spec = term.xterm = term.fit = term.ws = null;
  document.getElementById('terminal-section').hidden = true;
}

function send(bytes) {
  const ws = term.ws;
  if (!ws || ws.readyState !== WebSocket.OPEN || !ws.trusted) return;
  for (let i = 0; i < bytes.length; i += PIECE) ws.send(bytes.subarray(i, i + PIECE));
}

function openTerminal(spec) {
  closeTerminal();
  if (typeof Terminal === 'undefined' || typeof FitAddon === 'undefined') {
    document.getElementById('terminal-section').hidden = false;
    document.getElementById('terminal-title').textContent = spec.sandbox;
    termStatus('The terminal\'s code (xterm.js) is not installed yet: agentd downloads it when it starts, or run `agentd --install-agents`; then reload.');
    return;
  }
  term.spec = spec;
  term.ended = false;
  term.delay = 500;
  document.getElementById('terminal-section').hidden = false;
  document.getElementById('terminal-title').textContent =
    spec.sandbox + (spec.shell ? ': shell' : ': session') + (spec.branch ? ' ' + spec.branch : '');
  const xterm = new Terminal({ cursorBlink: true, scrollback: 5000, fontFamily: 'monospace' });
  const fit = new FitAddon.FitAddon();
  xterm.loadAddon(fit);
  xterm.open(document.getElementById('terminal'));
  fit.fit();
  xterm.onData((d) => send(encoder.encode(d)));
  xterm.onBinary((d) => send(Uint8Array.from(d, (c) => c.charCodeAt(0) & 255)));
  xterm.onResize(({ rows, cols }) => {
    if (term.ws && term.ws.trusted) term.ws.send(JSON.stringify({ type: 'resize', rows, cols }));
  });
  // Ctrl+Shift+C copies the selection (Ctrl+C goes to the session);
  // pasting is the browser's own.
  xterm.attachCustomKeyEventHandler((e) => {
    if (e.type === 'keydown' && e.ctrlKey && e.shiftKey && e.code === 'KeyC') {
      const text = xterm.getSelection();
      if (text && navigator.clipboard) navigator.clipboard.writeText(text);
      return false;
    }
    return true;
  });
  term.xterm = xterm;
  term.fit = fit;
  connectTerminal();
  xterm.focus();
}

function connectTerminal() {
  const spec = term.spec;
  const xterm = term.xterm;
  if (!spec || term.ended) return;
  const q = new URLSearchParams({ sandbox: spec.sandbox });
  if (spec.branch) q.set('branch', spec.branch);
  if (spec.shell) q.set('shell', '1');
  const ws = new WebSocket((location.protocol === 'https:' ? 'wss://' : 'ws://') + location.host + '/api/terminal?' + q);
  ws.binaryType = 'arraybuffer';
  ws.trusted = false;
  term.ws = ws;
  termStatus('connecting…');
  ws.onopen = () => {
    ws.send(JSON.stringify({ type: 'open', csrf: proof, rows: xterm.rows, cols: xterm.cols }));
  };
  ws.onmessage = (e) => {
    if (term.ws !== ws) return;
    if (typeof e.data !== 'string') {
      if (ws.trusted) xterm.write(new Uint8Array(e.data));
      return;
    }
    let m;
    try { m = JSON.parse(e.data); } catch (err) { return; }
    if (!ws.trusted) {
      if (m.proof !== proof) {
        term.ended = true;
        ws.close();
        termStatus('This is no longer the console that logged you in: run `agentctl console` again.');
        return;
      }
      ws.trusted = true;
    }
    switch (m.type) {
      case 'opened':
        term.delay = 500;
        termStatus((m.session ? 'session ' + m.session : 'shell') + (m.notices.length ? ' (' + m.notices.join('; ') + ')' : ''));
        // The size may have changed while it opened.
        ws.send(JSON.stringify({ type: 'resize', rows: xterm.rows, cols: xterm.cols }));
        break;
      case 'error':
        term.ended = true;
        termStatus(m.message);
        break;
      case 'exit':
        term.ended = true;
        termStatus('ended' + (m.code === null ? '' : ' (exit code ' + m.code + ')'));
        break;
      default:
        break;
    }
  };
  ws.onclose = () => {
    if (term.ws !== ws || term.ended) return;
    // A dropped connection: join again (a session is as it was left; a
    // shell is a new one).
    termStatus('disconnected; reconnecting…');
    setTimeout(connectTerminal, term.delay);
    term.delay = Math.min(term.delay * 2, 10000);
  };
}

window.addEventListener('resize', () => { if (term.fit) term.fit.fit(); });

window.addEventListener('hashchange', () => {
  selected = location.hash.slice(1);
  render();
});

document.addEventListener('DOMContentLoaded', () => {
  const button = document.getElementById('notify');
  if ('Notification' in window && Notification.permission === 'default') {
    button.hidden = false;
    button.addEventListener('click', () => {
      Notification.requestPermission().then(() => { button.hidden = true; });
    });
  }
  document.getElementById('terminal-close').addEventListener('click', closeTerminal);
  render();
  start();
});
