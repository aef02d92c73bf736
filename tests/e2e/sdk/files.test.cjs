'use strict';
const test = require('node:test');
const assert = require('node:assert/strict');
const { e2b, withSandbox, eventually } = require('./helpers.cjs');

test('files', async (t) => {
  await withSandbox(t, {}, async (sbx) => {
    const dir = '/home/user/sdk';

    await t.test('write and read back text and bytes', async () => {
      const info = await sbx.files.write(dir + '/a.txt', 'hello file');
      assert.equal(info.path, dir + '/a.txt');
      assert.equal(info.type, 'file');
      assert.equal(await sbx.files.read(dir + '/a.txt'), 'hello file');
      const bytes = await sbx.files.read(dir + '/a.txt', { format: 'bytes' });
      assert.equal(Buffer.from(bytes).toString(), 'hello file');
      // Written files belong to the default user.
      const st = await sbx.files.getInfo(dir + '/a.txt');
      assert.equal(st.owner, 'user');
    });

    await t.test('exists', async () => {
      assert.equal(await sbx.files.exists(dir + '/a.txt'), true);
      assert.equal(await sbx.files.exists(dir + '/missing.txt'), false);
    });

    await t.test('reading a missing file raises NotFoundError', async () => {
      await assert.rejects(sbx.files.read(dir + '/missing.txt'), (e) => e instanceof e2b.NotFoundError);
    });

    await t.test('makeDir and list', async () => {
      assert.equal(await sbx.files.makeDir(dir + '/sub/deeper'), true);
      assert.equal(await sbx.files.makeDir(dir + '/sub/deeper'), false);
      await sbx.files.write(dir + '/sub/b.txt', 'bb');
      const entries = await sbx.files.list(dir + '/sub');
      const names = entries.map((e) => e.name).sort();
      assert.deepEqual(names, ['b.txt', 'deeper']);
      const b = entries.find((e) => e.name === 'b.txt');
      assert.equal(b.type, 'file');
      assert.equal(b.size, 2);
      assert.equal(entries.find((e) => e.name === 'deeper').type, 'dir');
    });

    await t.test('rename', async () => {
      const moved = await sbx.files.rename(dir + '/sub/b.txt', dir + '/sub/c.txt');
      assert.equal(moved.path, dir + '/sub/c.txt');
      assert.equal(await sbx.files.exists(dir + '/sub/b.txt'), false);
      assert.equal(await sbx.files.read(dir + '/sub/c.txt'), 'bb');
    });

    await t.test('remove', async () => {
      await sbx.files.remove(dir + '/sub/c.txt');
      assert.equal(await sbx.files.exists(dir + '/sub/c.txt'), false);
    });

    await t.test('watchDir reports a created file', async () => {
      await sbx.files.makeDir(dir + '/watched');
      const events = [];
      const handle = await sbx.files.watchDir(dir + '/watched', (ev) => events.push(ev));
      try {
        await sbx.files.write(dir + '/watched/new.txt', 'x');
        await eventually(() => events.some((e) => e.name === 'new.txt'), 'watch event for new.txt');
        const types = events.filter((e) => e.name === 'new.txt').map((e) => e.type);
        assert.ok(types.includes(e2b.FilesystemEventType.CREATE) || types.includes(e2b.FilesystemEventType.WRITE),
          'event types ' + JSON.stringify(types));
      } finally {
        await handle.stop();
      }
    });

    await t.test('signed download URL works without headers; tampered one is refused', async () => {
      const url = await sbx.downloadUrl(dir + '/a.txt');
      const ok = await fetch(url);
      assert.equal(ok.status, 200);
      assert.equal(await ok.text(), 'hello file');
      const bad = new URL(url);
      bad.searchParams.set('path', dir + '/other.txt');
      const refused = await fetch(bad);
      assert.equal(refused.status, 401);
    });
  });
});
