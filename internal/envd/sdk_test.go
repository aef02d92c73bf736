package envd

import (
	"context"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// sdkScript drives envd with the official JS SDK (e2b npm package). It is
// only run when E2B_SDK_DIR points at a directory where `npm install e2b`
// was done.
const sdkScript = `
const { Sandbox } = require(process.env.E2B_SDK_DIR + '/node_modules/e2b');
const assert = (c, m) => { if (!c) { throw new Error('assertion failed: ' + m); } };
(async () => {
  const sbx = new Sandbox({ sandboxId: 'sdktest0000000000000', envdVersion: process.env.ENVD_VERSION,
    envdAccessToken: process.env.ENVD_TOKEN, apiKey: 'e2b_0123456789abcdef' });
  const dir = process.env.WORK_DIR;

  let out = '';
  const r = await sbx.commands.run('echo hello; echo err >&2; echo $FOO', { envs: { FOO: 'bar' }, onStdout: (d) => { out += d; } });
  assert(r.exitCode === 0 && r.stdout === 'hello\nbar\n' && r.stderr === 'err\n' && out === r.stdout, 'run: ' + JSON.stringify(r));

  try { await sbx.commands.run('exit 4'); assert(false, 'no CommandExitError'); }
  catch (e) { assert(e.exitCode === 4, 'exit error: ' + e); }

  const bg = await sbx.commands.run('sleep 60', { background: true });
  const procs = await sbx.commands.list();
  assert(procs.some((p) => p.pid === bg.pid), 'list');
  assert(await sbx.commands.kill(bg.pid) === true, 'kill');
  const killed = await bg.wait().then(() => null, (e) => e);
  assert(killed !== null, 'killed process should reject');

  const cat = await sbx.commands.run('cat', { background: true, stdin: true });
  await sbx.commands.sendStdin(cat.pid, 'piped\n');
  await sbx.commands.closeStdin(cat.pid);
  const catRes = await cat.wait();
  assert(catRes.stdout === 'piped\n', 'stdin: ' + JSON.stringify(catRes));

  const info = await sbx.files.write(dir + '/sdk/a.txt', 'content A');
  assert(info.path === dir + '/sdk/a.txt' && info.type === 'file', 'write: ' + JSON.stringify(info));
  assert(await sbx.files.read(dir + '/sdk/a.txt') === 'content A', 'read');
  const many = await sbx.files.write([{ path: dir + '/m/1.txt', data: 'one' }, { path: dir + '/m/2.txt', data: 'two' }]);
  assert(many.length === 2, 'write many');
  const bytes = await sbx.files.read(dir + '/m/2.txt', { format: 'bytes' });
  assert(Buffer.from(bytes).toString() === 'two', 'bytes');
  assert(await sbx.files.exists(dir + '/m/1.txt') === true, 'exists');
  assert(await sbx.files.exists(dir + '/nope') === false, 'exists false');
  try { await sbx.files.read(dir + '/nope'); assert(false, 'read missing'); }
  catch (e) { assert(e.name === 'FileNotFoundError' || e.name === 'NotFoundError', 'read missing error: ' + e.name); }
  const ls = await sbx.files.list(dir + '/m');
  assert(ls.length === 2 && ls[0].type === 'file' && ls[0].size === 3, 'list: ' + JSON.stringify(ls));
  const st = await sbx.files.getInfo(dir + '/m/1.txt');
  assert(st.permissions === '-rw-r--r--' && st.owner === 'root', 'getInfo: ' + JSON.stringify(st));
  assert(await sbx.files.makeDir(dir + '/newdir') === true, 'makeDir');
  assert(await sbx.files.makeDir(dir + '/newdir') === false, 'makeDir again');
  const mv = await sbx.files.rename(dir + '/m/1.txt', dir + '/m/3.txt');
  assert(mv.path === dir + '/m/3.txt', 'rename');
  await sbx.files.remove(dir + '/m/3.txt');
  assert(await sbx.files.exists(dir + '/m/3.txt') === false, 'remove');

  const events = [];
  const h = await sbx.files.watchDir(dir, (ev) => events.push(ev), { recursive: true });
  await sbx.files.write(dir + '/newdir/w.txt', 'x');
  for (let i = 0; i < 50 && !events.some((e) => e.name === 'newdir/w.txt'); i++) { await new Promise((r) => setTimeout(r, 100)); }
  await h.stop();
  assert(events.some((e) => e.name === 'newdir/w.txt'), 'watch: ' + JSON.stringify(events));

  const url = await sbx.downloadUrl(dir + '/sdk/a.txt');
  const res = await fetch(url);
  assert(res.status === 200 && (await res.text()) === 'content A', 'signed download ' + res.status);

  let ptyOut = '';
  const term = await sbx.pty.create({ cols: 80, rows: 24, onData: (d) => { ptyOut += Buffer.from(d).toString(); } });
  await sbx.pty.sendInput(term.pid, Buffer.from('echo size=$(stty size); exit 0\n'));
  await term.wait();
  assert(ptyOut.includes('size=24 80'), 'pty: ' + JSON.stringify(ptyOut));

  const mdInfo = await sbx.files.write(dir + '/md.txt', 'x', { metadata: { Project: 'demo' } });
  assert(mdInfo.metadata && mdInfo.metadata.project === 'demo', 'write metadata: ' + JSON.stringify(mdInfo));
  const gi = await sbx.files.getInfo(dir + '/md.txt');
  assert(gi.metadata && gi.metadata.project === 'demo', 'getInfo metadata: ' + JSON.stringify(gi));
  await sbx.files.write(dir + '/gz.txt', 'gzipped text', { gzip: true });
  assert(await sbx.files.read(dir + '/gz.txt', { gzip: true }) === 'gzipped text', 'gzip round trip');
  const streamed = await sbx.files.read(dir + '/gz.txt', { format: 'stream' });
  let sdata = '';
  for await (const chunk of streamed) { sdata += Buffer.from(chunk).toString(); }
  assert(sdata === 'gzipped text', 'stream read');

  const evs2 = [];
  const h2 = await sbx.files.watchDir(dir, (ev) => evs2.push(ev), { includeEntry: true });
  await sbx.files.write(dir + '/inc.txt', 'abc');
  for (let i = 0; i < 50 && !evs2.some((e) => e.name === 'inc.txt' && e.entry); i++) { await new Promise((r) => setTimeout(r, 100)); }
  await h2.stop();
  assert(evs2.some((e) => e.name === 'inc.txt' && e.entry && e.entry.path === dir + '/inc.txt'), 'watch includeEntry: ' + JSON.stringify(evs2));

  const root = await sbx.commands.run('whoami', { user: 'root' });
  assert(root.stdout === 'root\n', 'user root');
  const up = await sbx.uploadUrl(dir + '/viaurl.txt');
  const form = new FormData();
  form.append('file', new Blob(['posted']), 'viaurl.txt');
  const upRes = await fetch(up, { method: 'POST', body: form });
  assert(upRes.status === 200, 'signed upload ' + upRes.status);
  assert(await sbx.files.read(dir + '/viaurl.txt') === 'posted', 'signed upload content');

  assert(await sbx.isRunning() === true, 'isRunning');
  console.log('SDK-OK');
})().catch((e) => { console.error('SDK-FAIL', e); process.exit(1); });
`

func TestOfficialJSSDK(t *testing.T) {
	sdk := os.Getenv("E2B_SDK_DIR")
	if sdk == "" {
		t.Skip("set E2B_SDK_DIR to a directory with node_modules/e2b to run")
	}
	node, err := exec.LookPath("node")
	if err != nil {
		t.Skip("node not installed")
	}
	s, err := NewServer(Config{AccessToken: "sdk-token", Version: "0.6.4"})
	if err != nil {
		t.Fatal(err)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- s.Serve(ctx, ln) }()
	defer func() { cancel(); <-done }()

	script := filepath.Join(t.TempDir(), "sdk.cjs")
	if err := os.WriteFile(script, []byte(sdkScript), 0o644); err != nil {
		t.Fatal(err)
	}
	cctx, ccancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer ccancel()
	cmd := exec.CommandContext(cctx, node, script)
	cmd.Env = append(os.Environ(),
		"E2B_SANDBOX_URL=http://"+ln.Addr().String(),
		"E2B_DOMAIN=localhost",
		"ENVD_VERSION=0.6.4",
		"ENVD_TOKEN=sdk-token",
		"WORK_DIR="+t.TempDir(),
	)
	out, err := cmd.CombinedOutput()
	if err != nil || !strings.Contains(string(out), "SDK-OK") {
		t.Fatalf("SDK run failed: %v\n%s", err, out)
	}
}
