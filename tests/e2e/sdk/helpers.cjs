// Shared setup for the SDK compatibility tests. The Go harness
// (tests/e2e/sdk_test.go) starts `aenv server`, installs e2b@2.51.0 and runs
// `node --test` on these files with E2B_API_URL, E2B_SANDBOX_URL,
// E2B_API_KEY and E2B_SDK_DIR set.
'use strict';
const path = require('node:path');

const sdkDir = process.env.E2B_SDK_DIR;
if (!sdkDir) {
  throw new Error('E2B_SDK_DIR is not set: run these tests through `go test ./tests/e2e`');
}
const e2b = require(path.join(sdkDir, 'node_modules', 'e2b'));

const template = process.env.AENV_TEST_TEMPLATE || 'base';

// Every sandbox a test creates is killed afterwards even when the test fails.
async function withSandbox(t, opts, fn) {
  const sbx = await e2b.Sandbox.create(template, { timeoutMs: 300_000, ...opts });
  t.after(async () => {
    await sbx.kill().catch(() => {});
  });
  return fn(sbx);
}

async function eventually(cond, what, ms = 10_000) {
  const deadline = Date.now() + ms;
  while (Date.now() < deadline) {
    if (await cond()) return;
    await new Promise((r) => setTimeout(r, 100));
  }
  throw new Error('timed out waiting for ' + what);
}

module.exports = { e2b, template, withSandbox, eventually };
