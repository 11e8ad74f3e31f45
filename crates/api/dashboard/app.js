// cove's web console. Everything here goes through cove's public API with the
// key the person signs in with, so the page can do no more than that key.
//
// Rules this file keeps:
// - Text that a sandbox or a user controls (names, labels, file names, logs,
//   error messages) reaches the page as text nodes only (`h` below); nothing
//   is ever parsed as markup.
// - The key lives in this page's memory only: not in storage (a path-based
//   preview is served from this origin, and a page of the sandbox's could
//   read storage), never in a URL. A reload asks for it again.
'use strict';

(() => {
  const session = {
    key: null,
    keyName: null,
    organization: null,
    socket: null,
    live: false,
    sandboxes: new Map(),
    view: null,
    current: null,
    terminal: null,
    filters: { state: '', label: '' },
    openMenu: null,
  };

  // States a sandbox passes through on its way somewhere.
  const MOVING = new Set([
    'creating', 'starting', 'stopping', 'pausing', 'resuming', 'archiving',
    'destroying', 'restoring', 'snapshotting', 'pending_build', 'building_snapshot',
  ]);
  const STATES = [
    'started', 'stopped', 'paused', 'archived', 'error', 'build_failed',
    'creating', 'starting', 'stopping', 'pausing', 'archiving', 'destroying',
  ];

  // ---------------------------------------------------------------- helpers

  /** An element with properties and children; strings become text nodes. */
  function h(tag, props, ...children) {
    const node = document.createElement(tag);
    for (const [name, value] of Object.entries(props || {})) {
      if (value === undefined || value === null || value === false) continue;
      if (name.startsWith('on')) node.addEventListener(name.slice(2), value);
      else if (name === 'class') node.className = value;
      else if (name === 'dataset') Object.assign(node.dataset, value);
      else if (name === 'value' || name === 'checked' || name === 'disabled' || name === 'hidden') node[name] = value;
      else node.setAttribute(name, value === true ? '' : String(value));
    }
    for (const child of children.flat(Infinity)) {
      if (child === null || child === undefined || child === false) continue;
      node.append(child instanceof Node ? child : document.createTextNode(String(child)));
    }
    return node;
  }

  const $ = (selector, root = document) => root.querySelector(selector);

  // Icons drawn as SVG, so they show whatever fonts the machine has.
  const ICONS = {
    stop: [['rect', { x: 4, y: 4, width: 8, height: 8 }]],
    start: [['polygon', { points: '5,3 13,8 5,13' }]],
    delete: [['path', { d: 'M3 4h10M6 4V2.5h4V4M4.5 4l.7 9.5h5.6l.7-9.5', fill: 'none', stroke: 'currentColor', 'stroke-width': 1.3 }]],
    more: [['circle', { cx: 8, cy: 3.5, r: 1.3 }], ['circle', { cx: 8, cy: 8, r: 1.3 }], ['circle', { cx: 8, cy: 12.5, r: 1.3 }]],
  };

  function icon(name) {
    const ns = 'http://www.w3.org/2000/svg';
    const svg = document.createElementNS(ns, 'svg');
    svg.setAttribute('viewBox', '0 0 16 16');
    svg.setAttribute('width', '14');
    svg.setAttribute('height', '14');
    svg.setAttribute('aria-hidden', 'true');
    svg.setAttribute('fill', 'currentColor');
    for (const [tag, attributes] of ICONS[name]) {
      const shape = document.createElementNS(ns, tag);
      for (const [key, value] of Object.entries(attributes)) shape.setAttribute(key, String(value));
      svg.append(shape);
    }
    return svg;
  }

  class ApiFailure extends Error {
    constructor(status, message) {
      super(message);
      this.status = status;
    }
  }

  /** A request with the key; an answer that is not 2xx throws the API's own words. */
  async function request(url, { method = 'GET', body, raw = false } = {}) {
    const headers = {};
    if (session.key) headers.Authorization = `Bearer ${session.key}`;
    let payload = body;
    if (body !== undefined && !(body instanceof FormData)) {
      headers['Content-Type'] = 'application/json';
      payload = JSON.stringify(body);
    }
    let response;
    try {
      response = await fetch(url, { method, headers, body: payload, cache: 'no-store', credentials: 'omit' });
    } catch (error) {
      throw new ApiFailure(0, `cove did not answer: ${error.message}`);
    }
    if (!response.ok) {
      const text = await response.text();
      let message = text || response.statusText;
      try {
        const parsed = JSON.parse(text);
        message = parsed.message ?? parsed.error ?? text;
        if (Array.isArray(message)) message = message.join('; ');
      } catch { /* not JSON: the text as it came */ }
      throw new ApiFailure(response.status, `${response.status}: ${message}`);
    }
    if (raw) return response;
    const text = await response.text();
    if (!text) return null;
    try {
      return JSON.parse(text);
    } catch {
      return text;
    }
  }

  const api = (path, options) => request(`/api${path}`, options);
  const toolbox = (id, path, options) => request(`/toolbox/${encodeURIComponent(id)}${path}`, options);
  const enc = encodeURIComponent;

  function notify(message, kind = 'error') {
    const notice = $('#notice');
    notice.textContent = message;
    notice.className = kind === 'info' ? 'info' : '';
    notice.hidden = false;
    clearTimeout(notify.timer);
    notify.timer = setTimeout(() => { notice.hidden = true; }, kind === 'info' ? 5000 : 15000);
  }

  /** Runs an action; its failure is shown as the API worded it. */
  async function act(action) {
    try {
      return await action();
    } catch (error) {
      notify(error.message);
      return undefined;
    }
  }

  function ago(iso) {
    const seconds = Math.max(0, (Date.now() - Date.parse(iso)) / 1000);
    if (!Number.isFinite(seconds)) return '';
    if (seconds < 60) return `${Math.floor(seconds)}s`;
    if (seconds < 3600) return `${Math.floor(seconds / 60)}m`;
    if (seconds < 86400) return `${Math.floor(seconds / 3600)}h`;
    return `${Math.floor(seconds / 86400)}d`;
  }

  function bytes(n) {
    if (n === null || n === undefined) return '';
    const units = ['B', 'KiB', 'MiB', 'GiB', 'TiB'];
    let i = 0;
    let v = Number(n);
    while (v >= 1024 && i < units.length - 1) { v /= 1024; i += 1; }
    return `${i ? v.toFixed(1) : v} ${units[i]}`;
  }

  /** `KEY=VALUE` lines as an object; a line without `=` is refused by name. */
  function pairs(text, what) {
    const out = {};
    for (const line of text.split('\n').map((l) => l.trim()).filter(Boolean)) {
      const at = line.indexOf('=');
      if (at < 1) throw new Error(`${what}: "${line}" is not KEY=VALUE`);
      out[line.slice(0, at).trim()] = line.slice(at + 1);
    }
    return out;
  }

  function base64url(text) {
    const data = new TextEncoder().encode(text);
    let binary = '';
    for (const byte of data) binary += String.fromCharCode(byte);
    return btoa(binary).replace(/\+/g, '-').replace(/\//g, '_').replace(/=+$/, '');
  }

  const wsBase = () => `${location.protocol === 'https:' ? 'wss:' : 'ws:'}//${location.host}`;

  /** A URL the server made, as a link; anything but http(s) is shown as text. */
  function link(url, text) {
    if (!/^https?:\/\//i.test(url)) return h('span', {}, text || url);
    return h('a', { href: url, target: '_blank', rel: 'noopener noreferrer' }, text || url);
  }

  function dialog(title, body, buttons) {
    const node = h('dialog', {}, h('h2', {}, title), body, h('div', { class: 'toolbar' }, h('span', { class: 'grow' }), buttons));
    document.body.append(node);
    node.addEventListener('close', () => node.remove());
    node.showModal();
    return node;
  }

  /** Asks yes or no in the page (no native dialogs: they block the page). */
  function confirmAction(question) {
    return new Promise((resolve) => {
      let answer = false;
      const node = dialog('Are you sure?', h('p', {}, question), [
        h('button', { type: 'button', id: 'confirm-cancel', onclick: () => node.close() }, 'Cancel'),
        h('button', { type: 'button', id: 'confirm-ok', class: 'primary', onclick: () => { answer = true; node.close(); } }, 'Yes'),
      ]);
      node.addEventListener('close', () => resolve(answer));
    });
  }

  // ------------------------------------------------------------ sign in

  function showChrome(signedIn) {
    $('#nav').hidden = !signedIn;
    $('#live').hidden = !signedIn;
    $('#who').hidden = !signedIn;
    $('#sign-out').hidden = !signedIn;
  }

  function renderSignIn() {
    showChrome(false);
    const error = h('p', { id: 'sign-in-error', class: 'error' });
    const key = h('input', { id: 'key', type: 'password', autocomplete: 'off', placeholder: 'API key', required: true });
    const form = h('form', { id: 'sign-in-form' },
      key,
      h('button', { id: 'sign-in', class: 'primary', type: 'submit' }, 'Sign in'),
      error);
    form.addEventListener('submit', async (event) => {
      event.preventDefault();
      error.textContent = '';
      try {
        await signIn(key.value.trim());
      } catch (failure) {
        error.textContent = failure.message;
      }
    });
    $('#main').replaceChildren(h('div', { class: 'card signin' },
      h('h1', {}, 'Sign in to cove'),
      h('p', { class: 'muted' }, 'Paste an API key. It stays in this page\'s memory: reloading the page asks for it again.'),
      form));
    key.focus();
  }

  async function signIn(key) {
    if (!key) throw new Error('enter an API key');
    session.key = key;
    try {
      const me = await api('/api-keys/current');
      const organizations = await api('/organizations');
      const list = Array.isArray(organizations) ? organizations : [];
      const home = list.find((o) => o.id === 'cove') || list[0];
      session.keyName = me.name;
      session.organization = home ? home.id : 'cove';
    } catch (failure) {
      session.key = null;
      throw failure;
    }
    $('#who').textContent = `${session.keyName} · ${session.organization}`;
    showChrome(true);
    connectEvents();
    if (!location.hash || location.hash === '#/' || location.hash === '#') location.hash = '#/sandboxes';
    else route();
  }

  function signOut() {
    session.key = null;
    const socket = session.socket;
    session.socket = null;
    if (socket) socket.close();
    closeTerminal();
    session.sandboxes.clear();
    location.hash = '#/';
    renderSignIn();
  }

  // ------------------------------------------------------- live events

  function setLive(on) {
    session.live = on;
    const badge = $('#live');
    badge.textContent = on ? 'live' : 'offline';
    badge.classList.toggle('on', on);
  }

  /** Socket.IO (Engine.IO 4 over a WebSocket), as the SDKs use it: the key
   * goes in the namespace CONNECT packet, never in the URL. */
  function connectEvents() {
    const socket = new WebSocket(`${wsBase()}/api/socket.io/?EIO=4&transport=websocket`);
    session.socket = socket;
    socket.onmessage = (message) => {
      const data = String(message.data);
      if (data[0] === '0') socket.send(`40${JSON.stringify({ token: session.key })}`);
      else if (data[0] === '2') socket.send('3');
      else if (data.startsWith('40')) {
        setLive(true);
        // Whatever happened while the socket was away.
        refreshListing();
      } else if (data.startsWith('44')) {
        const refusal = JSON.parse(data.slice(2) || '{}');
        notify(`live events refused: ${refusal.message || 'no reason given'}`);
      } else if (data.startsWith('42')) {
        const [name, payload] = JSON.parse(data.slice(2));
        const sandbox = name === 'sandbox.created' ? payload : payload && payload.sandbox;
        if (sandbox && sandbox.id) remember(sandbox);
      }
    };
    socket.onclose = () => {
      if (session.socket !== socket) return;
      setLive(false);
      setTimeout(() => {
        if (session.socket === socket && session.key) connectEvents();
      }, 2000);
    };
  }

  /** Keeps the newer of what is known and `sandbox`, and shows it. */
  function remember(sandbox) {
    const known = session.sandboxes.get(sandbox.id);
    if (known && Date.parse(known.updatedAt) > Date.parse(sandbox.updatedAt)) return;
    if (sandbox.state === 'destroyed') session.sandboxes.delete(sandbox.id);
    else session.sandboxes.set(sandbox.id, sandbox);
    if (session.view === 'sandboxes') fillSandboxTable();
    if (session.view === 'sandbox') {
      if (sandbox.id === session.current) showSandboxHeader(sandbox);
      if (sandbox.parentSandboxId === session.current || sandbox.id === session.current) refreshForkTree();
    }
  }

  function forget(id) {
    session.sandboxes.delete(id);
    if (session.view === 'sandboxes') fillSandboxTable();
  }

  // ------------------------------------------------------------ router

  function route() {
    if (!session.key) {
      renderSignIn();
      return;
    }
    closeTerminal();
    closeMenu();
    const [, page = 'sandboxes', id] = location.hash.replace(/^#/, '').split('/');
    session.view = page;
    session.current = null;
    for (const a of document.querySelectorAll('#nav a')) {
      a.classList.toggle('active', a.dataset.nav === page || (page === 'sandbox' && a.dataset.nav === 'sandboxes'));
    }
    const pages = {
      sandboxes: renderSandboxes,
      sandbox: () => renderSandbox(decodeURIComponent(id || '')),
      snapshots: renderSnapshots,
      volumes: renderVolumes,
      registries: renderRegistries,
      usage: renderUsage,
    };
    (pages[page] || renderSandboxes)();
  }

  function refreshListing() {
    if (session.view === 'sandboxes') act(loadSandboxes).then(fillSandboxTable);
    if (session.view === 'sandbox' && session.current) {
      act(() => api(`/sandbox/${enc(session.current)}`)).then((s) => s && remember(s));
    }
  }

  // ----------------------------------------------------- sandbox actions

  const ACTIONS = {
    stop: { label: 'Stop', icon: 'stop', can: (s) => s.state === 'started', run: (s) => api(`/sandbox/${enc(s.id)}/stop`, { method: 'POST' }) },
    start: { label: 'Start', icon: 'start', can: (s) => ['stopped', 'archived', 'paused', 'error'].includes(s.state), run: (s) => api(`/sandbox/${enc(s.id)}/start`, { method: 'POST' }) },
    pause: { label: 'Pause', can: (s) => s.state === 'started', run: (s) => api(`/sandbox/${enc(s.id)}/pause`, { method: 'POST' }) },
    resume: { label: 'Resume', can: (s) => s.state === 'paused', run: (s) => api(`/vms/${enc(s.id)}/resume`, { method: 'POST' }) },
    fork: {
      label: 'Fork',
      can: (s) => s.state === 'started' || s.state === 'paused',
      run: async (s) => {
        const child = await api(`/sandbox/${enc(s.id)}/fork`, { method: 'POST', body: {} });
        if (child && child.id) {
          remember(child);
          notify(`forked ${s.name} into ${child.name}`, 'info');
        }
      },
    },
    snapshot: { label: 'Snapshot…', can: (s) => s.state === 'started' || s.state === 'stopped' || s.state === 'paused', run: (s) => takeSnapshot(s) },
    archive: { label: 'Archive', can: (s) => s.state === 'stopped', run: (s) => api(`/sandbox/${enc(s.id)}/archive`, { method: 'POST' }) },
    delete: {
      label: 'Delete',
      icon: 'delete',
      can: (s) => !MOVING.has(s.state) || s.state === 'error',
      run: async (s) => {
        if (!(await confirmAction(`Delete ${s.name}? Its files go with it.`))) return;
        await api(`/sandbox/${enc(s.id)}`, { method: 'DELETE' });
        forget(s.id);
        if (session.view === 'sandbox' && session.current === s.id) location.hash = '#/sandboxes';
      },
    },
  };
  const MENU = ['pause', 'resume', 'fork', 'snapshot', 'archive'];

  async function perform(name, sandbox) {
    closeMenu();
    const done = await act(async () => {
      await ACTIONS[name].run(sandbox);
      return true;
    });
    // The event feed shows the change; a read afterwards makes sure of it.
    if (done && name !== 'delete' && session.sandboxes.has(sandbox.id)) {
      const now = await act(() => api(`/sandbox/${enc(sandbox.id)}`));
      if (now) remember(now);
    }
  }

  function controls(sandbox) {
    const button = (name) => h('button', {
      type: 'button',
      class: 'icon',
      title: ACTIONS[name].label,
      'aria-label': ACTIONS[name].label,
      dataset: { action: name },
      disabled: !ACTIONS[name].can(sandbox),
      onclick: () => perform(name, sandbox),
    }, icon(ACTIONS[name].icon));
    const more = h('button', {
      type: 'button', class: 'icon', title: 'More', 'aria-label': 'More', dataset: { action: 'menu' },
      onclick: (event) => {
        event.stopPropagation();
        const open = session.openMenu && session.openMenu.dataset.for === sandbox.id;
        closeMenu();
        if (!open) openMenu(sandbox, more.parentNode);
      },
    }, icon('more'));
    return h('span', { class: 'controls' }, button('stop'), ' ', button('start'), ' ', button('delete'), ' ', more);
  }

  function openMenu(sandbox, anchor) {
    const menu = h('div', { class: 'menu', role: 'menu', dataset: { for: sandbox.id } },
      MENU.map((name) => h('button', {
        type: 'button', role: 'menuitem', dataset: { menu: name },
        disabled: !ACTIONS[name].can(sandbox),
        onclick: (event) => { event.stopPropagation(); perform(name, sandbox); },
      }, ACTIONS[name].label)));
    anchor.append(menu);
    session.openMenu = menu;
  }

  function closeMenu() {
    if (session.openMenu) session.openMenu.remove();
    session.openMenu = null;
  }
  document.addEventListener('click', closeMenu);

  function takeSnapshot(sandbox) {
    return new Promise((resolve, reject) => {
      const name = h('input', { id: 'snapshot-name', required: true, value: `${sandbox.name}-${new Date().toISOString().slice(0, 19).replace(/[:T]/g, '-')}` });
      const memory = h('input', { id: 'snapshot-memory', type: 'checkbox', checked: sandbox.sandboxClass === 'linux-vm' && sandbox.state === 'started' });
      const error = h('p', { class: 'error' });
      const node = dialog(`Snapshot ${sandbox.name}`, h('form', { class: 'grid' },
        h('label', { for: 'snapshot-name' }, 'Name'), name,
        h('label', { for: 'snapshot-memory' }, 'With memory (VM)'), memory,
        h('div', { class: 'full' }, error)), [
        h('button', { type: 'button', onclick: () => { node.close(); resolve(); } }, 'Cancel'),
        h('button', {
          type: 'button', id: 'snapshot-submit', class: 'primary',
          onclick: async () => {
            try {
              const taken = await api(`/sandbox/${enc(sandbox.id)}/snapshot`, { method: 'POST', body: { name: name.value.trim(), includeMemory: memory.checked } });
              node.close();
              notify(`snapshot ${(taken && taken.name) || name.value} taken`, 'info');
              resolve();
            } catch (failure) {
              error.textContent = failure.message;
            }
          },
        }, 'Take snapshot'),
      ]);
      node.addEventListener('cancel', () => resolve());
      void reject;
    });
  }

  // ---------------------------------------------------------- sandboxes

  async function loadSandboxes() {
    const all = [];
    let cursor = null;
    do {
      const page = await api(`/sandbox?limit=200${cursor ? `&cursor=${enc(cursor)}` : ''}`);
      all.push(...(page.items || []));
      cursor = page.nextCursor;
    } while (cursor);
    session.sandboxes = new Map(all.map((s) => [s.id, s]));
  }

  function matchesFilters(sandbox) {
    const { state, label } = session.filters;
    if (state && sandbox.state !== state) return false;
    if (label) {
      const at = label.indexOf('=');
      const key = at < 0 ? label : label.slice(0, at);
      if (!(key in (sandbox.labels || {}))) return false;
      if (at >= 0 && sandbox.labels[key] !== label.slice(at + 1)) return false;
    }
    return true;
  }

  function resources(s) {
    return `${s.cpu} vCPU · ${s.memory} GiB · ${s.disk} GiB`;
  }

  function sandboxRow(s) {
    return h('tr', { dataset: { id: s.id, name: s.name } },
      h('td', {}, h('a', { href: `#/sandbox/${enc(s.id)}`, class: 'name' }, s.name)),
      h('td', { class: 'class' }, s.sandboxClass),
      h('td', {}, h('span', { class: 'state', dataset: { state: s.state } }, s.state)),
      h('td', { class: 'muted' }, resources(s)),
      h('td', { class: 'labels' }, Object.entries(s.labels || {}).map(([k, v]) => h('span', {}, `${k}=${v}`))),
      h('td', { class: 'muted', title: s.createdAt }, ago(s.createdAt)),
      h('td', { class: 'controls' }, controls(s)));
  }

  function fillSandboxTable() {
    const body = $('#sandboxes tbody');
    if (!body) return;
    // An open menu belongs to a row about to be replaced.
    const menuFor = session.openMenu && session.openMenu.dataset.for;
    // A row is made again only when its sandbox changed, so a row a person
    // is about to click is not swapped under the pointer by another's event.
    const made = fillSandboxTable.rows || new Map();
    const rows = [...session.sandboxes.values()]
      .filter(matchesFilters)
      .sort((a, b) => Date.parse(b.createdAt) - Date.parse(a.createdAt))
      .map((sandbox) => {
        const known = made.get(sandbox.id);
        if (known && known.sandbox === sandbox && known.row.parentNode === body) return known.row;
        const row = sandboxRow(sandbox);
        made.set(sandbox.id, { sandbox, row });
        return row;
      });
    for (const id of made.keys()) if (!session.sandboxes.has(id)) made.delete(id);
    fillSandboxTable.rows = made;
    body.replaceChildren(...(rows.length ? rows : [h('tr', {}, h('td', { colspan: 7, class: 'muted' }, 'No sandboxes here yet.'))]));
    closeMenu();
    if (menuFor && session.sandboxes.has(menuFor)) {
      const row = body.querySelector(`tr[data-id="${CSS.escape(menuFor)}"] td.controls span`);
      if (row) openMenu(session.sandboxes.get(menuFor), row);
    }
  }

  async function renderSandboxes() {
    const state = h('select', { id: 'filter-state', onchange: () => { session.filters.state = state.value; fillSandboxTable(); } },
      h('option', { value: '' }, 'every state'), STATES.map((s) => h('option', { value: s }, s)));
    state.value = session.filters.state;
    const label = h('input', { id: 'filter-label', placeholder: 'label key=value', value: session.filters.label,
      oninput: () => { session.filters.label = label.value.trim(); fillSandboxTable(); } });
    $('#main').replaceChildren(
      h('h1', {}, 'Sandboxes'),
      h('div', { class: 'toolbar' }, state, label, h('span', { class: 'grow' }),
        h('button', { id: 'create-open', type: 'button', class: 'primary', onclick: openCreate }, 'Create sandbox')),
      h('table', { id: 'sandboxes' },
        h('thead', {}, h('tr', {}, ['Name', 'Class', 'State', 'Resources', 'Labels', 'Age', ''].map((t) => h('th', {}, t)))),
        h('tbody', {})));
    await act(loadSandboxes);
    fillSandboxTable();
  }

  async function loadSnapshots() {
    const all = [];
    for (let page = 1; ; page += 1) {
      const answer = await api(`/snapshots?page=${page}&limit=100`);
      all.push(...(answer.items || []));
      if (page >= (answer.totalPages || 1)) break;
    }
    return all;
  }

  async function openCreate() {
    const snapshots = (await act(loadSnapshots)) || [];
    const field = (id, label, input) => [h('label', { for: id }, label), input];
    const number = (id, placeholder) => h('input', { id, type: 'number', min: '-1', placeholder: placeholder || 'default' });
    const klass = h('select', { id: 'create-class' }, h('option', { value: 'container' }, 'container'), h('option', { value: 'linux-vm' }, 'linux-vm (a QEMU microVM)'));
    const source = h('select', { id: 'create-source' }, h('option', { value: 'snapshot' }, 'a snapshot'), h('option', { value: 'image' }, 'an image'));
    const snapshot = h('select', { id: 'create-snapshot' });
    const image = h('input', { id: 'create-image', placeholder: 'e.g. python:3.12-slim' });
    const fill = () => {
      const usable = snapshots.filter((s) => s.state === 'active' && s.sandboxClass === klass.value);
      snapshot.replaceChildren(h('option', { value: '' }, klass.value === 'linux-vm' ? 'the default VM' : 'the default image'),
        usable.map((s) => h('option', { value: s.name }, `${s.name}${s.general ? '' : ' (yours)'}`)));
      const fromImage = source.value === 'image';
      snapshot.disabled = fromImage;
      image.disabled = !fromImage;
    };
    klass.addEventListener('change', fill);
    source.addEventListener('change', fill);
    fill();
    const inputs = {
      name: h('input', { id: 'create-name', placeholder: 'chosen by cove' }),
      cpu: number('create-cpu'),
      memory: number('create-memory'),
      disk: number('create-disk'),
      env: h('textarea', { id: 'create-env', placeholder: 'KEY=value, one a line' }),
      labels: h('textarea', { id: 'create-labels', placeholder: 'key=value, one a line' }),
      autoStopInterval: number('create-autostop', 'minutes (0: never)'),
      autoPauseInterval: number('create-autopause', 'minutes'),
      autoArchiveInterval: number('create-autoarchive', 'minutes'),
      autoDeleteInterval: number('create-autodelete', 'minutes (-1: never)'),
      ttlMinutes: number('create-ttl', 'minutes'),
    };
    const error = h('p', { id: 'create-error', class: 'error' });
    const submit = h('button', { type: 'button', id: 'create-submit', class: 'primary' }, 'Create');
    const node = dialog('Create a sandbox', h('form', { class: 'grid', id: 'create-form' },
      field('create-name', 'Name', inputs.name),
      field('create-class', 'Class', klass),
      field('create-source', 'From', source),
      field('create-snapshot', 'Snapshot', snapshot),
      field('create-image', 'Image', image),
      field('create-cpu', 'vCPUs', inputs.cpu),
      field('create-memory', 'Memory (GiB)', inputs.memory),
      field('create-disk', 'Disk (GiB)', inputs.disk),
      field('create-env', 'Environment', inputs.env),
      field('create-labels', 'Labels', inputs.labels),
      field('create-autostop', 'Auto-stop', inputs.autoStopInterval),
      field('create-autopause', 'Auto-pause', inputs.autoPauseInterval),
      field('create-autoarchive', 'Auto-archive', inputs.autoArchiveInterval),
      field('create-autodelete', 'Auto-delete', inputs.autoDeleteInterval),
      field('create-ttl', 'Time to live', inputs.ttlMinutes),
      h('div', { class: 'full' }, error)), [
      h('button', { type: 'button', onclick: () => node.close() }, 'Cancel'),
      submit,
    ]);
    submit.addEventListener('click', async () => {
      error.textContent = '';
      let body;
      try {
        body = {
          env: pairs(inputs.env.value, 'environment'),
          labels: pairs(inputs.labels.value, 'labels'),
        };
      } catch (failure) {
        error.textContent = failure.message;
        return;
      }
      if (inputs.name.value.trim()) body.name = inputs.name.value.trim();
      for (const key of ['cpu', 'memory', 'disk', 'autoStopInterval', 'autoPauseInterval', 'autoArchiveInterval', 'autoDeleteInterval', 'ttlMinutes']) {
        if (inputs[key].value !== '') body[key] = Number(inputs[key].value);
      }
      if (source.value === 'image') {
        if (!image.value.trim()) {
          error.textContent = 'name an image, or create from a snapshot';
          return;
        }
        body.buildInfo = { dockerfileContent: `FROM ${image.value.trim()}\n` };
      } else if (snapshot.value) {
        body.snapshot = snapshot.value;
      } else if (klass.value === 'linux-vm') {
        body.snapshot = 'daytona-vm-small';
      }
      submit.disabled = true;
      try {
        const created = await api('/sandbox', { method: 'POST', body });
        node.close();
        if (created && created.id) remember(created);
      } catch (failure) {
        error.textContent = failure.message;
      } finally {
        submit.disabled = false;
      }
    });
  }

  // ------------------------------------------------------- one sandbox

  const TABS = ['terminal', 'files', 'sessions', 'previews', 'desktop', 'timers', 'snapshots', 'forks'];

  function showSandboxHeader(sandbox) {
    const header = $('#sandbox-header');
    if (!header) return;
    header.replaceChildren(
      h('h1', {}, sandbox.name, ' ', h('span', { id: 'sandbox-state', class: 'state', dataset: { state: sandbox.state } }, sandbox.state)),
      h('p', { class: 'muted' },
        `${sandbox.sandboxClass}${sandbox.accelerator ? ` (${sandbox.accelerator})` : ''} · ${resources(sandbox)} · id ${sandbox.id} · created ${ago(sandbox.createdAt)} ago`,
        sandbox.errorReason ? h('span', { class: 'error' }, ` · ${sandbox.errorReason}`) : null),
      h('div', { class: 'toolbar', id: 'sandbox-controls' }, controls(sandbox)));
  }

  async function renderSandbox(id) {
    session.current = id;
    const header = h('div', { id: 'sandbox-header' });
    const tabs = h('div', { class: 'tabs', role: 'tablist' });
    const panel = h('div', { id: 'panel', class: 'card' });
    $('#main').replaceChildren(h('p', {}, h('a', { href: '#/sandboxes' }, '← Sandboxes')), header, tabs, panel);
    let sandbox;
    try {
      sandbox = await api(`/sandbox/${enc(id)}`);
    } catch (failure) {
      header.replaceChildren(h('p', { class: 'error' }, failure.message));
      return;
    }
    session.current = sandbox.id;
    session.sandboxes.set(sandbox.id, sandbox);
    showSandboxHeader(sandbox);
    const show = (name) => {
      closeTerminal();
      for (const button of tabs.children) button.classList.toggle('active', button.dataset.tab === name);
      // Each showing gets a view of its own: a tab still loading when
      // another is chosen fills its own, detached view, not the new tab's.
      const view = h('div', { class: 'tab-view', dataset: { tab: name } });
      panel.replaceChildren(view);
      const current = session.sandboxes.get(sandbox.id) || sandbox;
      TAB_VIEWS[name](current, view);
    };
    tabs.append(...TABS.map((name) => h('button', { type: 'button', role: 'tab', dataset: { tab: name }, onclick: () => show(name) },
      name[0].toUpperCase() + name.slice(1))));
    show('terminal');
  }

  const TAB_VIEWS = {
    terminal: terminalTab,
    files: filesTab,
    sessions: sessionsTab,
    previews: previewsTab,
    desktop: desktopTab,
    timers: timersTab,
    snapshots: snapshotsTab,
    forks: forksTab,
  };

  // The terminal: a PTY session of the toolbox over its WebSocket. A browser
  // cannot set Authorization on a WebSocket, so the key is offered as a
  // subprotocol; cove takes it off before the sandbox sees the request.
  function terminalTab(sandbox, panel) {
    if (typeof window.Terminal !== 'function') {
      panel.append(h('p', { class: 'error' }, 'This cove was built without xterm.js, so it has no web terminal: run scripts/setup (it installs crates/api/dashboard\'s packages), then cargo build.'));
      return;
    }
    const screen = h('div', { id: 'terminal' });
    panel.append(
      h('div', { class: 'toolbar' },
        h('button', { type: 'button', id: 'terminal-open', class: 'primary', disabled: sandbox.state !== 'started', onclick: () => act(() => openTerminal(sandbox.id, screen)) }, 'Open a terminal'),
        h('span', { class: 'muted' }, sandbox.state === 'started' ? `a shell as ${sandbox.user}` : 'start the sandbox to open a terminal')),
      screen);
  }

  async function openTerminal(id, screen) {
    closeTerminal();
    screen.replaceChildren();
    // A link the sandbox prints (OSC 8) opens only if it is http(s), in a
    // tab of its own that keeps no handle on this page, without a prompt.
    const linkHandler = {
      activate: (_event, uri) => {
        if (/^https?:\/\//i.test(uri)) window.open(uri, '_blank', 'noopener,noreferrer');
      },
    };
    const term = new window.Terminal({ cursorBlink: true, fontSize: 13, scrollback: 2000, linkHandler });
    term.open(screen);
    const cols = Math.max(40, Math.floor((screen.clientWidth - 12) / 7.9));
    const rows = Math.max(10, Math.floor((screen.clientHeight - 8) / 17));
    term.resize(cols, rows);
    const ptyId = `dashboard-${Array.from(crypto.getRandomValues(new Uint8Array(6)), (b) => b.toString(16).padStart(2, '0')).join('')}`;
    // Lazy: the shell starts when the socket joins, so its first prompt is
    // not printed to nobody.
    await toolbox(id, '/process/pty', { method: 'POST', body: { id: ptyId, cols, rows, lazyStart: true } });
    const socket = new WebSocket(`${wsBase()}/toolbox/${enc(id)}/process/pty/${enc(ptyId)}/connect`, ['cove', `cove.key.${base64url(session.key)}`]);
    socket.binaryType = 'arraybuffer';
    const encoder = new TextEncoder();
    socket.onmessage = (message) => {
      if (typeof message.data === 'string') {
        try {
          const control = JSON.parse(message.data);
          if (control && control.type === 'control') {
            if (control.status === 'connected') term.focus();
            else if (control.status !== undefined) term.write(`\r\n[${control.status}${control.error ? `: ${control.error}` : ''}]\r\n`);
            return;
          }
        } catch { /* terminal text */ }
        term.write(message.data);
      } else {
        term.write(new Uint8Array(message.data));
      }
    };
    socket.onclose = () => term.write('\r\n[the terminal is closed]\r\n');
    term.onData((data) => {
      if (socket.readyState === WebSocket.OPEN) socket.send(encoder.encode(data));
    });
    session.terminal = { term, socket, ptyId, sandbox: id };
  }

  function closeTerminal() {
    const terminal = session.terminal;
    if (!terminal) return;
    session.terminal = null;
    terminal.socket.onclose = null;
    terminal.socket.close();
    terminal.term.dispose();
    // The shell goes with the page's terminal.
    toolbox(terminal.sandbox, `/process/pty/${enc(terminal.ptyId)}`, { method: 'DELETE' }).catch(() => {});
  }

  async function filesTab(sandbox, panel) {
    if (sandbox.state !== 'started') {
      panel.append(h('p', { class: 'muted' }, 'Start the sandbox to browse its files.'));
      return;
    }
    const home = await act(() => toolbox(sandbox.id, '/user-home-dir'));
    const path = h('input', { id: 'files-path', size: 50, value: (home && home.dir) || '/' });
    const table = h('table', { id: 'files' },
      h('thead', {}, h('tr', {}, ['Name', 'Size', 'Modified', ''].map((t) => h('th', {}, t)))), h('tbody', {}));
    const chooser = h('input', { id: 'upload-file', type: 'file' });
    const join = (dir, name) => `${dir.replace(/\/+$/, '')}/${name}`;
    // Only the newest listing is shown: one asked for before an upload can
    // answer after the upload's own, and must not put back the older view.
    let asked = 0;
    const list = async () => {
      const dir = path.value.trim() || '/';
      const ask = ++asked;
      const entries = await act(() => toolbox(sandbox.id, `/files?path=${enc(dir)}`));
      if (!entries || ask !== asked) return;
      entries.sort((a, b) => (b.isDir - a.isDir) || a.name.localeCompare(b.name));
      table.tBodies[0].replaceChildren(...entries.map((entry) => h('tr', { dataset: { name: entry.name } },
        h('td', {}, entry.isDir
          ? h('a', { href: '#', class: 'dir', onclick: (e) => { e.preventDefault(); path.value = join(dir, entry.name); list(); } }, `${entry.name}/`)
          : entry.name),
        h('td', { class: 'muted' }, entry.isDir ? '' : bytes(entry.size)),
        h('td', { class: 'muted' }, entry.modifiedAt || entry.modTime || ''),
        h('td', {}, entry.isDir ? null : h('button', {
          type: 'button', class: 'download', dataset: { name: entry.name },
          onclick: () => act(() => download(sandbox.id, join(dir, entry.name), entry.name)),
        }, 'Download')))));
    };
    const upload = async () => {
      const file = chooser.files[0];
      if (!file) throw new Error('choose a file to upload first');
      const form = new FormData();
      form.append('file', file, file.name);
      const target = join(path.value.trim() || '/', file.name);
      await toolbox(sandbox.id, `/files/upload-v2?path=${enc(target)}`, { method: 'POST', body: form });
      notify(`uploaded ${target}`, 'info');
      chooser.value = '';
      await list();
    };
    panel.append(
      h('div', { class: 'toolbar' },
        path,
        h('button', { type: 'button', id: 'files-open', onclick: list }, 'Open'),
        h('button', { type: 'button', id: 'files-up', onclick: () => { path.value = path.value.replace(/\/+$/, '').replace(/\/[^/]*$/, '') || '/'; list(); } }, 'Up'),
        h('span', { class: 'grow' }),
        chooser,
        h('button', { type: 'button', id: 'upload', onclick: () => act(upload) }, 'Upload')),
      table);
    path.addEventListener('keydown', (event) => { if (event.key === 'Enter') list(); });
    await list();
  }

  async function download(id, path, name) {
    const response = await toolbox(id, `/files/download?path=${enc(path)}`, { raw: true });
    const url = URL.createObjectURL(await response.blob());
    const anchor = h('a', { href: url, download: name, hidden: true });
    document.body.append(anchor);
    anchor.click();
    anchor.remove();
    setTimeout(() => URL.revokeObjectURL(url), 60000);
  }

  async function sessionsTab(sandbox, panel) {
    if (sandbox.state !== 'started') {
      panel.append(h('p', { class: 'muted' }, 'Start the sandbox to see its sessions.'));
      return;
    }
    const logs = h('pre', { id: 'session-logs', class: 'logs', hidden: true });
    const sessions = await act(() => toolbox(sandbox.id, '/process/session'));
    if (!sessions) return;
    if (!sessions.length) panel.append(h('p', { class: 'muted' }, 'No sessions. The SDK\'s process.create_session makes one.'));
    for (const one of sessions) {
      panel.append(h('h2', {}, one.sessionId), h('table', { class: 'session', dataset: { session: one.sessionId } },
        h('thead', {}, h('tr', {}, ['Command', 'Exit code', ''].map((t) => h('th', {}, t)))),
        h('tbody', {}, (one.commands || []).map((command) => h('tr', { dataset: { command: command.id } },
          h('td', {}, h('code', {}, command.command)),
          h('td', {}, command.exitCode ?? 'running'),
          h('td', {}, h('button', {
            type: 'button', class: 'logs',
            onclick: () => act(async () => {
              const answer = await toolbox(sandbox.id, `/process/session/${enc(one.sessionId)}/command/${enc(command.id)}/logs`);
              logs.textContent = typeof answer === 'string' ? answer : (answer.output ?? `${answer.stdout || ''}${answer.stderr || ''}`);
              logs.hidden = false;
            }),
          }, 'Logs')))))));
    }
    panel.append(logs);
  }

  function previewsTab(sandbox, panel) {
    const port = h('input', { id: 'preview-port', type: 'number', min: '1', max: '65535', value: '3000' });
    const out = h('p', { id: 'preview-link' });
    panel.append(
      h('p', { class: 'muted' }, 'A link to a port of the sandbox. It carries a token of its own that expires; it never carries your key.'),
      h('div', { class: 'toolbar' }, h('label', { for: 'preview-port' }, 'Port'), port,
        h('button', {
          type: 'button', id: 'preview-open',
          onclick: () => act(async () => {
            const answer = await api(`/sandbox/${enc(sandbox.id)}/ports/${enc(port.value)}/signed-preview-url?expiresInSeconds=3600`);
            out.replaceChildren(link(answer.url));
          }),
        }, 'Make a link')),
      out);
  }

  async function desktopTab(sandbox, panel) {
    panel.append(h('p', { class: 'muted' }, 'The sandbox\'s desktop (computer use), watched through noVNC on port 6080.'));
    if (sandbox.state !== 'started') {
      panel.append(h('p', { class: 'muted' }, 'Start the sandbox first.'));
      return;
    }
    try {
      const status = await toolbox(sandbox.id, '/computeruse/status');
      panel.append(h('p', { id: 'desktop-status' }, `computer use: ${status.status || JSON.stringify(status)}`));
      if (status.status === 'active') {
        const answer = await api(`/sandbox/${enc(sandbox.id)}/ports/6080/signed-preview-url?expiresInSeconds=3600`);
        // noVNC opens its WebSocket at `path` on the page's host: under a
        // path-based preview that is the preview's own prefix.
        const base = new URL(answer.url);
        const prefix = base.pathname.replace(/^\/+|\/+$/g, '');
        const socket = prefix ? `${prefix}/websockify` : 'websockify';
        const page = `${base.origin}/${prefix ? `${prefix}/` : ''}vnc.html`;
        panel.append(link(`${page}?autoconnect=true&resize=scale&path=${encodeURIComponent(socket)}`, 'Open the desktop'));
      }
    } catch (failure) {
      panel.append(h('p', { id: 'desktop-status', class: 'error' }, failure.message));
    }
  }

  const TIMERS = [
    ['autoStopInterval', 'autostop', 'Auto-stop', 'minutes idle before it stops (0: never)'],
    ['autoPauseInterval', 'autopause', 'Auto-pause', 'minutes idle before it pauses (0: never)'],
    ['autoArchiveInterval', 'autoarchive', 'Auto-archive', 'minutes stopped before it is archived'],
    ['autoDeleteInterval', 'autodelete', 'Auto-delete', 'minutes stopped before it is deleted (0: on stop, -1: never)'],
    ['ttlMinutes', 'ttl', 'Time to live', 'minutes after creation before it is deleted (0: no limit)'],
  ];

  function timersTab(sandbox, panel) {
    panel.append(h('table', { id: 'timers' },
      h('thead', {}, h('tr', {}, ['Timer', 'Now', 'Set to', ''].map((t) => h('th', {}, t)))),
      h('tbody', {}, TIMERS.map(([field, path, label, help]) => {
        const input = h('input', { type: 'number', min: '-1', dataset: { timer: path } });
        return h('tr', { dataset: { timer: path } },
          h('td', {}, label, h('div', { class: 'muted' }, help)),
          h('td', { class: 'now' }, String(sandbox[field] ?? '')),
          h('td', {}, input),
          h('td', {}, h('button', {
            type: 'button', class: 'set',
            onclick: () => act(async () => {
              if (input.value === '') throw new Error(`give ${label.toLowerCase()} in minutes`);
              await api(`/sandbox/${enc(sandbox.id)}/${path}/${enc(input.value)}`, { method: 'POST' });
              const now = await api(`/sandbox/${enc(sandbox.id)}`);
              remember(now);
              panel.replaceChildren();
              timersTab(now, panel);
            }),
          }, 'Set')));
      }))));
    if (sandbox.autoDestroyAt) panel.append(h('p', { class: 'muted' }, `deleted by its time to live at ${sandbox.autoDestroyAt}`));
  }

  async function snapshotsTab(sandbox, panel) {
    panel.append(h('div', { class: 'toolbar' },
      h('button', { type: 'button', id: 'snapshot-take', onclick: async () => { await perform('snapshot', sandbox); panel.replaceChildren(); snapshotsTab(sandbox, panel); } }, 'Take a snapshot')));
    const snapshots = await act(loadSnapshots);
    if (!snapshots) return;
    const own = snapshots.filter((s) => s.sourceSandboxId === sandbox.id);
    if (!own.length) {
      panel.append(h('p', { class: 'muted' }, 'No snapshots of this sandbox yet.'));
      return;
    }
    panel.append(h('table', { id: 'sandbox-snapshots' },
      h('thead', {}, h('tr', {}, ['Name', 'State', 'Memory', 'Created', ''].map((t) => h('th', {}, t)))),
      h('tbody', {}, own.map((s) => h('tr', { dataset: { name: s.name } },
        h('td', {}, s.name), h('td', {}, s.state), h('td', {}, s.includesMemory ? 'yes' : 'no'),
        h('td', { class: 'muted' }, ago(s.createdAt)),
        h('td', {}, h('button', {
          type: 'button', class: 'revert',
          onclick: () => act(async () => {
            if (!(await confirmAction(`Revert ${sandbox.name} to ${s.name}? What changed since is lost.`))) return;
            await api(`/sandbox/${enc(sandbox.id)}/revert`, { method: 'POST', body: { snapshot: s.id } });
            notify(`${sandbox.name} reverted to ${s.name}`, 'info');
          }),
        }, 'Revert')))))));
  }

  // The fork tree: from the oldest ancestor down, each sandbox's forks.
  async function forksTab(sandbox, panel) {
    panel.append(h('div', { class: 'toolbar' },
      h('button', { type: 'button', id: 'fork-here', disabled: !ACTIONS.fork.can(sandbox), onclick: () => perform('fork', sandbox) }, 'Fork')),
    h('div', { id: 'fork-tree-holder' }));
    await drawForkTree(sandbox.id);
  }

  let treeDrawing = null;
  function refreshForkTree() {
    if (!$('#fork-tree-holder') || !session.current) return;
    // One drawing at a time; a change during one draws again after it.
    if (treeDrawing) {
      treeDrawing.again = true;
      return;
    }
    treeDrawing = { again: false };
    drawForkTree(session.current).finally(() => {
      const again = treeDrawing.again;
      treeDrawing = null;
      if (again) refreshForkTree();
    });
  }

  async function drawForkTree(id) {
    const holder = $('#fork-tree-holder');
    if (!holder) return;
    const tree = await act(async () => {
      const ancestors = await api(`/sandbox/${enc(id)}/ancestors`);
      const root = ancestors.length ? ancestors[ancestors.length - 1] : await api(`/sandbox/${enc(id)}`);
      const seen = new Set();
      const branch = async (node) => {
        seen.add(node.id);
        const children = (await api(`/sandbox/${enc(node.id)}/forks`)).filter((c) => !seen.has(c.id));
        return h('li', { dataset: { id: node.id }, class: node.id === id ? 'current' : '' },
          h('a', { href: `#/sandbox/${enc(node.id)}` }, node.name), ' ',
          h('span', { class: 'state', dataset: { state: node.state } }, node.state),
          children.length ? h('ul', { class: 'tree' }, await Promise.all(children.map(branch))) : null);
      };
      return h('ul', { class: 'tree', id: 'fork-tree' }, await branch(root));
    });
    if (tree && $('#fork-tree-holder') === holder) holder.replaceChildren(tree);
  }

  // ------------------------------------------------ snapshots, volumes, registries

  function listPage(title, columns, rows, createForm) {
    $('#main').replaceChildren(h('h1', {}, title), createForm || '',
      h('table', { class: 'list' },
        h('thead', {}, h('tr', {}, columns.map((c) => h('th', {}, c)), h('th', {}))),
        h('tbody', {}, rows.length ? rows : h('tr', {}, h('td', { colspan: columns.length + 1, class: 'muted' }, 'None yet.')))));
  }

  function deleteButton(what, name, remove, after) {
    return h('button', {
      type: 'button', class: 'delete',
      onclick: () => act(async () => {
        if (!(await confirmAction(`Delete ${what} ${name}?`))) return;
        await remove();
        after();
      }),
    }, 'Delete');
  }

  async function renderSnapshots() {
    const snapshots = (await act(loadSnapshots)) || [];
    const name = h('input', { id: 'snapshot-new-name', placeholder: 'name' });
    const image = h('input', { id: 'snapshot-new-image', placeholder: 'image, e.g. python:3.12-slim' });
    const form = h('div', { class: 'card toolbar' }, h('strong', {}, 'New snapshot from an image'), name, image,
      h('button', {
        type: 'button', class: 'primary', id: 'snapshot-create',
        onclick: () => act(async () => {
          await api('/snapshots', { method: 'POST', body: { name: name.value.trim(), imageName: image.value.trim() } });
          renderSnapshots();
        }),
      }, 'Create'));
    listPage('Snapshots', ['Name', 'Class', 'State', 'Size', 'Memory', 'From sandbox', 'Created'], snapshots.map((s) => h('tr', { dataset: { name: s.name } },
      h('td', {}, s.name, s.general ? h('span', { class: 'muted' }, ' (server)') : ''),
      h('td', {}, s.sandboxClass), h('td', {}, h('span', { class: 'state', dataset: { state: s.state } }, s.state)),
      h('td', { class: 'muted' }, s.size ? `${s.size.toFixed(2)} GB` : ''),
      h('td', {}, s.includesMemory ? 'yes' : ''),
      h('td', {}, s.sourceSandboxId ? h('a', { href: `#/sandbox/${enc(s.sourceSandboxId)}` }, s.sourceSandboxId.slice(0, 8)) : ''),
      h('td', { class: 'muted' }, ago(s.createdAt)),
      h('td', {}, s.general ? '' : deleteButton('snapshot', s.name, () => api(`/snapshots/${enc(s.id)}`, { method: 'DELETE' }), renderSnapshots)))), form);
  }

  async function renderVolumes() {
    const volumes = (await act(() => api('/volumes'))) || [];
    const name = h('input', { id: 'volume-new-name', placeholder: 'name' });
    const form = h('div', { class: 'card toolbar' }, h('strong', {}, 'New volume'), name,
      h('button', {
        type: 'button', class: 'primary', id: 'volume-create',
        onclick: () => act(async () => {
          await api('/volumes', { method: 'POST', body: { name: name.value.trim() } });
          renderVolumes();
        }),
      }, 'Create'));
    listPage('Volumes', ['Name', 'State', 'Created'], volumes.map((v) => h('tr', { dataset: { name: v.name } },
      h('td', {}, v.name), h('td', {}, v.state), h('td', { class: 'muted' }, ago(v.createdAt)),
      h('td', {}, deleteButton('volume', v.name, () => api(`/volumes/${enc(v.id)}`, { method: 'DELETE' }), renderVolumes)))), form);
  }

  async function renderRegistries() {
    const registries = (await act(() => api('/docker-registry'))) || [];
    const input = (id, placeholder, type = 'text') => h('input', { id, placeholder, type, autocomplete: 'off' });
    const fields = {
      name: input('registry-name', 'name'),
      url: input('registry-url', 'URL, e.g. registry.example.com'),
      username: input('registry-username', 'username'),
      password: input('registry-password', 'password', 'password'),
      project: input('registry-project', 'project (optional)'),
    };
    const form = h('div', { class: 'card toolbar' }, h('strong', {}, 'New registry'), Object.values(fields),
      h('button', {
        type: 'button', class: 'primary', id: 'registry-create',
        onclick: () => act(async () => {
          const body = Object.fromEntries(Object.entries(fields).map(([k, f]) => [k, f.value.trim()]));
          body.registryType = 'organization';
          await api('/docker-registry', { method: 'POST', body });
          renderRegistries();
        }),
      }, 'Add'));
    listPage('Registries', ['Name', 'URL', 'User', 'Project'], registries.map((r) => h('tr', { dataset: { name: r.name } },
      h('td', {}, r.name), h('td', {}, r.url), h('td', {}, r.username), h('td', {}, r.project || ''),
      h('td', {}, deleteButton('registry', r.name, () => api(`/docker-registry/${enc(r.id)}`, { method: 'DELETE' }), renderRegistries)))), form);
  }

  // ------------------------------------------------------ usage and bill

  function bar(label, used, limit, unit) {
    const share = limit ? Math.min(1, used / limit) : 0;
    return [
      h('span', {}, label),
      h('div', { class: 'bar', title: limit ? `${Math.round(share * 100)}%` : 'no limit' }, h('div', { style: `width:${(share * 100).toFixed(1)}%` })),
      h('span', { class: 'muted' }, `${used}${unit} of ${limit ?? 'no limit'}${limit ? unit : ''}`),
    ];
  }

  async function renderUsage() {
    const main = $('#main');
    main.replaceChildren(h('h1', {}, `Usage and bill of ${session.organization}`));
    const org = enc(session.organization);
    const usage = await act(() => api(`/organizations/${org}/usage`));
    if (usage) {
      const region = (usage.regionUsage || [])[0] || {};
      main.append(h('div', { class: 'card', id: 'usage' }, h('h2', {}, `Now (region ${region.regionId || ''})`),
        h('div', { class: 'bars' },
          bar('Running sandboxes', region.currentRunningSandboxes ?? 0, region.maxRunningSandboxes, ''),
          bar('vCPUs', region.currentCpuUsage ?? 0, region.totalCpuQuota, ''),
          bar('Memory', region.currentMemoryUsage ?? 0, region.totalMemoryQuota, ' GiB'),
          bar('Disk', region.currentDiskUsage ?? 0, region.totalDiskQuota, ' GiB'),
          bar('Snapshots', usage.currentSnapshotUsage ?? 0, usage.totalSnapshotQuota, ''),
          bar('Volumes', usage.currentVolumeUsage ?? 0, usage.totalVolumeQuota, ''))));
    }
    const bill = await act(() => api(`/organizations/${org}/bill`));
    if (bill) {
      const money = (n) => `${Number(n).toFixed(Math.abs(n) < 0.01 ? 6 : 2)} ${bill.currency}`;
      const top = Math.max(0, ...bill.lines.map((l) => l.amount));
      main.append(h('div', { class: 'card', id: 'bill' },
        h('h2', {}, `Bill from ${bill.from.slice(0, 10)} to ${bill.to.slice(0, 10)}`),
        h('div', { class: 'bars' }, bill.lines.map((line) => [
          h('span', {}, line.name),
          h('div', { class: 'bar' }, h('div', { style: `width:${top > 0 ? ((Math.max(0, line.amount) / top) * 100).toFixed(1) : 0}%` })),
          h('span', { class: 'muted' }, money(line.amount)),
        ])),
        h('p', {}, `Credits ${money(bill.credits)} · total `, h('strong', { id: 'bill-total' }, money(bill.total))),
        h('p', { class: 'muted' }, `vCPU-hour ${bill.prices.vcpuHour}, GB-hour of memory ${bill.prices.memoryGbHour}, of disk ${bill.prices.diskGbHour}, snapshot GB-month ${bill.prices.snapshotGbMonth}`)));
    }
  }

  // -------------------------------------------------------------- start

  $('#sign-out').addEventListener('click', signOut);
  window.addEventListener('hashchange', route);
  window.addEventListener('pagehide', closeTerminal);
  renderSignIn();
})();
