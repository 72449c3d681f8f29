// E2B's JS SDK (@e2b/code-interpreter, pinned in package.json), unmodified, against sandcell's
// E2B-compatible gateway, configured by environment variables alone: E2B_API_KEY, E2B_API_URL,
// E2B_SANDBOX_URL, E2B_DOMAIN. One smoke test: a sandbox's code, output, error, files and a
// command, then kill. Exits non-zero on any failure.
import assert from 'node:assert/strict'
import { Sandbox } from '@e2b/code-interpreter'

const sbx = await Sandbox.create({ timeoutMs: 120_000 })
try {
  const stdout = []
  const ex = await sbx.runCode('print("hi")\nx = 40\nx + 2', { onStdout: (m) => stdout.push(m.line) })
  assert.equal(ex.error, undefined)
  assert.equal(ex.text, '42')
  assert.equal(stdout.join(''), 'hi\n')

  const failed = await sbx.runCode('1/0')
  assert.equal(failed.error?.name, 'ZeroDivisionError')
  assert.match(failed.error?.traceback ?? '', /ZeroDivisionError/)

  await sbx.files.write('/home/user/js.txt', 'from js\n')
  assert.equal(await sbx.files.read('/home/user/js.txt'), 'from js\n')
  assert.equal((await sbx.runCode("open('js.txt').read()")).text, "'from js\\n'")

  const cmd = await sbx.commands.run('echo js')
  assert.equal(cmd.stdout, 'js\n')
  assert.equal(cmd.exitCode, 0)
} finally {
  await sbx.kill()
}
assert.equal(await Sandbox.kill(sbx.sandboxId), false)
console.log('E2B JS SDK smoke test against the gateway: ok')
