'use strict';
const test = require('node:test');
const assert = require('node:assert/strict');
const { e2b, withSandbox } = require('./helpers.cjs');

test('fork clones files, processes and metadata into independent children', async (t) => {
  await withSandbox(t, { metadata: { suite: 'fork-' + process.pid } }, async (sbx) => {
    await sbx.files.write('/home/user/parent.txt', 'from the parent');
    const bg = await sbx.commands.run('sleep 600', { background: true });

    const results = await sbx.fork({ count: 2, timeoutMs: 120_000 });
    const children = results.filter((r) => !(r instanceof Error));
    t.after(async () => {
      await Promise.all(children.map((c) => c.kill().catch(() => {})));
    });
    assert.equal(results.length, 2, 'results: ' + results);
    assert.equal(children.length, 2, 'errors: ' + results.filter((r) => r instanceof Error));

    const ids = new Set([sbx.sandboxId, ...children.map((c) => c.sandboxId)]);
    assert.equal(ids.size, 3, 'children need their own ids');
    for (const [i, child] of children.entries()) {
      assert.equal(await child.files.read('/home/user/parent.txt'), 'from the parent');
      const procs = await child.commands.list();
      assert.ok(procs.some((p) => p.pid === bg.pid), 'child ' + i + ' lacks the running process');
      await child.files.write('/home/user/child.txt', 'child ' + i);
      const info = await child.getInfo();
      assert.equal(info.state, 'running');
      assert.equal(info.metadata.suite, 'fork-' + process.pid);
    }
    // Children and parent do not share writes.
    assert.equal(await children[0].files.read('/home/user/child.txt'), 'child 0');
    assert.equal(await children[1].files.read('/home/user/child.txt'), 'child 1');
    assert.equal(await sbx.files.exists('/home/user/child.txt'), false);
    // The parent keeps running.
    assert.equal((await sbx.commands.run('echo parent')).stdout, 'parent\n');
  });
});
