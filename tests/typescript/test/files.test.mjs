// The file system through the TypeScript SDK: byte-exact transfers (Buffer,
// local path, stream, batch), listing, details, folders, moves, search,
// replace, permissions and the errors for what is not there.

import assert from 'node:assert/strict';
import { randomBytes } from 'node:crypto';
import fs from 'node:fs';
import os from 'node:os';
import path from 'node:path';
import { Readable } from 'node:stream';
import { before, describe, test } from 'node:test';

import { DaytonaNotFoundError } from '@daytonaio/sdk';

import { HOME, setup, sh, unique } from '../lib/env.mjs';

const { create } = setup();

async function readAll(stream) {
  const chunks = [];
  for await (const chunk of stream) chunks.push(Buffer.from(chunk));
  return Buffer.concat(chunks);
}

describe('files', () => {
  let sandbox;
  before(async () => {
    sandbox = await create();
  });

  test('a binary upload comes back byte for byte, and relative paths are in the home', async () => {
    const data = Buffer.concat([randomBytes(3 * 1024 * 1024 + 17), Buffer.from([0, 255, 13, 10])]);
    await sandbox.fs.uploadFile(data, 'blob.bin');
    const back = await sandbox.fs.downloadFile('blob.bin');
    assert.equal(back.length, data.length);
    assert.ok(back.equals(data), 'the download differs from the upload');
    assert.equal(await sh(sandbox, `sha256sum ${HOME}/blob.bin | cut -d' ' -f1`),
      (await import('node:crypto')).createHash('sha256').update(data).digest('hex'));
    // The uploaded file is the sandbox user's.
    assert.equal(await sh(sandbox, `stat -c %U ${HOME}/blob.bin`), 'daytona');
    // An empty file and an overwrite.
    await sandbox.fs.uploadFile(Buffer.alloc(0), 'empty');
    assert.equal((await sandbox.fs.downloadFile('empty')).length, 0);
    await sandbox.fs.uploadFile(Buffer.from('first'), 'over.txt');
    await sandbox.fs.uploadFile(Buffer.from('second'), 'over.txt');
    assert.equal((await sandbox.fs.downloadFile('over.txt')).toString(), 'second');
  });

  test('local files, streams and batches', async () => {
    const local = fs.mkdtempSync(path.join(os.tmpdir(), 'cvts-files'));
    try {
      const source = path.join(local, 'in.txt');
      fs.writeFileSync(source, 'from a local path\n');
      await sandbox.fs.uploadFile(source, '/tmp/from-path.txt');
      const target = path.join(local, 'out.txt');
      await sandbox.fs.downloadFile('/tmp/from-path.txt', target);
      assert.equal(fs.readFileSync(target, 'utf8'), 'from a local path\n');
    } finally {
      fs.rmSync(local, { recursive: true, force: true });
    }

    const big = randomBytes(2 * 1024 * 1024);
    await sandbox.fs.uploadFileStream(Readable.from([big.subarray(0, 1000), big.subarray(1000)]), '/tmp/streamed.bin');
    assert.ok((await readAll(await sandbox.fs.downloadFileStream('/tmp/streamed.bin'))).equals(big));

    const dir = `/tmp/${unique('batch')}`;
    await sandbox.fs.uploadFiles([
      { source: Buffer.from('a'), destination: `${dir}/a.txt` },
      { source: Buffer.from('b'), destination: `${dir}/deep/er/b.txt` },
    ]);
    const results = await sandbox.fs.downloadFiles([
      { source: `${dir}/a.txt` },
      { source: `${dir}/deep/er/b.txt` },
      { source: `${dir}/missing.txt` },
    ]);
    assert.equal(results.length, 3);
    assert.equal(results[0].result.toString(), 'a');
    assert.equal(results[1].result.toString(), 'b');
    assert.equal(results[2].result, undefined);
    assert.match(results[2].error, /missing\.txt|not found|no such/i);
  });

  test('folders, listing, details, moves and deletes', async () => {
    const root = `${HOME}/${unique('tree')}`;
    await sandbox.fs.createFolder(root, '755');
    await sandbox.fs.createFolder(`${root}/sub`, '700');
    await sandbox.fs.uploadFile(Buffer.from('12345'), `${root}/five.txt`);

    const listed = await sandbox.fs.listFiles(root);
    const byName = Object.fromEntries(listed.map((f) => [f.name, f]));
    assert.deepEqual(Object.keys(byName).sort(), ['five.txt', 'sub']);
    assert.equal(byName['five.txt'].isDir, false);
    assert.equal(byName['five.txt'].size, 5);
    assert.equal(byName['five.txt'].owner, 'daytona');
    assert.equal(byName.sub.isDir, true);
    for (const f of listed) assert.equal(f.path, `${root}/${f.name}`);

    const details = await sandbox.fs.getFileDetails(`${root}/sub`);
    assert.equal(details.isDir, true);
    assert.equal(details.name, 'sub');
    assert.match(details.permissions ?? details.mode, /rwx------|700/);

    await sandbox.fs.moveFiles(`${root}/five.txt`, `${root}/sub/moved.txt`);
    assert.equal((await sandbox.fs.downloadFile(`${root}/sub/moved.txt`)).toString(), '12345');
    await assert.rejects(sandbox.fs.getFileDetails(`${root}/five.txt`), DaytonaNotFoundError);

    await sandbox.fs.setFilePermissions(`${root}/sub/moved.txt`, { mode: '640' });
    assert.equal(await sh(sandbox, `stat -c %a ${root}/sub/moved.txt`), '640');

    await sandbox.fs.deleteFile(`${root}/sub/moved.txt`);
    assert.equal(await sh(sandbox, `test -e ${root}/sub/moved.txt && echo yes || echo no`), 'no');
    await sandbox.fs.deleteFile(root, true);
    assert.equal(await sh(sandbox, `test -e ${root} && echo yes || echo no`), 'no');
  });

  test('search, find and replace', async () => {
    const root = `/tmp/${unique('search')}`;
    await sandbox.fs.uploadFiles([
      { source: Buffer.from('alpha\nneedle here\n'), destination: `${root}/one.txt` },
      { source: Buffer.from('no match\n'), destination: `${root}/two.md` },
      { source: Buffer.from('needle again\n'), destination: `${root}/sub/three.txt` },
    ]);
    const found = await sandbox.fs.searchFiles(root, '*.txt');
    assert.deepEqual([...found.files].sort(), [`${root}/one.txt`, `${root}/sub/three.txt`]);
    const matches = await sandbox.fs.findFiles(root, 'needle');
    assert.deepEqual(matches.map((m) => [m.file, m.line, m.content.trim()]).sort(), [
      [`${root}/one.txt`, 2, 'needle here'],
      [`${root}/sub/three.txt`, 1, 'needle again'],
    ]);
    const replaced = await sandbox.fs.replaceInFiles([`${root}/one.txt`, `${root}/sub/three.txt`], 'needle', 'pin');
    assert.equal(replaced.length, 2);
    assert.ok(replaced.every((r) => r.success), JSON.stringify(replaced));
    assert.equal((await sandbox.fs.downloadFile(`${root}/one.txt`)).toString(), 'alpha\npin here\n');
    assert.equal((await sandbox.fs.downloadFile(`${root}/sub/three.txt`)).toString(), 'pin again\n');
  });

  // The SDK uploads with a chunked body; the agent once answered at the
  // multipart closing boundary, before the last chunk, and about 2% of
  // uploads then came back 502 (broken pipe) through the toolbox proxy.
  test('a hundred uploads in a row all arrive', async () => {
    const dir = `/tmp/${unique('many')}`;
    for (let i = 0; i < 100; i++) {
      await sandbox.fs.uploadFiles([{ source: Buffer.from(`n${i}`), destination: `${dir}/${i}` }]);
    }
    assert.equal(await sh(sandbox, `ls ${dir} | wc -l`), '100');
  });

  test('what is not there is a not-found error naming it', async () => {
    const missing = `/tmp/${unique('nothing')}.txt`;
    await assert.rejects(sandbox.fs.downloadFile(missing), (e) => {
      assert.ok(e instanceof DaytonaNotFoundError, `${e.constructor.name}: ${e.message}`);
      assert.ok(e.message.includes(missing), e.message);
      return true;
    });
    await assert.rejects(sandbox.fs.getFileDetails(missing), DaytonaNotFoundError);
    await assert.rejects(sandbox.fs.listFiles(`/tmp/${unique('nodir')}`), DaytonaNotFoundError);
  });
});
