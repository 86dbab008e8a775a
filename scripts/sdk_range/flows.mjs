// The core flows of the E2B npm SDK, one line per flow: PASS, FAIL (with why) or NONE
// (the installed SDK version has no such call); the JavaScript twin of flows.py, run by
// scripts/sdk_range/run.py --js from a directory where one `e2b` version is installed,
// the E2B_* variables of an aenv server set.
import * as e2b from 'e2b'
import { createRequire } from 'node:module'

const { Sandbox } = e2b
const VERSION = createRequire(import.meta.url)('e2b/package.json').version
class Missing extends Error {}
// the first of ``names`` that ``obj`` has (call it as obj[name](...): methods keep their this)
const need = (obj, ...names) => {
  for (const n of names) if (obj && obj[n] !== undefined) return n
  throw new Missing(names.join('/'))
}
const check = (cond, what) => { if (!cond) throw new Error(`check failed: ${what}`) }
let ok = true
async function flow(name, fn) {
  try {
    await fn()
    console.log(`${VERSION}\t${name}\tPASS`)
    return true
  } catch (e) {
    if (e instanceof Missing) { console.log(`${VERSION}\t${name}\tNONE\tno ${e.message} in this version`); return true }
    console.log(`${VERSION}\t${name}\tFAIL\t${String(e && e.message || e).replace(/\n/g, ' ').slice(0, 300)}`)
    ok = false
    return false
  }
}

let sbx
if (!await flow('create', async () => { sbx = await Sandbox.create({ timeoutMs: 300_000 }) })) process.exit(1)
await flow('commands', async () => {
  const r = await sbx.commands.run('echo $GREETING from $(pwd)', { envs: { GREETING: 'hi' }, cwd: '/tmp' })
  check(r.stdout === 'hi from /tmp\n', r.stdout)
  check((await sbx.commands.run('whoami', { user: 'root' })).stdout === 'root\n', 'root')
})
await flow('background', async () => {
  const h = await sbx.commands.run('sleep 1; echo done', { background: true })
  check((await h.wait()).stdout === 'done\n', 'background output')
})
await flow('pty', async () => {
  const seen = []
  const h = await sbx[need(sbx, 'pty')].create({ cols: 80, rows: 24, onData: (d) => seen.push(Buffer.from(d).toString()) })
  await sbx.pty.sendInput(h.pid, new TextEncoder().encode('echo pty-$((6*7))\nexit\n'))
  await h.wait()
  check(seen.join('').includes('pty-42'), seen.join(''))
})
await flow('files', async () => {
  await sbx.files.write('/tmp/a.txt', 'x')
  check((await sbx.files.read('/tmp/a.txt')) === 'x', 'read')
  check((await sbx.files.list('/tmp')).some((e) => e.name === 'a.txt'), 'list')
})
await flow('batch_write', async () => {
  await sbx.files.write(Array.from({ length: 20 }, (_, i) => ({ path: `/tmp/b/${i}.txt`, data: String(i) })))
  check((await sbx.files.read('/tmp/b/19.txt')) === '19', 'batch')
})
await flow('watch', async () => {
  await sbx.files.makeDir('/tmp/w')
  const events = []
  const w = await sbx.files[need(sbx.files, 'watchDir')]('/tmp/w', (e) => events.push(e))
  await sbx.files.write('/tmp/w/f', '1')
  const deadline = Date.now() + 20_000
  while (!events.length && Date.now() < deadline) await new Promise((r) => setTimeout(r, 200))
  await w.stop()
  check(events.length > 0, 'no event')
})
await flow('pause_connect', async () => {
  await sbx[need(sbx, 'pause', 'betaPause')]()
  const c = await Sandbox.connect(sbx.sandboxId)
  check((await c.commands.run('cat /tmp/a.txt')).stdout === 'x', 'file after connect')
  sbx = c
})
await flow('fork', async () => {
  const kids = await sbx[need(sbx, 'fork')]({ count: 2 })
  try {
    for (const k of kids) { check(!(k instanceof Error), String(k)); check((await k.files.read('/tmp/a.txt')) === 'x', 'kid') }
  } finally {
    for (const k of kids) if (!(k instanceof Error)) await k.kill()
  }
})
await flow('template', async () => {
  const T = e2b[need(e2b, 'Template')]
  const alias = `range-js-${VERSION.replace(/\./g, '-')}`
  const t = T().fromTemplate('base').runCmd('echo built > /built.txt', { user: 'root' })
  const build = need(T, 'build')
  // before 2.10 the alias is an option: build(template, { alias, ... })
  if (T[build].length >= 3) await T[build](t, alias, { cpuCount: 1, memoryMB: 256 })
  else await T[build](t, { alias, cpuCount: 1, memoryMB: 256 })
  const s = await Sandbox.create(alias, { timeoutMs: 120_000 })
  try { check((await s.files.read('/built.txt')) === 'built\n', 'built file') } finally { await s.kill() }
})
await flow('volumes', async () => {
  const V = e2b[need(e2b, 'Volume')]
  const v = await V.create(`range-js-${VERSION.replace(/\./g, '-')}-${Date.now()}`)
  try {
    const s = await Sandbox.create({ timeoutMs: 120_000, volumeMounts: { '/data': v } })
    try {
      await s.files.write('/data/v.txt', 'v')
      check((await s.commands.run('cat /data/v.txt')).stdout === 'v', 'volume file')
    } finally { await s.kill() }
  } finally { await (V.destroy ? V.destroy(v.volumeId) : v.delete()) }
})
await flow('kill', async () => { await sbx.kill() })
process.exit(ok ? 0 : 1)
