// A `cove serve` of the suite's own, and the fake internet its sandboxes
// leave into: the Node counterpart of tests/conformance/conftest.py's
// CoveServer and FakeInternet. Used by run.mjs only; the test files reach the
// server through the environment run.mjs gives them (lib/env.mjs).
//
// The server takes host resources no other cove server on this machine uses
// (its own bridge, address range, routing table and user-namespace id pool),
// so the suite can run beside the Python conformance suite's server (which is
// on the defaults) and beside `cove bench`'s own servers (bridges covb0-15).

import { spawn, execFileSync, spawnSync } from 'node:child_process';
import { randomBytes } from 'node:crypto';
import fs from 'node:fs';
import net from 'node:net';
import os from 'node:os';
import path from 'node:path';
import { fileURLToPath } from 'node:url';

export const REPO = path.resolve(path.dirname(fileURLToPath(import.meta.url)), '..', '..', '..');
const READY_TIMEOUT_MS = 180_000;

/** Host resources apart from every other cove server's (see the header). */
export const SLOT = {
  bridge: 'covts0',
  networkRange: '10.190.0.0/16',
  routeTable: 7690,
  // Below the bench slots' pools, which are below the default pool
  // (1879048192): 17 * 256 ranges of 65536 ids under it.
  usernsPool: `${1879048192 - 17 * 256 * 65536}:256`,
};

export function coveBinary() {
  return process.env.COVE_BIN || path.join(REPO, 'target', 'release', 'cove');
}

export function imagesDir() {
  return process.env.COVE_IMAGES_DIR || '/var/tmp/cove/images';
}

/** The VM guest assets (scripts/vm-assets), or null: VM tests skip. */
export function vmAssets() {
  return process.env.COVE_TEST_VM_ASSETS || null;
}

export function freePort() {
  return new Promise((resolve, reject) => {
    const server = net.createServer();
    server.unref();
    server.on('error', reject);
    server.listen(0, '127.0.0.1', () => {
      const { port } = server.address();
      server.close(() => resolve(port));
    });
  });
}

const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

function run(...args) {
  execFileSync(args[0], args.slice(1), { stdio: ['ignore', 'ignore', 'pipe'] });
}

function tryRun(...args) {
  spawnSync(args[0], args.slice(1), { stdio: 'ignore' });
}

/**
 * The sandboxes' internet, all on this machine: a network namespace joined to
 * the host by a veth (the server's uplink) with a DNS server (allowed.test,
 * denied.test) and an HTTP server on each name's address. The host side of
 * the veth takes a /30 of its own (the Python suite's is 198.18.77.0/30), so
 * both can exist at once; the far addresses live only inside each namespace
 * and each server routes to its own gateway by its own table.
 */
export class FakeInternet {
  static HOST_ADDR = '198.18.78.1';
  static GATEWAY = '198.18.78.2';
  static ALLOWED = '198.51.100.10';
  static DENIED = '203.0.113.10';

  constructor() {
    const tag = randomBytes(3).toString('hex');
    this.netns = `fakets-${tag}`;
    this.interface = `ft${tag}`;
    this.peer = `ftp${tag}`;
    this.procs = [];
    this.web = fs.mkdtempSync(path.join('/tmp', 'cvtsweb'));
    this.started = false;
  }

  async start() {
    const ns = ['ip', 'netns', 'exec', this.netns];
    run('ip', 'netns', 'add', this.netns);
    this.started = true;
    run('ip', 'link', 'add', this.interface, 'type', 'veth', 'peer', 'name', this.peer);
    run('ip', 'link', 'set', this.peer, 'netns', this.netns);
    run('ip', 'addr', 'add', `${FakeInternet.HOST_ADDR}/30`, 'dev', this.interface);
    run('ip', 'link', 'set', this.interface, 'up');
    run(...ns, 'ip', 'addr', 'add', `${FakeInternet.GATEWAY}/30`, 'dev', this.peer);
    run(...ns, 'ip', 'link', 'set', this.peer, 'up');
    run(...ns, 'ip', 'link', 'set', 'lo', 'up');
    for (const address of [FakeInternet.ALLOWED, FakeInternet.DENIED]) {
      run(...ns, 'ip', 'addr', 'add', `${address}/32`, 'dev', 'lo');
    }
    const dns = path.join(REPO, 'tests', 'conformance', 'fakenet_dns.py');
    this.spawn([...ns, 'python3', dns, FakeInternet.GATEWAY,
      `allowed.test=${FakeInternet.ALLOWED}`, `denied.test=${FakeInternet.DENIED}`]);
    for (const [name, address] of [['allowed', FakeInternet.ALLOWED], ['denied', FakeInternet.DENIED]]) {
      const root = path.join(this.web, name);
      fs.mkdirSync(root);
      fs.writeFileSync(path.join(root, 'index.html'), `${name} server\n`);
      this.spawn([...ns, 'python3', '-m', 'http.server', '80', '--bind', address, '--directory', root]);
    }
    // Listening before the first sandbox asks.
    await sleep(500);
  }

  spawn(argv) {
    const child = spawn(argv[0], argv.slice(1), { stdio: 'ignore' });
    this.procs.push(child);
  }

  serverArgs() {
    return ['--uplink-interface', this.interface, '--uplink-gateway', FakeInternet.GATEWAY,
      '--dns', FakeInternet.GATEWAY];
  }

  async stop() {
    for (const child of this.procs) {
      if (child.exitCode === null && child.signalCode === null) child.kill('SIGTERM');
    }
    await Promise.all(this.procs.map((child) => exited(child, 10_000)));
    if (this.started) {
      // Deleting the namespace deletes the veth pair with it.
      tryRun('ip', 'netns', 'del', this.netns);
      tryRun('ip', 'link', 'del', this.interface);
    }
    fs.rmSync(this.web, { recursive: true, force: true });
  }
}

/** Resolves when the child has exited (SIGKILL after `ms`). */
function exited(child, ms) {
  if (child.exitCode !== null || child.signalCode !== null) return Promise.resolve();
  return new Promise((resolve) => {
    const timer = setTimeout(() => child.kill('SIGKILL'), ms);
    child.once('exit', () => {
      clearTimeout(timer);
      resolve();
    });
  });
}

/** Mount points at or under `dir` (the host's mount namespace). */
function mountsUnder(dir) {
  return fs.readFileSync('/proc/self/mountinfo', 'utf8').split('\n')
    .map((line) => line.split(' ')[4])
    .filter((mount) => mount && (mount === dir || mount.startsWith(`${dir}/`)));
}

/** A `cove serve` child over a throw-away data dir, on free loopback ports. */
export class CoveServer {
  constructor({ extraArgs = [], vms = true } = {}) {
    // Short: the agent's Unix sockets live under it (sun_path holds 107 bytes).
    this.dataDir = fs.mkdtempSync(path.join('/tmp', 'cvts'));
    this.logPath = `${this.dataDir}.log`;
    this.apiKey = `cv-${randomBytes(16).toString('hex')}`;
    this.extraArgs = extraArgs;
    this.vms = vms && vmAssets() !== null;
    this.proc = null;
  }

  get apiUrl() {
    return `http://127.0.0.1:${this.port}/api`;
  }

  get baseUrl() {
    return `http://127.0.0.1:${this.port}`;
  }

  async start() {
    const binary = coveBinary();
    if (!fs.existsSync(binary)) {
      throw new Error(`cove binary not found at ${binary}; run \`cargo build --release && cargo agent\``);
    }
    fs.mkdirSync(imagesDir(), { recursive: true });
    this.port = await freePort();
    this.sshPort = await freePort();
    const env = {
      ...process.env,
      COVE_API_KEY: this.apiKey,
      RUST_LOG: process.env.RUST_LOG || 'info',
      // A waiting VM of the warm pool would take CPU from the tests.
      COVE_VM_WARM_POOL: process.env.COVE_VM_WARM_POOL || '0',
    };
    const args = [
      'serve',
      '--listen', `127.0.0.1:${this.port}`,
      '--data-dir', this.dataDir,
      '--images-dir', imagesDir(),
      ...(this.vms ? ['--vm-assets', vmAssets()] : ['--no-vm']),
      '--ssh-listen', `127.0.0.1:${this.sshPort}`,
      '--bridge', SLOT.bridge,
      '--network-range', SLOT.networkRange,
      '--route-table', String(SLOT.routeTable),
      '--userns-pool', SLOT.usernsPool,
      ...this.extraArgs,
    ];
    const log = fs.openSync(this.logPath, 'a');
    this.proc = spawn(binary, args, { env, stdio: ['ignore', log, log] });
    fs.closeSync(log);
    await this.waitReady();
  }

  async waitReady() {
    const deadline = Date.now() + READY_TIMEOUT_MS;
    let last = null;
    while (Date.now() < deadline) {
      if (this.proc.exitCode !== null || this.proc.signalCode !== null) {
        throw new Error(`cove exited (${this.proc.exitCode ?? this.proc.signalCode}) before answering:\n${this.logTail()}`);
      }
      try {
        const r = await fetch(`${this.apiUrl}/sandbox`, {
          headers: { Authorization: `Bearer ${this.apiKey}` },
          signal: AbortSignal.timeout(2000),
        });
        if (r.status === 200) return;
        last = `${r.status} ${(await r.text()).slice(0, 200)}`;
      } catch (e) {
        last = String(e);
      }
      await sleep(250);
    }
    await this.stop();
    throw new Error(`cove not ready after ${READY_TIMEOUT_MS / 1000}s (last: ${last}):\n${this.logTail()}`);
  }

  async request(method, urlPath, body) {
    const send = () => fetch(`${this.apiUrl}${urlPath}`, {
      method,
      headers: { Authorization: `Bearer ${this.apiKey}`, ...(body ? { 'Content-Type': 'application/json' } : {}) },
      body: body ? JSON.stringify(body) : undefined,
      signal: AbortSignal.timeout(60_000),
    });
    try {
      return await send();
    } catch (e) {
      // A kept-alive connection the server closed while idle ("other side
      // closed"): once more on a new one, for the idempotent requests.
      if (method === 'POST') throw e;
      return send();
    }
  }

  /** Deletes whatever sandboxes the tests left, newest first (forks before their parents). */
  async deleteAll() {
    const ids = [];
    let cursor;
    do {
      const query = new URLSearchParams({ limit: '1000', ...(cursor ? { cursor } : {}) });
      const r = await this.request('GET', `/sandbox?${query}`);
      if (r.status !== 200) return;
      const page = await r.json();
      ids.push(...page.items.map((s) => s.id));
      cursor = page.nextCursor;
    } while (cursor);
    for (let round = 0; round < 3 && ids.length; round++) {
      for (const id of [...ids]) {
        const r = await this.request('DELETE', `/sandbox/${id}`).catch(() => null);
        if (r && (r.status < 300 || r.status === 404)) ids.splice(ids.indexOf(id), 1);
      }
    }
  }

  /** SIGTERM, wait, then SIGKILL; resolves to the exit code or signal. */
  async stop(ms = 30_000) {
    if (!this.proc) return null;
    const child = this.proc;
    this.proc = null;
    if (child.exitCode === null && child.signalCode === null) {
      child.kill('SIGTERM');
      await exited(child, ms);
    }
    return child.exitCode ?? child.signalCode;
  }

  /**
   * Removes the data dir (and its log): the server leaves its loop-mounted
   * sandbox storage mounted on purpose, so unmount it first; never remove
   * through a live mount.
   */
  async remove() {
    const storage = path.join(this.dataDir, 'storage');
    for (let i = 0; i < 50; i++) {
      if (!mountsUnder(this.dataDir).includes(storage)) break;
      if (spawnSync('umount', [storage], { stdio: 'ignore' }).status === 0) break;
      await sleep(100);
    }
    if (mountsUnder(this.dataDir).length) {
      console.error(`cove: ${this.dataDir} still has mounts; left for a human to look at`);
      return false;
    }
    fs.rmSync(this.dataDir, { recursive: true, force: true });
    fs.rmSync(this.logPath, { force: true });
    return true;
  }

  logTail(n = 60) {
    try {
      return fs.readFileSync(this.logPath, 'utf8').split('\n').slice(-n).join('\n');
    } catch {
      return '(no log)';
    }
  }
}

export function isRoot() {
  return os.userInfo().uid === 0;
}
