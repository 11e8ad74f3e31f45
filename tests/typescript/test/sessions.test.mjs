// Sessions through the TypeScript SDK: a real shell whose cwd and exports
// persist, commands in the background with their logs, streaming a command's
// logs while answering its prompt (sendSessionCommandInput), and delete.

import assert from 'node:assert/strict';
import { before, describe, test } from 'node:test';

import { DaytonaError } from '@daytonaio/sdk';

import { HOME, setup, unique, waitUntil } from '../lib/env.mjs';

const { create } = setup();

/** Rejects if `promise` is not settled within `ms`. */
function within(promise, ms, what) {
  let timer;
  return Promise.race([
    promise,
    new Promise((_, reject) => {
      timer = setTimeout(() => reject(new Error(`${what} did not finish within ${ms} ms`)), ms);
    }),
  ]).finally(() => clearTimeout(timer));
}

describe('sessions', () => {
  let sandbox;
  before(async () => {
    sandbox = await create();
  });

  test('a session keeps its cwd and exports, and starts in the home', async () => {
    const session = unique('work');
    await sandbox.process.createSession(session);
    const first = await sandbox.process.executeSessionCommand(session, { command: 'pwd; whoami' });
    assert.equal(first.exitCode, 0);
    assert.deepEqual(first.output.trim().split('\n'), [HOME, 'daytona']);
    await sandbox.process.executeSessionCommand(session, { command: 'cd /tmp && export FOO=bar' });
    // `(exit 4)`: a bare `exit` would end the session's shell, as on Daytona.
    const second = await sandbox.process.executeSessionCommand(session, { command: 'pwd; echo $FOO; echo oops >&2; (exit 4)' });
    assert.equal(second.exitCode, 4);
    assert.equal(second.stdout, '/tmp\nbar\n');
    assert.equal(second.stderr, 'oops\n');
    // The session survives a failing command.
    const third = await sandbox.process.executeSessionCommand(session, { command: 'echo $FOO' });
    assert.equal(third.output.trim(), 'bar');

    const info = await sandbox.process.getSession(session);
    assert.equal(info.sessionId, session);
    assert.equal(info.commands.length, 4);
    assert.ok((await sandbox.process.listSessions()).some((s) => s.sessionId === session));
    await sandbox.process.deleteSession(session);
    assert.ok(!(await sandbox.process.listSessions()).some((s) => s.sessionId === session));
    await assert.rejects(sandbox.process.getSession(session), DaytonaError);
  });

  test('an async command runs in the background and its logs are kept', async () => {
    const session = unique('bg');
    await sandbox.process.createSession(session);
    const started = await sandbox.process.executeSessionCommand(session, {
      command: 'echo one; sleep 1; echo two >&2; echo three; exit 7',
      runAsync: true,
    });
    assert.match(started.cmdId, /\S/);
    assert.equal(started.exitCode ?? null, null);
    const running = await sandbox.process.getSessionCommand(session, started.cmdId);
    assert.equal(running.exitCode ?? null, null, 'the command finished before its sleep');
    assert.ok(await waitUntil(async () =>
      (await sandbox.process.getSessionCommand(session, started.cmdId)).exitCode != null, 20_000));
    assert.equal((await sandbox.process.getSessionCommand(session, started.cmdId)).exitCode, 7);
    const logs = await sandbox.process.getSessionCommandLogs(session, started.cmdId);
    assert.equal(logs.stdout, 'one\nthree\n');
    assert.equal(logs.stderr, 'two\n');
    // Both streams, each in its order (stdout and stderr are two pipes: what
    // they carry a moment apart may arrive either way round).
    assert.ok(logs.output.startsWith('one\n'), logs.output);
    assert.deepEqual(logs.output.split('\n').sort(), ['', 'one', 'three', 'two']);
    await sandbox.process.deleteSession(session);
  });

  test('streaming logs while answering a prompt', async () => {
    const session = unique('interactive');
    await sandbox.process.createSession(session);
    const command = await sandbox.process.executeSessionCommand(session, {
      command: 'echo "Enter your name:"; read name; echo "Hello $name"; echo done >&2',
      runAsync: true,
    });
    const out = [];
    const err = [];
    const follow = sandbox.process.getSessionCommandLogs(session, command.cmdId,
      (chunk) => out.push(chunk), (chunk) => err.push(chunk));
    assert.ok(await waitUntil(() => out.join('').includes('Enter your name:\n'), 15_000),
      `no prompt streamed: ${JSON.stringify(out)}`);
    await sandbox.process.sendSessionCommandInput(session, command.cmdId, 'Alice');
    // The stream ends when the command does.
    await within(follow, 30_000, 'following the logs');
    assert.equal(out.join(''), 'Enter your name:\nAlice\nHello Alice\n');
    assert.equal(err.join(''), 'done\n');
    assert.equal((await sandbox.process.getSessionCommand(session, command.cmdId)).exitCode, 0);
    const logs = await sandbox.process.getSessionCommandLogs(session, command.cmdId);
    assert.equal(logs.stdout, 'Enter your name:\nAlice\nHello Alice\n');
    await sandbox.process.deleteSession(session);
  });

  test('input echo can be suppressed', async () => {
    const session = unique('secret');
    await sandbox.process.createSession(session);
    const command = await sandbox.process.executeSessionCommand(session, {
      command: 'read -r secret; echo "${#secret} characters"',
      runAsync: true,
      suppressInputEcho: true,
    });
    await sandbox.process.sendSessionCommandInput(session, command.cmdId, 'hunter2');
    assert.ok(await waitUntil(async () =>
      (await sandbox.process.getSessionCommand(session, command.cmdId)).exitCode != null, 15_000));
    assert.equal((await sandbox.process.getSessionCommandLogs(session, command.cmdId)).stdout, '7 characters\n');
    await sandbox.process.deleteSession(session);
  });
});
