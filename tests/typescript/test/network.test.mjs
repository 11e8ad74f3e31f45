// Network egress policy in the forms Daytona's docs write it, through the
// TypeScript SDK: CIDR allow lists (read back as the networks they stand for,
// at most five), block-all, domain allow lists, and live updates. The
// "internet" is the fake one run.mjs starts on this machine: allowed.test and
// denied.test, each an HTTP server on its own address.

import assert from 'node:assert/strict';
import { describe, test } from 'node:test';

import { DaytonaValidationError } from '@daytonaio/sdk';

import { FAKE, sandboxIds, setup, skipUnless, unique, waitUntil } from '../lib/env.mjs';

const { daytona, create } = setup();

/** The HTTP status the sandbox gets from `url`, or "000" when it gets nothing. */
async function fetchFrom(sandbox, url) {
  const r = await sandbox.process.executeCommand(`curl -s -m 3 -o /dev/null -w '%{http_code}' ${url}`,
    undefined, undefined, 15);
  return r.result.trim();
}

/** Whether the sandbox soon gets `status` from `url` (live policy changes). */
async function soon(sandbox, url, status) {
  let last;
  const ok = await waitUntil(async () => (last = await fetchFrom(sandbox, url)) === status, 15_000, 500);
  assert.ok(ok, `${url} answered ${last}, not ${status}`);
}

describe('network', () => {
  test('allow lists read back normalised and are enforced, also when updated live', async (t) => {
    if (skipUnless(t, FAKE.allowed, 'no fake internet (the suite was not started by run.mjs as root)')) return;
    // Daytona's own example writes a /16 with host bits set.
    const sandbox = await create({ networkAllowList: '192.168.1.0/16, 198.51.100.77/24,10.0.0.0/8' });
    assert.equal(sandbox.networkAllowList, '192.168.0.0/16,198.51.100.0/24,10.0.0.0/8');
    assert.equal((await daytona.get(sandbox.id)).networkAllowList, sandbox.networkAllowList);
    assert.equal(await fetchFrom(sandbox, `http://${FAKE.allowed}/`), '200');
    assert.equal(await fetchFrom(sandbox, `http://${FAKE.denied}/`), '000');

    await sandbox.updateNetworkSettings({ networkAllowList: '203.0.113.99/24' });
    assert.equal((await daytona.get(sandbox.id)).networkAllowList, '203.0.113.0/24');
    await soon(sandbox, `http://${FAKE.allowed}/`, '000');
    await soon(sandbox, `http://${FAKE.denied}/`, '200');

    await sandbox.updateNetworkSettings({ networkBlockAll: true });
    assert.equal((await daytona.get(sandbox.id)).networkBlockAll, true);
    await soon(sandbox, `http://${FAKE.denied}/`, '000');
  });

  test('block-all at create, and a sandbox without a policy reaches both', async (t) => {
    if (skipUnless(t, FAKE.allowed, 'no fake internet (the suite was not started by run.mjs as root)')) return;
    const blocked = await create({ networkBlockAll: true });
    assert.equal(blocked.networkBlockAll, true);
    assert.equal(await fetchFrom(blocked, `http://${FAKE.allowed}/`), '000');
    const open = await create();
    assert.equal(open.networkBlockAll, false);
    assert.equal(await fetchFrom(open, `http://${FAKE.allowed}/`), '200');
    assert.equal(await fetchFrom(open, `http://${FAKE.denied}/`), '200');
    // By name, through cove's resolver and the fake internet's DNS.
    assert.equal(await fetchFrom(open, 'http://allowed.test/'), '200');
  });

  test('a domain allow list lets only its names resolve and be reached', async (t) => {
    if (skipUnless(t, FAKE.allowed, 'no fake internet (the suite was not started by run.mjs as root)')) return;
    const sandbox = await create({ domainAllowList: 'allowed.test' });
    assert.equal((await daytona.get(sandbox.id)).domainAllowList, 'allowed.test');
    assert.equal(await fetchFrom(sandbox, 'http://allowed.test/'), '200');
    assert.equal(await fetchFrom(sandbox, 'http://denied.test/'), '000');
    // By address too: only what the allowed names resolve to is reachable.
    assert.equal(await fetchFrom(sandbox, `http://${FAKE.denied}/`), '000');
  });

  test('allow lists keep Daytona limits and name what is wrong', async () => {
    const refused = { refused: unique('r') };
    const six = Array.from({ length: 6 }, (_, i) => `10.${i}.0.0/16`).join(',');
    await assert.rejects(daytona.create({ labels: refused, networkAllowList: six }), (e) => {
      assert.ok(e instanceof DaytonaValidationError, `${e.constructor.name}: ${e.message}`);
      assert.ok(e.message.includes('at most 5'), e.message);
      return true;
    });
    for (const garbage of ['10.0.0.0/33', '10.0.0/8', 'example.com/24']) {
      await assert.rejects(daytona.create({ labels: refused, networkAllowList: garbage }), (e) => {
        assert.ok(e instanceof DaytonaValidationError, `${e.constructor.name}: ${e.message}`);
        assert.ok(e.message.includes(garbage), e.message);
        return true;
      });
    }
    assert.deepEqual(await sandboxIds(refused), new Set(), 'a refused create left a sandbox');

    const sandbox = await create();
    await assert.rejects(sandbox.updateNetworkSettings({ networkAllowList: six }), DaytonaValidationError);
    const five = Array.from({ length: 5 }, (_, i) => `10.${i}.0.0/16`).join(',');
    await sandbox.updateNetworkSettings({ networkAllowList: five });
    assert.equal((await daytona.get(sandbox.id)).networkAllowList, five);
  });
});
