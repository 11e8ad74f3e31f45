// A sandbox's life through the TypeScript SDK: create with a name, labels and
// env, find it, relabel it, set its timers, stop and start it (files stay,
// processes end), ephemeral sandboxes, delete, and the errors on the way.

import assert from 'node:assert/strict';
import { describe, test } from 'node:test';

import {
  DaytonaAuthenticationError,
  DaytonaConflictError,
  Daytona,
  DaytonaNotFoundError,
  DaytonaValidationError,
  SandboxState,
} from '@daytonaio/sdk';

import { API_URL, HOME, api, sandboxIds, setup, sh, unique, waitUntil } from '../lib/env.mjs';

const { daytona, create } = setup();

describe('lifecycle', () => {
  test('a walk: labels, cwd in the home, timers, stop and start, delete', async () => {
    const name = unique('walk');
    const tag = unique('t');
    const sandbox = await create({
      name,
      labels: { team: 'a', walk: tag },
      envVars: { MODE: 'fast' },
      autoStopInterval: 30,
      resources: { cpu: 1, memory: 1, disk: 3 },
    });
    assert.equal(sandbox.name, name);
    assert.equal(sandbox.state, SandboxState.STARTED);
    assert.equal(sandbox.labels.team, 'a');
    // The SDK records its code language as a label; cove keeps it.
    assert.equal(sandbox.labels['code-toolbox-language'], 'python');
    assert.equal(sandbox.autoStopInterval, 30);
    assert.deepEqual([sandbox.cpu, sandbox.memory, sandbox.disk], [1, 1, 3]);
    assert.equal(await sh(sandbox, 'echo $MODE'), 'fast');

    // Work in the home directory, as Daytona's docs do.
    await sandbox.fs.createFolder(`${HOME}/app`, '755');
    await sandbox.fs.uploadFile(Buffer.from('print("ran from app")\n'), `${HOME}/app/main.py`);
    assert.equal(await sh(sandbox, 'python3 main.py && pwd', `${HOME}/app`), `ran from app\n${HOME}/app`);

    // Found by id, by name and by label.
    assert.equal((await daytona.get(sandbox.id)).name, name);
    assert.equal((await daytona.get(name)).id, sandbox.id);
    const found = [];
    for await (const s of daytona.list({ labels: { walk: tag } })) found.push(s.id);
    assert.deepEqual(found, [sandbox.id]);

    // Relabelled: the new set replaces the old one.
    const labels = await sandbox.setLabels({ team: 'b', walk: tag });
    assert.deepEqual(labels, { team: 'b', walk: tag });
    assert.deepEqual((await daytona.get(sandbox.id)).labels, { team: 'b', walk: tag });
    const teamA = [];
    for await (const s of daytona.list({ labels: { team: 'a', walk: tag } })) teamA.push(s.id);
    assert.deepEqual(teamA, []);

    // Timers.
    await sandbox.setAutostopInterval(0);
    await sandbox.setAutoArchiveInterval(60);
    await sandbox.setAutoDeleteInterval(120);
    await sandbox.refreshData();
    assert.deepEqual([sandbox.autoStopInterval, sandbox.autoArchiveInterval, sandbox.autoDeleteInterval], [0, 60, 120]);
    await sandbox.setAutoDeleteInterval(-1);
    await sandbox.setTtl(90);
    await sandbox.refreshData();
    assert.equal(sandbox.autoDeleteInterval, -1);
    assert.ok(sandbox.autoDestroyAt, 'a TTL sets autoDestroyAt');
    const remaining = Date.parse(sandbox.autoDestroyAt) - Date.now();
    assert.ok(remaining > 85 * 60_000 && remaining <= 90 * 60_000 + 5000, `TTL ends in ${remaining} ms`);

    // Stop: processes end, files stay; start brings it back.
    const session = unique('keep');
    await sandbox.process.createSession(session);
    await sandbox.process.executeSessionCommand(session, { command: 'sleep 600', runAsync: true });
    // runAsync answers once the command is launched, not once it runs.
    assert.ok(await waitUntil(async () => (await sh(sandbox, 'ps -eo args')).includes('sleep 600'), 10_000),
      'the async command never ran');
    await sandbox.stop();
    assert.equal(sandbox.state, SandboxState.STOPPED);
    assert.equal((await daytona.get(sandbox.id)).state, SandboxState.STOPPED);
    await assert.rejects(sandbox.process.executeCommand('true'));
    await sandbox.start();
    assert.equal(sandbox.state, SandboxState.STARTED);
    assert.equal((await sandbox.fs.downloadFile(`${HOME}/app/main.py`)).toString(), 'print("ran from app")\n');
    assert.ok(!(await sh(sandbox, 'ps -eo args')).includes('sleep 600'), 'a process outlived stop');
    assert.equal(await sh(sandbox, 'echo $MODE'), 'fast');
    assert.equal(await sh(sandbox, 'whoami'), 'daytona');

    // Delete: gone by id and by name.
    await sandbox.delete();
    await assert.rejects(daytona.get(sandbox.id), DaytonaNotFoundError);
    await assert.rejects(daytona.get(name), DaytonaNotFoundError);
  });

  test('archive, then start again with the files kept', async () => {
    const sandbox = await create();
    await sandbox.fs.uploadFile(Buffer.from('kept through the archive'), 'notes.txt');
    await sandbox.stop();
    await sandbox.archive();
    await sandbox.refreshData();
    assert.equal(sandbox.state, SandboxState.ARCHIVED);
    await sandbox.start();
    assert.equal(sandbox.state, SandboxState.STARTED);
    assert.equal((await sandbox.fs.downloadFile('notes.txt')).toString(), 'kept through the archive');
  });

  test('an ephemeral sandbox is deleted when it stops', async () => {
    const sandbox = await create({ ephemeral: true });
    assert.equal(sandbox.autoDeleteInterval, 0);
    assert.equal(await sh(sandbox, 'echo alive'), 'alive');
    await sandbox.stop().catch(() => {});
    assert.ok(await waitUntil(async () => !(await sandboxIds()).has(sandbox.id), 30_000),
      'the ephemeral sandbox outlived its stop');
    await assert.rejects(daytona.get(sandbox.id), DaytonaNotFoundError);
  });

  test('errors: unknown sandboxes, bad requests and bad keys', async () => {
    const missing = unique('no-such-sandbox');
    await assert.rejects(daytona.get(missing), (e) => {
      assert.ok(e instanceof DaytonaNotFoundError, `${e.constructor.name}: ${e.message}`);
      assert.ok(e.message.includes(missing), e.message);
      return true;
    });
    const refused = { refused: unique('r') };
    // Above the server's ceilings: refused, never reduced, nothing made.
    await assert.rejects(daytona.create({ labels: refused, resources: { cpu: 64 } }),
      DaytonaValidationError);
    await assert.rejects(daytona.create({ labels: refused, snapshot: unique('no-such-snapshot') }),
      (e) => e instanceof DaytonaNotFoundError || e instanceof DaytonaValidationError);
    assert.deepEqual(await sandboxIds(refused), new Set());
    // A name is unique.
    const first = await create({ name: unique('dup') });
    await assert.rejects(daytona.create({ name: first.name }), (e) => {
      assert.ok(e instanceof DaytonaConflictError, `${e.constructor.name}: ${e.message}`);
      assert.ok(e.message.includes(first.name), e.message);
      return true;
    });

    const stranger = new Daytona({ apiKey: 'not-the-key', apiUrl: API_URL });
    try {
      await assert.rejects(stranger.get(first.id), DaytonaAuthenticationError);
    } finally {
      await stranger[Symbol.asyncDispose]();
    }
    const raw = await api('GET', '/sandbox', undefined, { auth: false });
    assert.equal(raw.status, 401);
  });
});
