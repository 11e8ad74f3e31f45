// Listing sandboxes through the TypeScript SDK: `daytona.list()` is an async
// iterator that follows the server's nextCursor, so paging must neither repeat
// nor skip a sandbox, in every sort order the SDK offers.

import assert from 'node:assert/strict';
import { before, describe, test } from 'node:test';

import { SandboxListSortDirection, SandboxListSortField, SandboxState } from '@daytonaio/sdk';

import { api, setup, unique } from '../lib/env.mjs';

const { daytona, create } = setup();

describe('listing', () => {
  const tag = unique('srt');
  // Names whose order is neither the order of creation nor its reverse.
  const names = [`${tag}-b`, `${tag}-c`, `${tag}-a`];
  const byName = [...names].sort();
  const newestFirst = [...names].reverse();
  let made;

  before(async () => {
    made = [];
    for (const name of names) made.push(await create({ name, labels: { srt: tag } }));
  });

  async function listed(query) {
    const seen = [];
    for await (const sandbox of daytona.list({ labels: { srt: tag }, ...query })) seen.push(sandbox.name);
    return seen;
  }

  test('sorted by name and by creation, both ways; newest first by default', async () => {
    const { NAME, CREATED_AT } = SandboxListSortField;
    const { ASC, DESC } = SandboxListSortDirection;
    assert.deepEqual(await listed({ sort: NAME, order: ASC }), byName);
    assert.deepEqual(await listed({ sort: NAME, order: DESC }), [...byName].reverse());
    assert.deepEqual(await listed({ sort: CREATED_AT, order: DESC }), newestFirst);
    assert.deepEqual(await listed({ sort: CREATED_AT, order: ASC }), names);
    assert.deepEqual(await listed({}), newestFirst);
  });

  test('one per page: the SDK follows the cursor without repeating or skipping', async () => {
    const { NAME, CREATED_AT, LAST_ACTIVITY_AT } = SandboxListSortField;
    const { ASC, DESC } = SandboxListSortDirection;
    for (const [sort, order, expected] of [
      [NAME, ASC, byName],
      [NAME, DESC, [...byName].reverse()],
      [CREATED_AT, DESC, newestFirst],
      [CREATED_AT, ASC, names],
    ]) {
      assert.deepEqual(await listed({ sort, order, limit: 1 }), expected, `${sort} ${order}`);
    }
    // Two per page: each page holds what it should and the last has no cursor.
    const seen = await listed({ sort: LAST_ACTIVITY_AT, order: ASC, limit: 2 });
    assert.deepEqual([...seen].sort(), byName);
    const query = new URLSearchParams({ labels: JSON.stringify({ srt: tag }), sort: 'name', order: 'desc', limit: '2' });
    const first = await api('GET', `/sandbox?${query}`);
    assert.equal(first.status, 200, first.text);
    assert.deepEqual(first.json.items.map((s) => s.name), [...byName].reverse().slice(0, 2));
    assert.ok(first.json.nextCursor, 'a first page of two out of three has a cursor');
    query.set('cursor', first.json.nextCursor);
    const second = await api('GET', `/sandbox?${query}`);
    assert.deepEqual(second.json.items.map((s) => s.name), [...byName].reverse().slice(2));
    assert.ok(!second.json.nextCursor);
  });

  test('filters: by state', async () => {
    await made[0].stop();
    assert.deepEqual(await listed({ states: [SandboxState.STOPPED] }), [made[0].name]);
    assert.deepEqual((await listed({ states: [SandboxState.STARTED], sort: SandboxListSortField.NAME,
      order: SandboxListSortDirection.ASC })),
      byName.filter((n) => n !== made[0].name));
  });

  // Prefixes of id and name, snapshot names and sizes, as ListSandboxesQuery sends them.
  test('filters: by id, name, snapshot and size', async () => {
    assert.deepEqual(await listed({ id: made[1].id }), [made[1].name]);
    assert.deepEqual(await listed({ name: made[2].name }), [made[2].name]);
    assert.deepEqual(await listed({ snapshots: [unique('no-such-snapshot')] }), []);
    assert.deepEqual(await listed({ minCpu: 2 }), []);
  });

  test('unknown sort fields and orders are refused, naming the allowed ones', async () => {
    const r = await api('GET', '/sandbox?sort=size');
    assert.equal(r.status, 400, r.text);
    assert.ok(r.json.message.includes('size') && r.json.message.includes('createdAt'), r.json.message);
    const o = await api('GET', '/sandbox?sort=name&order=sideways');
    assert.equal(o.status, 400, o.text);
    assert.ok(o.json.message.includes('asc, desc'), o.json.message);
  });
});
