#!/usr/bin/env node
// Runs the TypeScript SDK suite: starts the fake internet and a `cove serve`
// of its own (lib/server.mjs), runs every test file under `node --test` with
// the server's address in the environment, then deletes what is left, stops
// the server by its PID and removes its data dir.
//
//   node run.mjs [test/some.test.mjs ...]
//
// With COVE_TS_API_URL and COVE_TS_API_KEY set, no server is started: the
// tests use that one (its sandboxes' network and VMs as they are).
// COVE_TEST_STRICT=1: a test that would skip fails instead, and so does the run
// when node's own count of skipped tests is not zero. Todo tests (known cove
// bugs, each named in the test) run and report without failing the run.

import { spawn } from 'node:child_process';
import fs from 'node:fs';
import path from 'node:path';
import { fileURLToPath } from 'node:url';

import { CoveServer, FakeInternet, isRoot, vmAssets } from './lib/server.mjs';

// --test-concurrency and several reporters at once.
if (Number(process.versions.node.split('.')[0]) < 20) {
  console.error(`the TypeScript SDK suite needs Node.js 20 or newer (this is ${process.version})`);
  process.exit(1);
}

const here = path.dirname(fileURLToPath(import.meta.url));
const STRICT = process.env.COVE_TEST_STRICT === '1';

function testFiles(args) {
  if (args.length) return args;
  const dir = path.join(here, 'test');
  return fs.readdirSync(dir).filter((f) => f.endsWith('.test.mjs')).sort().map((f) => path.join('test', f));
}

let internet = null;
let server = null;
let testRun = null;
let resultsDir = null;
let cleaning = null;

async function cleanup() {
  cleaning ??= (async () => {
    let kept = false;
    if (testRun && testRun.exitCode === null && testRun.signalCode === null) {
      // Interrupted: the test processes end before the server they talk to.
      testRun.kill('SIGTERM');
      await new Promise((resolve) => testRun.once('exit', resolve));
    }
    if (resultsDir) fs.rmSync(resultsDir, { recursive: true, force: true });
    if (server) {
      if (server.proc) await server.deleteAll().catch((e) => console.error(`cleanup: ${e}`));
      const code = await server.stop();
      if (code === 0 || code === 'SIGTERM' || code === null) {
        kept = !(await server.remove());
      } else {
        kept = true;
        console.error(`cove exited with ${code}; data dir and log kept at ${server.dataDir}`);
      }
    }
    if (internet) await internet.stop();
    return kept;
  })();
  return cleaning;
}

for (const signal of ['SIGINT', 'SIGTERM']) {
  process.on(signal, () => {
    cleanup().finally(() => process.exit(130));
  });
}

async function main() {
  const files = testFiles(process.argv.slice(2));
  const env = { ...process.env };
  if (process.env.COVE_TS_API_URL && process.env.COVE_TS_API_KEY) {
    console.log(`using the server at ${process.env.COVE_TS_API_URL}`);
  } else {
    const extraArgs = [];
    if (isRoot()) {
      internet = new FakeInternet();
      await internet.start();
      extraArgs.push(...internet.serverArgs());
      env.COVE_TS_FAKE_ALLOWED = FakeInternet.ALLOWED;
      env.COVE_TS_FAKE_DENIED = FakeInternet.DENIED;
    } else {
      // Without root there is no server at all (namespaces, mounts, cgroups).
      throw new Error('the suite starts cove, which needs root');
    }
    server = new CoveServer({ extraArgs, vms: true });
    const started = Date.now();
    await server.start();
    console.log(`cove serving on ${server.apiUrl} (ready in ${((Date.now() - started) / 1000).toFixed(1)} s; `
      + `data dir ${server.dataDir}, log ${server.logPath}; VMs ${server.vms ? 'on' : 'off'})`);
    Object.assign(env, {
      COVE_TS_API_URL: server.apiUrl,
      COVE_TS_API_KEY: server.apiKey,
      COVE_TS_VMS: server.vms ? '1' : '0',
    });
  }
  if (!vmAssets() && !process.env.COVE_TS_VMS) env.COVE_TS_VMS = '0';

  resultsDir = fs.mkdtempSync('/tmp/cvts-results');
  const tap = path.join(resultsDir, 'results.tap');
  const concurrency = process.env.COVE_TS_CONCURRENCY || '3';
  const args = [
    '--test',
    `--test-concurrency=${concurrency}`,
    '--test-reporter=spec', '--test-reporter-destination=stdout',
    '--test-reporter=tap', `--test-reporter-destination=${tap}`,
    ...files,
  ];
  const child = spawn(process.execPath, args, { cwd: here, env, stdio: 'inherit' });
  testRun = child;
  const code = await new Promise((resolve) => child.on('exit', (c, s) => resolve(c ?? (s ? 1 : 0))));

  let failed = code !== 0;
  const results = fs.readFileSync(tap, 'utf8');
  const count = (name) => Number((results.match(new RegExp(`^# ${name} (\\d+)$`, 'm')) || [])[1] || 0);
  const [pass, fail, skip, todo] = ['pass', 'fail', 'skip', 'todo'].map(count);
  console.log(`typescript suite: ${pass} passed, ${fail} failed, ${skip} skipped, ${todo} todo`);
  // A skipped test did not run at all, and a todo one does not fail the run
  // whatever it finds: strict runs (CI) allow neither.
  if (STRICT && skip + todo > 0) {
    console.error('COVE_TEST_STRICT=1: every test must run and count, and some were skipped or todo');
    failed = true;
  }
  if (pass === 0) {
    console.error('no test passed');
    failed = true;
  }
  if (failed && server) console.error(`server log tail:\n${server.logTail(40)}`);
  return failed ? 1 : 0;
}

let status = 1;
try {
  status = await main();
} catch (e) {
  console.error(e?.stack || String(e));
  status = 1;
} finally {
  if (await cleanup()) status = status || 1;
}
process.exit(status);
