'use strict';
const test = require('node:test');
const assert = require('node:assert/strict');
const fs = require('node:fs');
const os = require('node:os');
const path = require('node:path');
const { e2b } = require('./helpers.cjs');

// Template.build against the node: steps from a local template, a COPY of
// a local file, start and ready commands; then a sandbox of the result, and
// a rebuild that reuses the cached layers.
test('template build', async (t) => {
  const ctx = fs.mkdtempSync(path.join(os.tmpdir(), 'aenv-tpl-'));
  fs.writeFileSync(path.join(ctx, 'app.txt'), 'copied from the client\n');
  const name = 'sdk-built-' + Date.now().toString(36);
  const logs = [];
  const tpl = e2b.Template({ fileContextPath: ctx })
    .fromTemplate('base')
    .setEnvs({ GREETING: 'hello-from-build' })
    .setWorkdir('/app')
    .runCmd('echo "$GREETING" > greeting.txt')
    .copy('app.txt', '/app/app.txt')
    .setStartCmd('echo up > /tmp/up; exec sleep 100000', 'test -f /tmp/up');
  const info = await e2b.Template.build(tpl, name, { onBuildLogs: (l) => logs.push(String(l.message)) });
  assert.equal(info.name, name);
  assert.ok(logs.some((m) => m.includes('Uploaded')), 'the COPY source was uploaded: ' + logs.join(' | '));

  const sbx = await e2b.Sandbox.create(name, { timeoutMs: 120_000 });
  t.after(async () => { await sbx.kill().catch(() => {}); });
  const r = await sbx.commands.run('cat /app/greeting.txt /app/app.txt /tmp/up; echo $GREETING');
  assert.equal(r.stdout, 'hello-from-build\ncopied from the client\nup\nhello-from-build\n');

  // The same template again: every layer and the upload come from cache.
  const logs2 = [];
  await e2b.Template.build(tpl, name, { onBuildLogs: (l) => logs2.push(String(l.message)) });
  assert.ok(logs2.some((m) => m.includes('CACHED')), 'rebuild reused layers: ' + logs2.join(' | '));
  assert.ok(logs2.some((m) => m.includes('Skipping upload')), 'rebuild skipped the upload');

  // A failing step fails the build with the step's output.
  const bad = e2b.Template().fromTemplate('minimal').runCmd('echo going wrong; exit 7');
  await assert.rejects(e2b.Template.build(bad, name + '-bad'), (e) => {
    assert.ok(e instanceof e2b.BuildError, 'got ' + e);
    assert.match(String(e.message), /exited with code 7/);
    return true;
  });
});
