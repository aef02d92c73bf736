'use strict';
// Volumes through the official JS SDK: Volume (the /volumes routes with the
// API key; the /volumecontent routes with the volume's token at
// E2B_VOLUME_API_URL, the server too).
const test = require('node:test');
const assert = require('node:assert/strict');
const crypto = require('node:crypto');
const { e2b } = require('./helpers.cjs');

const { Volume, VolumePathNotFoundError } = e2b;

test('Volume: create, files, metadata, list, connect, destroy', async (t) => {
  const vol = await Volume.create('jsvol-' + crypto.randomBytes(5).toString('hex'));
  t.after(async () => {
    await Volume.destroy(vol.volumeId).catch(() => {});
  });
  assert.ok(vol.volumeId && vol.token);
  assert.ok((await Volume.list()).some((v) => v.volumeId === vol.volumeId));

  let e = await vol.writeFile('/data/hello.txt', 'hello from js', { mode: 0o640 });
  assert.equal(e.path, '/data/hello.txt');
  assert.equal(e.size, 13);
  assert.equal(e.mode, 0o640);
  assert.equal(await vol.readFile('/data/hello.txt'), 'hello from js');
  const blob = crypto.randomBytes(300_000);
  await vol.writeFile('/data/blob.bin', blob.buffer.slice(blob.byteOffset, blob.byteOffset + blob.length));
  assert.deepEqual(Buffer.from(await vol.readFile('/data/blob.bin', { format: 'bytes' })), blob);

  e = await vol.makeDir('/a/b', { force: true });
  assert.equal(e.type, 'directory');
  const listed = (await vol.list('/', { depth: 2 })).map((x) => x.path);
  assert.ok(listed.includes('/a/b') && listed.includes('/data/hello.txt'), listed.join(' '));

  e = await vol.updateMetadata('/data/hello.txt', { uid: 0, gid: 0, mode: 0o600 });
  assert.deepEqual([e.uid, e.gid, e.mode], [0, 0, 0o600]);
  assert.ok(await vol.exists('/data/hello.txt'));
  await vol.remove('/data');
  assert.equal(await vol.exists('/data/hello.txt'), false);
  await assert.rejects(vol.readFile('/data/hello.txt'), VolumePathNotFoundError);

  const again = await Volume.connect(vol.volumeId);
  assert.equal(again.token, vol.token);
  assert.ok(await again.exists('/a/b'));

  assert.equal(await Volume.destroy(vol.volumeId), true);
  assert.equal(await Volume.destroy(vol.volumeId), false);
});
