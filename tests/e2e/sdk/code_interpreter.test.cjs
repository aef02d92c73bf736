'use strict';
// The official @e2b/code-interpreter SDK against the code-interpreter
// template (`aenv setup --templates code-interpreter`, the SDK's default
// template code-interpreter-v1).
const test = require('node:test');
const assert = require('node:assert/strict');
const path = require('node:path');

const { Sandbox } = require(path.join(process.env.E2B_SDK_DIR, 'node_modules', '@e2b', 'code-interpreter'));

const skip = process.env.AENV_CODE_INTERPRETER
  ? false
  : 'the test data dir has no code-interpreter template: `aenv setup --templates code-interpreter`';
if (skip && process.env.CI === 'true') {
  throw new Error(skip);
}
const PNG_MAGIC = Buffer.from([0x89, 0x50, 0x4e, 0x47, 0x0d, 0x0a, 0x1a, 0x0a]);

test('runCode: state, output, results, a chart, errors, a timeout and contexts', { skip }, async (t) => {
  // No template named: the SDK's default.
  const sbx = await Sandbox.create({ timeoutMs: 300_000 });
  t.after(async () => {
    await sbx.kill().catch(() => {});
  });

  await sbx.runCode('x = 41');
  const stdout = [];
  let ex = await sbx.runCode('import sys\nprint("out")\nprint("err", file=sys.stderr)\nx + 1', {
    onStdout: (m) => stdout.push(m.line),
  });
  assert.equal(ex.text, '42');
  assert.deepEqual(ex.logs.stdout, ['out\n']);
  assert.deepEqual(ex.logs.stderr, ['err\n']);
  assert.deepEqual(stdout, ['out\n']);
  assert.ok(ex.executionCount >= 2, 'executionCount ' + ex.executionCount);

  ex = await sbx.runCode('import matplotlib.pyplot as plt\nplt.plot([1, 2, 3], [3, 1, 2])\nplt.show()');
  assert.equal(ex.error, undefined, 'error: ' + JSON.stringify(ex.error));
  const png = ex.results.find((r) => r.png);
  assert.ok(png, 'no PNG among ' + JSON.stringify(ex.results.map((r) => r.formats())));
  assert.ok(Buffer.from(png.png, 'base64').subarray(0, 8).equals(PNG_MAGIC), 'not a PNG');

  ex = await sbx.runCode('import pandas as pd\npd.DataFrame({"a": [1, 2]})');
  assert.ok(ex.results[0].html.includes('<table'), 'DataFrame html');

  ex = await sbx.runCode('def f():\n    raise KeyError("k")\nf()');
  assert.equal(ex.error.name, 'KeyError');
  assert.match(ex.error.traceback, /KeyError/);

  ex = await sbx.runCode('import os\nos.environ["AENV_JS"]', { envs: { AENV_JS: 'set' } });
  assert.equal(ex.text, "'set'");

  const started = Date.now();
  await assert.rejects(sbx.runCode('import time\ntime.sleep(120)', { timeoutMs: 3000 }), (e) => e.name === 'TimeoutError');
  assert.ok(Date.now() - started < 30_000);
  assert.equal((await sbx.runCode('x')).text, '41', 'the context after the timeout');

  ex = await sbx.runCode('echo $((6 * 7))', { language: 'bash' });
  assert.deepEqual(ex.logs.stdout, ['42\n']);

  const ctx = await sbx.createCodeContext({ cwd: '/tmp' });
  assert.equal(ctx.cwd, '/tmp');
  assert.equal(ctx.language, 'python');
  await sbx.runCode('w = 1', { context: ctx });
  assert.equal((await sbx.runCode('import os\n(w, os.getcwd())', { context: ctx })).text, "(1, '/tmp')");
  assert.ok((await sbx.listCodeContexts()).some((c) => c.id === ctx.id));
  await sbx.restartCodeContext(ctx);
  assert.equal((await sbx.runCode("'w' in dir()", { context: ctx })).text, 'False');
  await sbx.removeCodeContext(ctx.id);
  assert.ok(!(await sbx.listCodeContexts()).some((c) => c.id === ctx.id));
});
