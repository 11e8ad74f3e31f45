// Filesystem snapshots through the TypeScript SDK: seed 000's cold snapshot
// (write, stop, snapshot, start new sandboxes from it), a live snapshot of a
// running sandbox, the snapshot registry (get, list, deactivate/activate,
// delete).

import assert from 'node:assert/strict';
import { describe, test } from 'node:test';

import { DaytonaNotFoundError, SandboxState, SnapshotState } from '@daytonaio/sdk';

import { api, setup, sh, unique } from '../lib/env.mjs';

const { daytona, create, trackSnapshot } = setup();

describe('snapshots', () => {
  test('seed 000: a cold snapshot starts independent copies', async () => {
    const source = await create();
    await source.fs.uploadFile(Buffer.from('done'), 'setup.log');
    await source.stop();
    const name = unique('snap');
    trackSnapshot(name);
    await source.createSnapshot(name);
    assert.equal(source.state, SandboxState.STOPPED);

    const snapshot = await daytona.snapshot.get(name);
    assert.equal(snapshot.name, name);
    assert.equal(snapshot.state, SnapshotState.ACTIVE);
    const listed = await daytona.snapshot.list();
    assert.ok(listed.items.some((s) => s.name === name), 'the snapshot is not listed');
    assert.ok(listed.total >= listed.items.length);

    const copy = await create({ snapshot: name });
    assert.equal(copy.snapshot, name);
    assert.equal((await copy.fs.downloadFile('setup.log')).toString(), 'done');
    assert.equal(await sh(copy, 'whoami'), 'daytona');
    // Independent: a change in the copy does not reach the source.
    await copy.fs.uploadFile(Buffer.from('changed'), 'setup.log');
    await source.start();
    assert.equal((await source.fs.downloadFile('setup.log')).toString(), 'done');
  });

  test('a live snapshot keeps the sandbox running', async () => {
    const sandbox = await create();
    const session = unique('s');
    await sandbox.process.createSession(session);
    await sandbox.process.executeSessionCommand(session, { command: 'sleep 300', runAsync: true });
    await sandbox.fs.uploadFile(Buffer.from('v1'), 'state.txt');
    const name = unique('live');
    trackSnapshot(name);
    await sandbox.createSnapshot(name);
    assert.equal(sandbox.state, SandboxState.STARTED);
    assert.ok((await sh(sandbox, 'ps -eo args')).includes('sleep 300'), 'the sandbox stopped for its snapshot');
    await sandbox.fs.uploadFile(Buffer.from('v2'), 'state.txt');

    const copy = await create({ snapshot: name });
    assert.equal((await copy.fs.downloadFile('state.txt')).toString(), 'v1');
    assert.equal((await sandbox.fs.downloadFile('state.txt')).toString(), 'v2');
  });

  test('deactivate, activate and delete', async () => {
    const sandbox = await create();
    await sandbox.fs.uploadFile(Buffer.from('x'), 'x.txt');
    const name = unique('reg');
    trackSnapshot(name);
    await sandbox.createSnapshot(name);
    const snapshot = await daytona.snapshot.get(name);

    const off = await api('POST', `/snapshots/${snapshot.id}/deactivate`);
    assert.ok(off.status < 300, off.text);
    assert.equal((await daytona.snapshot.get(name)).state, SnapshotState.INACTIVE);
    await assert.rejects(daytona.create({ snapshot: name }), /activate/i);
    const on = await daytona.snapshot.activate(name);
    assert.equal(on.state, SnapshotState.ACTIVE);
    const copy = await create({ snapshot: name });
    assert.equal((await copy.fs.downloadFile('x.txt')).toString(), 'x');
    await copy.delete();

    await daytona.snapshot.delete(await daytona.snapshot.get(name));
    await assert.rejects(daytona.snapshot.get(name), DaytonaNotFoundError);
  });
});
