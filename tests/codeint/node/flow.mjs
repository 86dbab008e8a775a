// The core code-interpreter flow with the @e2b/code-interpreter npm SDK, configured only
// by E2B_API_KEY / E2B_API_URL / E2B_SANDBOX_URL: state between cells, stdout callbacks,
// results, errors, contexts, bash, envs, a timeout that interrupts.
// Prints one JSON line of results; any failed check throws (non-zero exit).
import { Sandbox } from '@e2b/code-interpreter'

function check(cond, what) {
  if (!cond) throw new Error(`check failed: ${what}`)
}

const out = {}
const sbx = await Sandbox.create({ timeoutMs: 600_000 })
try {
  await sbx.runCode('x = 1')
  const two = await sbx.runCode('x + 1')
  check(two.text === '2' && two.results[0].isMainResult, `x + 1 gave ${JSON.stringify(two)}`)
  const seen = []
  const printed = await sbx.runCode('print("a"); import sys; print("b", file=sys.stderr)', {
    onStdout: (m) => seen.push(['out', m.line]), onStderr: (m) => seen.push(['err', m.line]),
  })
  check(JSON.stringify(printed.logs.stdout) === '["a\\n"]' && JSON.stringify(printed.logs.stderr) === '["b\\n"]',
    `logs ${JSON.stringify(printed.logs)}`)
  check(JSON.stringify(seen) === '[["out","a\\n"],["err","b\\n"]]', `callbacks ${JSON.stringify(seen)}`)
  const err = await sbx.runCode('1 / 0')
  check(err.error && err.error.name === 'ZeroDivisionError' && err.error.traceback.includes('1 / 0'),
    `error ${JSON.stringify(err.error)}`)
  const df = await sbx.runCode("import pandas as pd\npd.DataFrame({'a': [1, 2]})")
  check(df.results[0].html.includes('<table') && JSON.stringify(df.results[0].data) === '{"a":[1,2]}',
    `dataframe ${JSON.stringify(df.results[0])}`)
  const ctx = await sbx.createCodeContext({ cwd: '/tmp' })
  check(ctx.cwd === '/tmp' && ctx.language === 'python', `context ${JSON.stringify(ctx)}`)
  const cwd = await sbx.runCode('import os; os.getcwd()', { context: ctx })
  check(cwd.text === '/tmp', `cwd ${cwd.text}`)
  const isolated = await sbx.runCode('x', { context: ctx })
  check(isolated.error && isolated.error.name === 'NameError', 'contexts share variables')
  check((await sbx.listCodeContexts()).some((c) => c.id === ctx.id), 'context not listed')
  await sbx.removeCodeContext(ctx)
  check(!(await sbx.listCodeContexts()).some((c) => c.id === ctx.id), 'context still listed')
  const bash = await sbx.runCode('echo $((6 * 7)) $GREETING', { language: 'bash', envs: { GREETING: 'hi' } })
  check(JSON.stringify(bash.logs.stdout) === '["42 hi\\n"]', `bash ${JSON.stringify(bash.logs)}`)
  let timedOut = false
  const t0 = Date.now()
  try {
    await sbx.runCode('import time; time.sleep(60)', { timeoutMs: 2000 })
  } catch (e) {
    timedOut = true
    out.timeoutError = e.name
  }
  check(timedOut && Date.now() - t0 < 20_000, 'timeout did not end the call')
  const after = await sbx.runCode('x')
  check(after.text === '1', `after the timeout: ${JSON.stringify(after)}`)
  out.ok = true
} finally {
  await sbx.kill()
}
console.log(JSON.stringify(out))
