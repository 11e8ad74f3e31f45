// The TypeScript SDK's WebSocket paths in a container sandbox: the stateful
// code interpreter (output streamed to callbacks, variables kept between runs
// and per context, errors as data) and a PTY (input, resize, exit code).

import assert from 'node:assert/strict';
import { before, describe, test } from 'node:test';

import { HOME, setup, unique, waitUntil } from '../lib/env.mjs';

const { create } = setup();

describe('interactive', () => {
  let sandbox;
  before(async () => {
    sandbox = await create();
  });

  test('the code interpreter keeps state, streams output and reports errors', async () => {
    const streamed = [];
    const first = await sandbox.codeInterpreter.runCode('import time\ncounter = 41\nprint("step 1")\ntime.sleep(0.3)\nprint("step 2")', {
      onStdout: (message) => streamed.push(message.output),
    });
    assert.equal(first.error, undefined, JSON.stringify(first.error));
    assert.equal(first.stdout, 'step 1\nstep 2\n');
    assert.equal(streamed.join(''), 'step 1\nstep 2\n');

    const second = await sandbox.codeInterpreter.runCode('counter += 1\nprint(counter)');
    assert.equal(second.stdout.trim(), '42');

    // A context of its own does not see the default one's variables.
    const context = await sandbox.codeInterpreter.createContext(HOME);
    try {
      const isolated = await sandbox.codeInterpreter.runCode("import os\nprint('counter' in globals(), os.getcwd())", { context });
      assert.equal(isolated.stdout.trim(), `False ${HOME}`);
      assert.ok((await sandbox.codeInterpreter.listContexts()).some((c) => c.id === context.id));
    } finally {
      await sandbox.codeInterpreter.deleteContext(context);
    }
    assert.ok(!(await sandbox.codeInterpreter.listContexts()).some((c) => c.id === context.id));

    const failed = await sandbox.codeInterpreter.runCode("print('before')\nraise ValueError('bad value')");
    assert.equal(failed.stdout, 'before\n');
    assert.equal(failed.error?.name, 'ValueError');
    assert.equal(failed.error?.value, 'bad value');
  });

  test('a PTY runs a shell: input, resize, exit code', async () => {
    const id = unique('pty');
    const decoder = new TextDecoder();
    let output = '';
    const pty = await sandbox.process.createPty({
      id,
      cols: 100,
      rows: 30,
      envs: { GREETING: 'hi-from-pty' },
      onData: (data) => {
        output += decoder.decode(data, { stream: true });
      },
    });
    await pty.waitForConnection();
    await pty.sendInput('echo "$GREETING $(whoami) $(tput cols)"\n');
    assert.ok(await waitUntil(() => output.includes('hi-from-pty daytona 100'), 15_000), JSON.stringify(output));

    const info = await pty.resize(120, 40);
    assert.deepEqual([info.cols, info.rows], [120, 40]);
    await pty.sendInput('echo "cols=$(tput cols)"\n');
    assert.ok(await waitUntil(() => output.includes('cols=120'), 15_000), JSON.stringify(output));
    assert.ok((await sandbox.process.listPtySessions()).some((s) => s.id === id));

    await pty.sendInput('exit 3\n');
    const result = await pty.wait();
    assert.equal(result.exitCode, 3);
    await pty.disconnect();
  });
});
