'use strict';
const test = require('node:test');
const assert = require('node:assert/strict');
const { e2b, template, withSandbox } = require('./helpers.cjs');

test('sandbox lifecycle', async (t) => {
  await withSandbox(t, { metadata: { suite: 'lifecycle', run: String(process.pid) } }, async (sbx) => {
    await t.test('create is secure by default', async () => {
      assert.match(sbx.sandboxId, /^[a-z0-9]{20}$/);
      // Without the envd access token the proxy refuses envd calls.
      const res = await fetch(process.env.E2B_SANDBOX_URL + '/envs', {
        headers: { 'E2b-Sandbox-Id': sbx.sandboxId, 'E2b-Sandbox-Port': '49983' },
      });
      assert.equal(res.status, 401);
      // /health stays open (isRunning needs it).
      const health = await fetch(process.env.E2B_SANDBOX_URL + '/health', {
        headers: { 'E2b-Sandbox-Id': sbx.sandboxId, 'E2b-Sandbox-Port': '49983' },
      });
      assert.equal(health.status, 204);
      // A different sandbox's token is not accepted by the SDK either.
      const stranger = new e2b.Sandbox({ sandboxId: sbx.sandboxId, envdVersion: '0.6.4', envdAccessToken: 'wrong' });
      await assert.rejects(stranger.commands.run('true'), (e) => e instanceof e2b.AuthenticationError || /unauth|401/i.test(String(e)));
    });

    await t.test('isRunning', async () => {
      assert.equal(await sbx.isRunning(), true);
    });

    await t.test('getInfo reports template, metadata, times and state', async () => {
      const info = await sbx.getInfo();
      assert.equal(info.sandboxId, sbx.sandboxId);
      assert.equal(info.templateId, template);
      assert.equal(info.state, 'running');
      assert.deepEqual(info.metadata, { suite: 'lifecycle', run: String(process.pid) });
      assert.ok(info.startedAt instanceof Date && !isNaN(info.startedAt));
      const ttl = info.endAt - Date.now();
      assert.ok(ttl > 250_000 && ttl <= 300_000, 'endAt in ' + ttl + ' ms');
      assert.ok(info.cpuCount >= 1 && info.memoryMB >= 128);
    });

    await t.test('setTimeout moves endAt both ways', async () => {
      await sbx.setTimeout(600_000);
      let info = await sbx.getInfo();
      let ttl = info.endAt - Date.now();
      assert.ok(ttl > 590_000 && ttl <= 600_000, 'endAt in ' + ttl + ' ms after setTimeout(600s)');
      await sbx.setTimeout(120_000);
      info = await sbx.getInfo();
      ttl = info.endAt - Date.now();
      assert.ok(ttl > 110_000 && ttl <= 120_000, 'endAt in ' + ttl + ' ms after setTimeout(120s)');
    });

    await t.test('getMetrics returns a sample from the guest', async () => {
      const m = await sbx.getMetrics();
      assert.equal(m.length, 1);
      assert.ok(m[0].cpuCount >= 1 && m[0].memTotal > 0 && m[0].diskTotal > 0, JSON.stringify(m));
      assert.ok(m[0].timestamp instanceof Date && !isNaN(m[0].timestamp));
    });

    await t.test('Sandbox.connect to a running sandbox', async () => {
      const again = await e2b.Sandbox.connect(sbx.sandboxId);
      assert.equal(again.sandboxId, sbx.sandboxId);
      const r = await again.commands.run('echo via-connect');
      assert.equal(r.stdout, 'via-connect\n');
      await assert.rejects(e2b.Sandbox.connect('a'.repeat(20)), (e) => e instanceof e2b.SandboxNotFoundError || e instanceof e2b.NotFoundError);
    });

    await t.test('kill, then isRunning is false and the sandbox is gone', async () => {
      const other = await e2b.Sandbox.create(template, { timeoutMs: 120_000 });
      assert.equal(await other.kill(), true);
      assert.equal(await other.isRunning(), false);
      assert.equal(await e2b.Sandbox.kill(other.sandboxId), false);
      await assert.rejects(e2b.Sandbox.getInfo(other.sandboxId), (e) => e instanceof e2b.SandboxNotFoundError || e instanceof e2b.NotFoundError);
    });
  });
});

test('timeout at create kills the sandbox when it runs out', async () => {
  const sbx = await e2b.Sandbox.create(template, { timeoutMs: 5_000 });
  try {
    const info = await sbx.getInfo();
    const ttl = info.endAt - Date.now();
    assert.ok(ttl > 0 && ttl <= 5_000, 'endAt in ' + ttl + ' ms');
    const deadline = Date.now() + 30_000;
    while (Date.now() < deadline && (await sbx.isRunning())) {
      await new Promise((r) => setTimeout(r, 500));
    }
    assert.equal(await sbx.isRunning(), false);
  } finally {
    await sbx.kill().catch(() => {});
  }
});
