'use strict';
const test = require('node:test');
const assert = require('node:assert/strict');
const { e2b, template } = require('./helpers.cjs');

async function collect(paginator) {
  const pages = [];
  while (paginator.hasNext) {
    pages.push(await paginator.nextItems());
  }
  return pages;
}

test('Sandbox.list with metadata filter and paging', async (t) => {
  const tag = 'list-' + process.pid + '-' + Date.now();
  const created = await Promise.all([0, 1, 2].map((i) =>
    e2b.Sandbox.create(template, { timeoutMs: 300_000, metadata: { tag, idx: String(i) } })));
  t.after(async () => {
    await Promise.all(created.map((s) => s.kill().catch(() => {})));
  });
  const ids = created.map((s) => s.sandboxId).sort();

  await t.test('metadata filter finds exactly ours', async () => {
    const pages = await collect(e2b.Sandbox.list({ query: { metadata: { tag } } }));
    const got = pages.flat();
    assert.deepEqual(got.map((s) => s.sandboxId).sort(), ids);
    for (const s of got) {
      assert.equal(s.state, 'running');
      assert.equal(s.metadata.tag, tag);
      assert.equal(s.templateId, template);
      assert.ok(s.endAt > s.startedAt);
    }
  });

  await t.test('two-key filter narrows to one', async () => {
    const pages = await collect(e2b.Sandbox.list({ query: { metadata: { tag, idx: '1' } } }));
    assert.deepEqual(pages.flat().map((s) => s.sandboxId), [created[1].sandboxId]);
  });

  await t.test('paging with limit 2 returns every sandbox once', async () => {
    const pages = await collect(e2b.Sandbox.list({ limit: 2, query: { metadata: { tag } } }));
    assert.equal(pages.length, 2, 'pages: ' + JSON.stringify(pages.map((p) => p.length)));
    assert.equal(pages[0].length, 2);
    assert.equal(pages[1].length, 1);
    assert.deepEqual(pages.flat().map((s) => s.sandboxId).sort(), ids);
  });

  await t.test('state filter', async () => {
    const running = await collect(e2b.Sandbox.list({ query: { metadata: { tag }, state: ['running'] } }));
    assert.equal(running.flat().length, 3);
    const paused = await collect(e2b.Sandbox.list({ query: { metadata: { tag }, state: ['paused'] } }));
    assert.equal(paused.flat().length, 0);
  });

  await t.test('filter values with special characters', async () => {
    const odd = 'a b/c&d=e%+é';
    const s = await e2b.Sandbox.create(template, { timeoutMs: 120_000, metadata: { tag: tag + '-odd', 'k y': odd } });
    t.after(async () => { await s.kill().catch(() => {}); });
    const pages = await collect(e2b.Sandbox.list({ query: { metadata: { 'k y': odd } } }));
    assert.deepEqual(pages.flat().map((x) => x.sandboxId), [s.sandboxId]);
    assert.equal(pages.flat()[0].metadata['k y'], odd);
  });

  await t.test('unmatched filter is empty', async () => {
    const pages = await collect(e2b.Sandbox.list({ query: { metadata: { tag: tag + '-nope' } } }));
    assert.equal(pages.flat().length, 0);
  });
});
