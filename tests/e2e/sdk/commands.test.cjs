'use strict';
const test = require('node:test');
const assert = require('node:assert/strict');
const { e2b, withSandbox } = require('./helpers.cjs');

test('commands', async (t) => {
  await withSandbox(t, { envs: { SANDBOX_WIDE: 'from-create' } }, async (sbx) => {
    await t.test('run: stdout, stderr, exit code 0, streaming callbacks', async () => {
      let streamed = '';
      let streamedErr = '';
      const r = await sbx.commands.run('echo out; echo err >&2', {
        onStdout: (d) => { streamed += d; },
        onStderr: (d) => { streamedErr += d; },
      });
      assert.equal(r.exitCode, 0);
      assert.equal(r.stdout, 'out\n');
      assert.equal(r.stderr, 'err\n');
      assert.equal(streamed, 'out\n');
      assert.equal(streamedErr, 'err\n');
    });

    await t.test('non-zero exit raises CommandExitError', async () => {
      await assert.rejects(sbx.commands.run('echo bad >&2; exit 3'), (e) => {
        assert.ok(e instanceof e2b.CommandExitError, 'got ' + e);
        assert.equal(e.exitCode, 3);
        assert.equal(e.stderr, 'bad\n');
        return true;
      });
    });

    await t.test('envs per command and envVars from create', async () => {
      const r = await sbx.commands.run('echo "$FOO|$SANDBOX_WIDE"', { envs: { FOO: 'bar' } });
      assert.equal(r.stdout, 'bar|from-create\n');
    });

    await t.test('cwd', async () => {
      const r = await sbx.commands.run('pwd', { cwd: '/tmp' });
      assert.equal(r.stdout, '/tmp\n');
    });

    await t.test('default user is "user" with home /home/user; root on request', async () => {
      const r = await sbx.commands.run('whoami; pwd');
      assert.equal(r.stdout, 'user\n/home/user\n');
      const root = await sbx.commands.run('whoami', { user: 'root' });
      assert.equal(root.stdout, 'root\n');
    });

    await t.test('background command with wait()', async () => {
      const h = await sbx.commands.run('sleep 1; echo done', { background: true });
      assert.ok(h.pid > 0);
      const r = await h.wait();
      assert.equal(r.exitCode, 0);
      assert.equal(r.stdout, 'done\n');
    });

    await t.test('background command kill()', async () => {
      const h = await sbx.commands.run('sleep 600', { background: true });
      const listed = await sbx.commands.list();
      assert.ok(listed.some((p) => p.pid === h.pid), 'listed: ' + JSON.stringify(listed));
      assert.equal(await h.kill(), true);
      await assert.rejects(h.wait(), (e) => e instanceof e2b.CommandExitError || /signal|killed/i.test(String(e)));
      const after = await sbx.commands.list();
      assert.ok(!after.some((p) => p.pid === h.pid), 'still listed after kill');
    });

    await t.test('stdin to a background command', async () => {
      const h = await sbx.commands.run('cat', { background: true, stdin: true });
      await sbx.commands.sendStdin(h.pid, 'piped\n');
      await sbx.commands.closeStdin(h.pid);
      const r = await h.wait();
      assert.equal(r.stdout, 'piped\n');
    });
  });
});
