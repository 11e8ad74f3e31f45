// VM sandboxes through the TypeScript SDK (seeds 000-002): one QEMU microVM,
// shared by the steps below because under TCG emulation each VM costs tens of
// seconds: it answers as a VM, pause and resume keep its running processes,
// and a fork holds the parent's memory (an interpreter's variable, a shell
// loop's count) and then goes its own way.
//
// The "in-memory counter" is a shell loop in a session: its variable lives
// only in the shell's memory and each turn writes it to a file. After a pause
// or a fork it must go on from where it was, not start again at 0.

import assert from 'node:assert/strict';
import os from 'node:os';
import { after, before, describe, test } from 'node:test';

import { SandboxState } from '@daytonaio/sdk';

import { VMS, VM_SNAPSHOT, VM_TIMEOUT, api, setup, sh, skipUnless, unique, waitUntil } from '../lib/env.mjs';

const { create, track } = setup();
const COUNTER = 'i=0; while true; do i=$((i+1)); echo $i > /tmp/c.new; mv /tmp/c.new /tmp/counter; sleep 0.2; done';

async function counter(sandbox) {
  const r = await sandbox.process.executeCommand('cat /tmp/counter 2>/dev/null || echo 0');
  return Number(r.result.trim() || 0);
}

/** The loop runs, and its count went on from `atLeast` rather than from 0. */
async function countingOn(sandbox, atLeast) {
  const first = await counter(sandbox);
  assert.ok(first >= atLeast, `the count is ${first}, below ${atLeast}: it started again`);
  assert.ok(await waitUntil(async () => (await counter(sandbox)) > first, 60_000, 500), 'the count stopped');
}

describe('a VM sandbox', { timeout: 30 * 60_000 }, () => {
  let vm = null;
  let home = null;
  let counterCommand = null;

  before(async () => {
    if (!VMS) return;
    vm = await create({ snapshot: VM_SNAPSHOT }, { timeout: VM_TIMEOUT });
    home = await vm.getUserHomeDir();
  });

  // Each step needs the VM; without VM assets each is skipped (failed under
  // COVE_TEST_STRICT=1).
  const needsVm = (t) => skipUnless(t, vm, 'VMs are off (COVE_TEST_VM_ASSETS is not set)');

  test('answers as a VM with a kernel of its own', async (t) => {
    if (needsVm(t)) return;
    assert.equal(vm.state, SandboxState.STARTED);
    assert.equal(vm.sandboxClass, 'linux-vm');
    const dto = (await api('GET', `/sandbox/${vm.id}`)).json;
    assert.ok(['kvm', 'tcg'].includes(dto.accelerator), dto.accelerator);
    assert.notEqual(await sh(vm, 'uname -r'), os.release());
    assert.equal(await sh(vm, 'echo hello from a vm'), 'hello from a vm');
    const ran = await vm.process.codeRun('print(6 * 7)');
    assert.deepEqual([ran.exitCode, ran.result], [0, '42\n']);
    // The sandbox's user, in its home, owns what it uploads.
    const user = await sh(vm, 'whoami');
    assert.equal(vm.user, user);
    assert.equal(await sh(vm, 'pwd'), home);
    await vm.fs.uploadFile(Buffer.from('on disk'), `${home}/kept.txt`);
    assert.equal((await vm.fs.downloadFile(`${home}/kept.txt`)).toString(), 'on disk');
    assert.equal(await sh(vm, `stat -c %U ${home}/kept.txt`), user);
  });

  test('pause and resume keep running processes', async (t) => {
    if (needsVm(t)) return;
    await vm.process.createSession('keepalive');
    counterCommand = (await vm.process.executeSessionCommand('keepalive', { command: COUNTER, runAsync: true })).cmdId;
    assert.ok(await waitUntil(async () => (await counter(vm)) >= 2, VM_TIMEOUT * 1000, 500), 'the counter never started');
    const before = await counter(vm);

    await vm.pause(VM_TIMEOUT);
    assert.equal(vm.state, SandboxState.PAUSED);
    assert.equal((await api('GET', `/sandbox/${vm.id}`)).json.state, 'paused');
    await vm.start(VM_TIMEOUT);
    assert.equal(vm.state, SandboxState.STARTED);

    // The command started before the pause still runs, and its in-memory
    // count went on from where it was.
    assert.equal((await vm.process.getSessionCommand('keepalive', counterCommand)).exitCode ?? null, null);
    await countingOn(vm, before);
    assert.equal((await vm.fs.downloadFile(`${home}/kept.txt`)).toString(), 'on disk');
  });

  test('a fork holds the parent memory, then diverges', async (t) => {
    if (needsVm(t)) return;
    if (counterCommand === null) {
      await vm.process.createSession('keepalive');
      await vm.process.executeSessionCommand('keepalive', { command: COUNTER, runAsync: true });
    }
    assert.ok(await waitUntil(async () => (await counter(vm)) >= 2, VM_TIMEOUT * 1000, 500));
    const set = await vm.codeInterpreter.runCode('x = 41');
    assert.equal(set.error, undefined, JSON.stringify(set.error));
    const atFork = await counter(vm);

    const child = await vm.fork({ name: unique('fork') }, VM_TIMEOUT);
    track(child.id);
    assert.equal(child.state, SandboxState.STARTED);
    assert.notEqual(child.id, vm.id);

    // The interpreter's variable came along, and each side now has its own.
    await child.codeInterpreter.runCode('x += 1');
    assert.equal((await child.codeInterpreter.runCode('print(x)')).stdout.trim(), '42');
    assert.equal((await vm.codeInterpreter.runCode('print(x)')).stdout.trim(), '41');
    // So did the loop's count, in both.
    await countingOn(child, atFork);
    await countingOn(vm, atFork);

    // Disks are independent too.
    await child.fs.uploadFile(Buffer.from('child'), `${home}/who`);
    assert.equal((await child.fs.downloadFile(`${home}/who`)).toString(), 'child');
    assert.equal(await sh(vm, `cat ${home}/who 2>/dev/null || echo none`), 'none');

    // The fork tree.
    const forks = (await api('GET', `/sandbox/${vm.id}/forks`)).json;
    assert.deepEqual(forks.map((f) => f.id), [child.id]);
    assert.equal((await api('GET', `/sandbox/${child.id}/parent`)).json.id, vm.id);
    // A parent with forks stays; the message names them.
    const refused = await api('DELETE', `/sandbox/${vm.id}`);
    assert.equal(refused.status, 409, refused.text);
    assert.ok(refused.text.includes(child.id) || refused.text.includes(child.name), refused.text);

    await child.delete(VM_TIMEOUT, true);
  });

  after(() => {
    vm = null;
  });
});
