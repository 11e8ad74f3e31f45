// Preview URLs through the TypeScript SDK: a web server in a sandbox reached
// through cove's listener with the preview token (or the API key), refused
// without; signed URLs that work alone until expired.

import assert from 'node:assert/strict';
import { before, describe, test } from 'node:test';

import { API_KEY, BASE_URL, setup, unique, waitUntil } from '../lib/env.mjs';

const { create } = setup();
const PORT = 8765;
const TOKEN_HEADER = 'X-Daytona-Preview-Token';

async function get(url, headers = {}) {
  const r = await fetch(url, { headers, signal: AbortSignal.timeout(10_000) });
  return { status: r.status, text: await r.text() };
}

describe('previews', () => {
  let sandbox;
  before(async () => {
    sandbox = await create();
    await sandbox.process.executeCommand('mkdir -p /tmp/site && echo "hello from the sandbox" > /tmp/site/page.txt');
    const session = unique('web');
    await sandbox.process.createSession(session);
    await sandbox.process.executeSessionCommand(session, {
      command: `cd /tmp/site && python3 -m http.server --bind 127.0.0.1 ${PORT}`,
      runAsync: true,
    });
    const up = await waitUntil(async () => (await sandbox.process.executeCommand(
      `curl -s -m 2 http://127.0.0.1:${PORT}/page.txt`)).result.includes('hello'), 30_000, 500);
    assert.ok(up, 'the server in the sandbox never answered');
  });

  test('the preview link serves with its token or the API key, and not without', async () => {
    const preview = await sandbox.getPreviewLink(PORT);
    assert.equal(preview.url, `${BASE_URL}/preview/${sandbox.id}/${PORT}`);
    assert.match(preview.token, /\S/);

    const ok = await get(`${preview.url}/page.txt`, { [TOKEN_HEADER]: preview.token });
    assert.equal(ok.status, 200, ok.text);
    assert.equal(ok.text, 'hello from the sandbox\n');
    const withKey = await get(`${preview.url}/page.txt`, { Authorization: `Bearer ${API_KEY}` });
    assert.equal(withKey.status, 200, withKey.text);

    const without = await get(`${preview.url}/page.txt`);
    assert.equal(without.status, 401);
    assert.ok(without.text.includes(TOKEN_HEADER), without.text);
    assert.equal((await get(`${preview.url}/page.txt`, { [TOKEN_HEADER]: 'not-the-token' })).status, 401);

    // A port nothing listens on is a bad gateway that names the port.
    const closed = await sandbox.getPreviewLink(9);
    const refused = await get(`${closed.url}/`, { [TOKEN_HEADER]: closed.token });
    assert.equal(refused.status, 502);
    assert.ok(refused.text.includes('port 9'), refused.text);
  });

  test('a signed preview URL works alone until it is expired', async () => {
    const signed = await sandbox.getSignedPreviewUrl(PORT, 120);
    assert.equal(signed.sandboxId, sandbox.id);
    assert.equal(signed.port, PORT);
    assert.ok(signed.url.includes(signed.token), signed.url);
    const ok = await get(`${signed.url}/page.txt`);
    assert.equal(ok.status, 200, ok.text);
    assert.equal(ok.text, 'hello from the sandbox\n');

    await sandbox.expireSignedPreviewUrl(PORT, signed.token);
    const expired = await get(`${signed.url}/page.txt`);
    assert.equal(expired.status, 401);
    assert.ok(/expired/.test(expired.text), expired.text);

    const short = await sandbox.getSignedPreviewUrl(PORT, 1);
    assert.equal((await get(`${short.url}/page.txt`)).status, 200);
    assert.ok(await waitUntil(async () => (await get(`${short.url}/page.txt`)).status === 401, 10_000, 500),
      'a signed URL outlived its expiry');
  });
});
