// What every test file shares: the server run.mjs started (from the
// environment), a Daytona client of the official SDK pointed at it, a tracker
// that deletes what a file made, raw HTTP for what the SDK hides, and the
// strict-mode gate for skips.

import { after } from 'node:test';
import { randomBytes } from 'node:crypto';

import { Daytona } from '@daytonaio/sdk';

export const API_URL = process.env.COVE_TS_API_URL;
export const API_KEY = process.env.COVE_TS_API_KEY;
if (!API_URL || !API_KEY) {
  throw new Error('COVE_TS_API_URL and COVE_TS_API_KEY are not set: run the suite with `node run.mjs`');
}
export const BASE_URL = API_URL.replace(/\/api\/?$/, '');
export const STRICT = process.env.COVE_TEST_STRICT === '1';
export const VMS = process.env.COVE_TS_VMS === '1';
export const FAKE = {
  allowed: process.env.COVE_TS_FAKE_ALLOWED || null,
  denied: process.env.COVE_TS_FAKE_DENIED || null,
};
export const HOME = '/home/daytona';
export const VM_SNAPSHOT = 'daytona-vm-small';
// Seconds: a VM under TCG emulation takes tens of them to make.
export const VM_TIMEOUT = 300;

export function unique(prefix) {
  return `${prefix}-${randomBytes(5).toString('hex')}`;
}

export const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

/** Polls `predicate` (sync or async) until true or `timeoutMs`; returns the last answer. */
export async function waitUntil(predicate, timeoutMs, intervalMs = 200) {
  const deadline = Date.now() + timeoutMs;
  while (Date.now() < deadline) {
    if (await predicate()) return true;
    await sleep(intervalMs);
  }
  return Boolean(await predicate());
}

/**
 * Skips the test for `reason`, or under COVE_TEST_STRICT=1 (CI) fails it:
 * nothing passes by not running. Use as `if (skipUnless(t, cond, why)) return;`.
 */
export function skipUnless(t, condition, reason) {
  if (condition) return false;
  if (STRICT) throw new Error(`would skip under COVE_TEST_STRICT=1, where every test must run: ${reason}`);
  t.skip(reason);
  return true;
}

/** Raw HTTP against the API, for status codes and fields the SDK hides. */
export async function api(method, path, body, { auth = true } = {}) {
  const headers = {};
  if (auth) headers.Authorization = `Bearer ${API_KEY}`;
  if (body !== undefined) headers['Content-Type'] = 'application/json';
  const send = () => fetch(`${API_URL}${path}`, {
    method,
    headers,
    body: body === undefined ? undefined : JSON.stringify(body),
    signal: AbortSignal.timeout(60_000),
  });
  let r;
  try {
    r = await send();
  } catch (e) {
    // A kept-alive connection the server closed while idle ("other side
    // closed"): once more on a new one, for the idempotent requests.
    if (method === 'POST') throw e;
    r = await send();
  }
  const text = await r.text();
  let json = null;
  try {
    json = JSON.parse(text);
  } catch {
    // not JSON
  }
  return { status: r.status, text, json };
}

// The ids of every sandbox the key sees, or only of those carrying `labels`.
// Test files run side by side on one server, so a check that a refused create
// made nothing labels what it sends and looks for that label, never compares
// the whole list before and after.
export async function sandboxIds(labels) {
  const ids = new Set();
  let cursor;
  do {
    const query = new URLSearchParams({
      limit: '1000',
      ...(labels ? { labels: JSON.stringify(labels) } : {}),
      ...(cursor ? { cursor } : {}),
    });
    const { status, json } = await api('GET', `/sandbox?${query}`);
    if (status !== 200) throw new Error(`listing sandboxes answered ${status}`);
    for (const item of json.items) ids.add(item.id);
    cursor = json.nextCursor;
  } while (cursor);
  return ids;
}

/**
 * The file's client and a factory that deletes, when the file is done, every
 * sandbox it made (newest first: forks before the parents they keep) and
 * closes the client's event stream so the test process can exit.
 */
export function setup() {
  const daytona = new Daytona({ apiKey: API_KEY, apiUrl: API_URL });
  const made = [];
  const snapshots = [];

  async function create(params, options) {
    const before = await sandboxIds();
    try {
      const sandbox = await daytona.create(params, options);
      made.push(sandbox.id);
      return sandbox;
    } catch (e) {
      // A failed create must not leak; if it did, clean up after it too.
      for (const id of await sandboxIds()) if (!before.has(id)) made.push(id);
      throw e;
    }
  }

  after(async () => {
    for (const id of [...made].reverse()) {
      // A parent stays (409) while a fork it keeps is still going away.
      await waitUntil(async () => {
        const { status } = await api('DELETE', `/sandbox/${id}`).catch(() => ({ status: 0 }));
        return status !== 409;
      }, 30_000, 500);
    }
    for (const name of [...snapshots].reverse()) {
      await waitUntil(async () => {
        const { status } = await api('DELETE', `/snapshots/${encodeURIComponent(name)}`).catch(() => ({ status: 0 }));
        return status === 404 || (status >= 200 && status < 300);
      }, 30_000, 1000);
    }
    await daytona[Symbol.asyncDispose]();
  });

  return {
    daytona,
    create,
    track: (id) => made.push(id),
    trackSnapshot: (name) => snapshots.push(name),
  };
}

/** A shell command's output, trimmed; fails the test on a non-zero exit. */
export async function sh(sandbox, command, cwd, env, timeout) {
  const r = await sandbox.process.executeCommand(command, cwd, env, timeout);
  if (r.exitCode !== 0) throw new Error(`\`${command}\` exited ${r.exitCode}: ${r.result}`);
  return r.result.trim();
}
