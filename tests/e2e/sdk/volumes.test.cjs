'use strict';
// Volumes through the official JS SDK: Volume (the /volumes routes with the
// API key; the /volumecontent routes with the volume's token at
// E2B_VOLUME_API_URL, the server too).
const test = require('node:test');
const assert = require('node:assert/strict');
const crypto = require('node:crypto');
const { e2b, template } = require('./helpers.cjs');

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

test('Volume mounted in a sandbox: the guest reads and writes it, the host may not meanwhile, the data stays after the kill', async (t) => {
  const vol = await Volume.create('jsvol-' + crypto.randomBytes(5).toString('hex'));
  t.after(async () => {
    await Volume.destroy(vol.volumeId).catch(() => {});
  });
  await vol.writeFile('/seed.txt', 'from js\n');
  const sbx = await e2b.Sandbox.create(template, { timeoutMs: 300_000, volumeMounts: { '/mnt/vol': vol } });
  try {
    const r = await sbx.commands.run('cat /mnt/vol/seed.txt && echo guest > /mnt/vol/out.txt');
    assert.equal(r.stdout, 'from js\n');
    assert.deepEqual((await sbx.getInfo()).volumeMounts, [{ name: vol.name, path: '/mnt/vol' }]);
    await assert.rejects(vol.readFile('/seed.txt'), /mounted in sandbox/);
    await assert.rejects(e2b.Sandbox.create(template, { timeoutMs: 60_000, volumeMounts: { '/x': vol.name } }), /mounted in sandbox/);
  } finally {
    await sbx.kill();
  }
  assert.equal(await vol.readFile('/out.txt'), 'guest\n');
  await assert.rejects(e2b.Sandbox.create(template, { timeoutMs: 60_000, volumeMounts: { '/mnt/x': 'no-such-volume' } }), /no volume/);
});
