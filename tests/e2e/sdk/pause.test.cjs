'use strict';
const test = require('node:test');
const assert = require('node:assert/strict');
const { e2b, withSandbox } = require('./helpers.cjs');

test('pause, then Sandbox.connect resumes where it stopped', async (t) => {
  await withSandbox(t, { metadata: { suite: 'pause-' + process.pid } }, async (sbx) => {
    await sbx.files.write('/home/user/kept.txt', 'kept across pause');
    const bg = await sbx.commands.run('sleep 600', { background: true });

    await t.test('pause', async () => {
      assert.equal(await sbx.pause(), true);
      assert.equal(await sbx.isRunning(), false);
      const info = await sbx.getInfo();
      assert.equal(info.state, 'paused');
      const paused = [];
      const p = e2b.Sandbox.list({ query: { metadata: { suite: 'pause-' + process.pid }, state: ['paused'] } });
      while (p.hasNext) paused.push(...(await p.nextItems()));
      assert.deepEqual(paused.map((s) => s.sandboxId), [sbx.sandboxId]);
    });

    await t.test('pausing again reports false', async () => {
      assert.equal(await sbx.pause(), false);
    });

    await t.test('connect resumes with files and processes intact', async () => {
      const again = await e2b.Sandbox.connect(sbx.sandboxId, { timeoutMs: 120_000 });
      assert.equal(await again.isRunning(), true);
      assert.equal((await again.getInfo()).state, 'running');
      assert.equal(await again.files.read('/home/user/kept.txt'), 'kept across pause');
      const procs = await again.commands.list();
      assert.ok(procs.some((p) => p.pid === bg.pid), 'background process survived: ' + JSON.stringify(procs));
      const r = await again.commands.run('echo resumed');
      assert.equal(r.stdout, 'resumed\n');
      const ttl = (await again.getInfo()).endAt - Date.now();
      assert.ok(ttl > 100_000 && ttl <= 120_000, 'endAt in ' + ttl + ' ms');
    });
  });
});
