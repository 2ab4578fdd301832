// The Keystone Agent console: the live list of the caller's sandboxes and
// the agents waiting for them, from agentd's events WebSocket.
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
  render();
  start();
});
