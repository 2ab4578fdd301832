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
    tr.addEventListener('click', (e) => {
      if (e.target.tagName !== 'BUTTON') location.hash = name;
    });
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
      refreshDetails();
      break;
    case 'sandbox':
      sandboxes.set(m.sandbox.name, m.sandbox);
      if (m.sandbox.name === selected) refreshDetails();
      break;
    case 'removed':
      sandboxes.delete(m.name);
      if (m.name === selected) refreshDetails();
      for (const k of [...waiting.keys()]) if (waiting.get(k).sandbox === m.name) waiting.delete(k);
      break;
    case 'waiting':
      waiting.set(m.sandbox + '\n' + m.session, m);
      notify(m);
      break;
    case 'answered':
      waiting.delete(m.sandbox + '\n' + m.session);
      break;
    case 'asked':
      if (m.sandbox === selected) refreshDetails();
      return;
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

// The selected sandbox's details: branches and their sessions, links,
// connections waiting for an answer, session records. Asked for when it
// is selected and when agentd says it changed (at most once a second).
function api(method, path, params, signal) {
  return fetch(path + '?' + new URLSearchParams(params), {
    method,
    signal,
    credentials: 'same-origin',
    headers: { 'X-Keystone-CSRF': proof },
  }).then((r) => r.json().then((v) => {
    if (!r.ok) throw new Error(v.error || r.statusText);
    return v;
  }));
}

let detailsAt = 0;
let detailsTimer = null;
function refreshDetails() {
  const wait = detailsAt + 1000 - Date.now();
  if (wait > 0) {
    if (!detailsTimer) detailsTimer = setTimeout(() => { detailsTimer = null; refreshDetails(); }, wait);
    return;
  }
  detailsAt = Date.now();
  const name = selected;
  const section = document.getElementById('details-section');
  if (!name || !sandboxes.has(name)) { section.hidden = true; return; }
  section.hidden = false;
  document.getElementById('details-title').textContent = name;
  // One question at a time: a newer one replaces an older one, whose
  // answer is not shown.
  if (detailsAsking) detailsAsking.abort();
  const asking = new AbortController();
  detailsAsking = asking;
  api('GET', '/api/sandbox', { name }, asking.signal)
    .then((d) => { if (detailsAsking === asking && name === selected) showDetails(d); })
    .catch((e) => {
      if (detailsAsking !== asking) return;
      // Nothing stale stays to be clicked.
      document.getElementById('asking').replaceChildren();
      document.getElementById('asking-section').hidden = true;
      document.getElementById('details-error').textContent = String(e.message);
    })
    .finally(() => { if (detailsAsking === asking) detailsAsking = null; });
}
let detailsAsking = null;

function button(text, title, action) {
  const b = el('button', text);
  b.type = 'button';
  if (title) b.title = title;
  b.addEventListener('click', action);
  return b;
}

function showDetails(d) {
  document.getElementById('details-error').textContent =
    d.partial ? 'The sandbox did not say everything in time; some of this may be missing.' : '';
  const branches = document.getElementById('branches');
  branches.replaceChildren();
  for (const w of d.branches) {
    const tr = el('tr');
    tr.append(el('td', w.branch || '(detached)'));
    tr.append(el('td', w.head));
    const changes = [];
    if (w.dirty) changes.push('uncommitted changes');
    if (w.ahead) changes.push(w.ahead + ' ahead');
    if (w.behind) changes.push(w.behind + ' behind');
    tr.append(el('td', changes.join(', ')));
    tr.append(el('td', w.session ? w.session + ' (' + w.clients + ' attached)' : ''));
    const open = el('td');
    if (w.branch) {
      open.append(
        button('Session', 'The Zellij session of ' + w.branch, () => openTerminal({ sandbox: d.name, branch: w.branch, shell: false })),
        button('Shell', 'A shell in the worktree of ' + w.branch, () => openTerminal({ sandbox: d.name, branch: w.branch, shell: true })));
    }
    tr.append(open);
    branches.append(tr);
  }
  const links = document.getElementById('links');
  links.replaceChildren();
  for (const l of d.links) {
    const li = el('li');
    // Only a web address is a link: agentd makes them, the branch in it
    // is the sandbox's.
    if (/^https?:\/\//.test(l.url)) {
      const a = el('a', l.url);
      a.href = l.url;
      a.target = '_blank';
      a.rel = 'noopener noreferrer';
      li.append(a);
    } else {
      li.append(el('span', l.url));
    }
    li.append(el('span', ' (' + l.branch + ', port ' + l.port + ')'));
    links.append(li);
  }
  if (!d.links.length) links.append(el('li', 'none (a server listening in a worktree gets one)'));
  const asking = document.getElementById('asking');
  asking.replaceChildren();
  document.getElementById('asking-section').hidden = d.egress_waiting.length === 0;
  for (const w of d.egress_waiting) {
    const li = el('li');
    li.append(el('span', w.host + ':' + w.port + ' (' + w.protocol + ', since ' + when(w.since) + ')'));
    const any = w.admits && !w.admits.includes(':');
    li.append(el('span', w.admits ? '; allowing it allows ' + w.admits + (any ? ' on any port' : '') : '; no entry would allow it', 'note'));
    const decide = (decision) => () => {
      // What was shown goes along: agentd decides only if it is still so.
      api('POST', '/api/egress', { sandbox: d.name, id: String(w.id), admits: w.admits, decision })
        .then(() => { detailsAt = 0; refreshDetails(); })
        .catch((e) => { document.getElementById('details-error').textContent = String(e.message); });
    };
    if (w.admits) {
      li.append(
        button('Allow once', 'Let the waiting connections to it through, and ask again next time', decide('once')),
        button('Allow', 'Allow it from now on', decide('allow')));
    }
    li.append(button('Deny', 'Refuse it from now on', decide('deny')));
    asking.append(li);
  }
  // A list that just moved takes no click for a moment: a row that moved
  // under the pointer is not the one the person meant.
  const buttons = [...asking.querySelectorAll('button')];
  for (const b of buttons) b.disabled = true;
  setTimeout(() => { for (const b of buttons) b.disabled = false; }, 600);
  const records = document.getElementById('records');
  records.replaceChildren();
  for (const r of d.records) {
    const tr = el('tr');
    tr.append(el('td', when(r.started)));
    tr.append(el('td', r.kind));
    tr.append(el('td', r.detail));
    tr.append(el('td', Math.round(r.duration_ms / 1000) + ' s'));
    const td = el('td');
    td.append(button('Play', 'Play this session in the browser', () => play(d.name, r.id)));
    tr.append(td);
    records.append(tr);
  }
}

// The terminal: one at a time, on the session of a branch (the same
// Zellij session `agentctl attach` joins, so it can be left and joined
// again from anywhere) or a plain shell. What the session prints goes
// only to xterm.js, which draws it; nothing of it becomes markup.
const term = { spec: null, xterm: null, fit: null, ws: null, ended: false, delay: 500, player: null, playing: null, refused: 0 };
const encoder = new TextEncoder();
// Largest piece of typing (or paste) sent in one message: agentd reads
// at most 16 KiB at once.
const PIECE = 8192;

function termStatus(text) {
  document.getElementById('terminal-status').textContent = text;
}

function closeTerminal() {
  term.ended = true;
  term.playing = null;
  if (term.player) clearTimeout(term.player);
  term.player = null;
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

// Whether xterm.js is there; if not, says so in the terminal's place.
function haveXterm(title) {
  if (typeof Terminal !== 'undefined' && typeof FitAddon !== 'undefined') return true;
  document.getElementById('terminal-section').hidden = false;
  document.getElementById('terminal-title').textContent = title;
  termStatus('The terminal\'s code (xterm.js) is not installed yet: agentd downloads it when it starts, or run `agentd --install-agents`; then reload.');
  return false;
}

// Play record `id` of sandbox `name` (an asciicast v2 file: a header,
// then [seconds, "o" | "i" | "r", data] a line): what was printed, at its
// pace, pauses cut to a second.
function play(name, id) {
  closeTerminal();
  const playing = {};
  term.playing = playing;
  if (!haveXterm(name + ': record ' + id)) return;
  document.getElementById('terminal-section').hidden = false;
  document.getElementById('terminal-title').textContent = name + ': record ' + id;
  termStatus('loading…');
  fetch('/api/record?' + new URLSearchParams({ sandbox: name, id }), {
    credentials: 'same-origin',
    headers: { 'X-Keystone-CSRF': proof },
  }).then((r) => r.text().then((t) => {
    if (!r.ok) { let m = t; try { m = JSON.parse(t).error; } catch (e) { /* text */ } throw new Error(m); }
    return t;
  })).then((text) => {
    // Another record or terminal was opened meanwhile.
    if (term.playing !== playing) return;
    const lines = text.split('\n').filter((l) => l);
    const head = JSON.parse(lines.shift());
    const within = (n, max, or) => (Number.isInteger(n) && n > 0 && n <= max ? n : or);
    const xterm = new Terminal({
      disableStdin: true,
      cols: within(head.width, 1000, 80),
      rows: within(head.height, 500, 24),
      scrollback: 5000,
      fontFamily: 'monospace',
    });
    xterm.open(document.getElementById('terminal'));
    document.getElementById('terminal-section').scrollIntoView({ block: 'start' });
    term.xterm = xterm;
    term.ended = false;
    const events = [];
    for (const l of lines) {
      try { const e = JSON.parse(l); if (Array.isArray(e) && e.length === 3) events.push(e); } catch (err) { /* a cut line */ }
    }
    let i = 0;
    let prev = 0;
    let waited = false;
    termStatus('playing…');
    const step = () => {
      term.player = null;
      if (term.xterm !== xterm) return;
      while (i < events.length) {
        const [t, kind, data] = events[i];
        const gap = Math.min(Math.max(t - prev, 0), 1);
        if (gap > 0.01 && !waited) {
          waited = true;
          term.player = setTimeout(step, gap * 1000);
          return;
        }
        waited = false;
        prev = t;
        i += 1;
        if (kind === 'o') xterm.write(String(data));
        else if (kind === 'r') {
          const [cols, rows] = String(data).split('x').map(Number);
          if (cols > 0 && rows > 0 && cols <= 1000 && rows <= 500) xterm.resize(cols, rows);
        }
      }
      termStatus('played');
    };
    step();
  }).catch((e) => termStatus(String(e.message)));
}

function openTerminal(spec) {
  closeTerminal();
  if (!haveXterm(spec.sandbox)) return;
  term.spec = spec;
  term.ended = false;
  term.delay = 500;
  term.refused = 0;
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
  document.getElementById('terminal-section').scrollIntoView({ block: 'start' });
}

// A paste is text: escape and C1 control characters are taken out, so
// that what another page put on the clipboard cannot end the terminal's
// bracketed paste and run a command of its own.
document.addEventListener('paste', (e) => {
  const box = document.getElementById('terminal');
  if (!term.xterm || !box.contains(e.target)) return;
  e.preventDefault();
  e.stopPropagation();
  const text = (e.clipboardData && e.clipboardData.getData('text/plain')) || '';
  term.xterm.paste(text.replace(/[\x1b\x80-\x9f]/g, ''));
}, true);

function connectTerminal() {
  const spec = term.spec;
  const xterm = term.xterm;
  if (!spec || term.ended || gone) return;
  const q = new URLSearchParams({ sandbox: spec.sandbox });
  if (spec.branch) q.set('branch', spec.branch);
  if (spec.shell) q.set('shell', '1');
  const ws = new WebSocket((location.protocol === 'https:' ? 'wss://' : 'ws://') + location.host + '/api/terminal?' + q);
  ws.binaryType = 'arraybuffer';
  ws.trusted = false;
  term.ws = ws;
  termStatus('connecting…');
  // What has been drawn, told to agentd every 64 KiB: it sends at most
  // a window ahead of it.
  let drawn = 0;
  let told = 0;
  ws.onmessage = (e) => {
    if (term.ws !== ws) return;
    if (typeof e.data !== 'string') {
      if (!ws.trusted) return;
      const bytes = new Uint8Array(e.data);
      xterm.write(bytes, () => {
        drawn += bytes.length;
        if (drawn - told >= 65536 && ws.readyState === WebSocket.OPEN) {
          told = drawn;
          ws.send(JSON.stringify({ type: 'ack', bytes: drawn }));
        }
      });
      return;
    }
    let m;
    try { m = JSON.parse(e.data); } catch (err) { return; }
    if (!ws.trusted) {
      // agentd speaks first, showing the session's token: until it has,
      // nothing is sent (whatever took the port after agentd went gets
      // neither the token nor any typing).
      if (m.type !== 'hello' || m.proof !== proof) {
        term.ended = true;
        ws.close();
        termStatus('This is no longer the console that logged you in: run `agentctl console` again.');
        return;
      }
      ws.trusted = true;
      ws.send(JSON.stringify({ type: 'open', csrf: proof, rows: xterm.rows, cols: xterm.cols }));
      return;
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
    // A shell hangs up with its connection: say so (typing into a new one
    // unawares would be a surprise).
    if (spec.shell || gone) {
      term.ended = true;
      termStatus('disconnected: the shell has ended; open it again');
      return;
    }
    // A session is as it was left: join it again (not for ever when it is
    // refused at once: logged out, or another agentd).
    if (!ws.trusted && ++term.refused >= 3) {
      term.ended = true;
      termStatus('disconnected: the console refuses the terminal; run `agentctl console` again');
      return;
    }
    if (ws.trusted) term.refused = 0;
    termStatus('disconnected; reconnecting…');
    setTimeout(connectTerminal, term.delay);
    term.delay = Math.min(term.delay * 2, 10000);
  };
}

window.addEventListener('resize', () => { if (term.fit) term.fit.fit(); });

window.addEventListener('hashchange', () => {
  selected = location.hash.slice(1);
  render();
  detailsAt = 0;
  refreshDetails();
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
