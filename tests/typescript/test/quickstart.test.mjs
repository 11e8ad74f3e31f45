// Daytona's TypeScript quick start against cove: create a sandbox, run a
// command, run code with `codeRun`; and what exec promises (cwd, env, exit
// codes, a deadline).

import assert from 'node:assert/strict';
import os from 'node:os';
import { before, describe, test } from 'node:test';

import { DaytonaError, SandboxState } from '@daytonaio/sdk';

import { HOME, setup, sh } from '../lib/env.mjs';

const { create } = setup();

describe('quick start', () => {
  let sandbox;
  before(async () => {
    sandbox = await create();
  });

  test('create answers a started sandbox of the default user in its home', async () => {
    assert.equal(sandbox.state, SandboxState.STARTED);
    assert.match(sandbox.id, /\S/);
    assert.equal(sandbox.user, 'daytona');
    assert.equal(await sh(sandbox, 'whoami'), 'daytona');
    assert.deepEqual((await sh(sandbox, 'id -u; id -g')).split('\n'), ['1000', '1000']);
    assert.equal(await sh(sandbox, 'pwd'), HOME);
    assert.equal(await sandbox.getUserHomeDir(), HOME);
    assert.equal(await sandbox.getWorkDir(), HOME);
    // Passwordless sudo, to the sandbox's own root.
    assert.equal(await sh(sandbox, 'sudo -n whoami'), 'root');
    // A sandbox of its own kernel namespaces: not the host's hostname.
    assert.notEqual(await sh(sandbox, 'hostname'), os.hostname());
  });

  test('codeRun: the quick start prints its sum', async () => {
    const response = await sandbox.process.codeRun('x = 10\ny = 20\nprint(f"Sum: {x + y}")\n');
    assert.equal(response.exitCode, 0);
    assert.equal(response.result, 'Sum: 30\n');
    assert.equal(response.artifacts.stdout, 'Sum: 30\n');
    assert.deepEqual(response.artifacts.charts, []);
  });

  test('codeRun passes argv and env, and each run is a fresh process', async () => {
    const code = "import os, sys\nprint(sys.argv[1:])\nprint(os.environ['GREETING'])";
    const response = await sandbox.process.codeRun(code, { argv: ['one', 'two words'], env: { GREETING: 'hello there' } });
    assert.equal(response.exitCode, 0);
    assert.deepEqual(response.result.split('\n'), ["['one', 'two words']", 'hello there', '']);
    await sandbox.process.codeRun('remembered = 42');
    assert.equal((await sandbox.process.codeRun("print('remembered' in globals())")).result, 'False\n');
  });

  test('codeRun reports a failing program and its traceback', async () => {
    const failed = await sandbox.process.codeRun("import sys\nprint('partial')\nsys.exit(5)");
    assert.equal(failed.exitCode, 5);
    assert.equal(failed.result, 'partial\n');
    const crashed = await sandbox.process.codeRun("def f():\n    raise RuntimeError('boom')\nf()");
    assert.equal(crashed.exitCode, 1);
    assert.ok(crashed.result.includes("raise RuntimeError('boom')"), crashed.result);
    assert.ok(crashed.result.endsWith('RuntimeError: boom\n'), crashed.result);
  });

  test('codeRun with a timeout stops the program', async () => {
    const started = Date.now();
    const response = await sandbox.process.codeRun("import time\nprint('begin')\ntime.sleep(60)\nprint('never')",
      undefined, 2);
    assert.ok(Date.now() - started < 20_000, 'codeRun waited past its deadline');
    // timeout(1)'s exit code, as exec answers a deadline.
    assert.equal(response.exitCode, 124);
    assert.equal(response.result, 'begin\n');
    assert.ok(!(await sh(sandbox, 'ps -eo args')).includes('time.sleep(60)'), 'the program outlived its deadline');
  });

  test('executeCommand: output, exit codes, cwd and env', async () => {
    const hi = await sandbox.process.executeCommand('echo hi');
    assert.deepEqual([hi.exitCode, hi.result, hi.artifacts.stdout], [0, 'hi\n', 'hi\n']);
    const failed = await sandbox.process.executeCommand('echo out; echo err >&2; exit 3');
    assert.equal(failed.exitCode, 3);
    assert.equal(failed.result, 'out\nerr\n');
    assert.equal(await sh(sandbox, 'pwd', '/tmp'), '/tmp');
    // A cwd in the home directory, as Daytona's examples write it.
    await sh(sandbox, `mkdir -p ${HOME}/project`);
    assert.equal(await sh(sandbox, 'pwd', `${HOME}/project`), `${HOME}/project`);
    assert.equal(await sh(sandbox, 'echo "$A-$B"', undefined, { A: 'one', B: 'two words' }), 'one-two words');
    // A missing cwd is an error naming it (a failed command naming it would do too).
    try {
      const missing = await sandbox.process.executeCommand('pwd', '/no/such/dir');
      assert.notEqual(missing.exitCode, 0);
      assert.ok(missing.result.includes('/no/such/dir'), missing.result);
    } catch (e) {
      assert.ok(e instanceof DaytonaError, String(e));
      assert.ok(e.message.includes('/no/such/dir'), e.message);
    }
  });

  test('executeCommand with a timeout ends the command', async () => {
    const started = Date.now();
    const response = await sandbox.process.executeCommand('echo begin; sleep 60; echo never', undefined, undefined, 2);
    assert.ok(Date.now() - started < 20_000, 'exec waited past its deadline');
    assert.equal(response.exitCode, 124);
    assert.equal(response.result, 'begin\n');
  });
});
