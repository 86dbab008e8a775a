// The core flow with the e2b npm SDK, configured only by E2B_API_KEY / E2B_API_URL /
// E2B_SANDBOX_URL: create (with network rules and a traffic token), run, write/read a
// file, getInfo and updateNetwork, pause, resume (connect), kill.
// Prints one JSON line of results; any failed step throws (non-zero exit).
import { Sandbox } from 'e2b'

function check(cond, what) {
  if (!cond) throw new Error(`check failed: ${what}`)
}

const out = {}
const sbx = await Sandbox.create({
  metadata: { suite: 'node' }, envs: { AENV_NODE: 'from-js' }, timeoutMs: 600_000,
  network: { allowOut: ['Example.com', '198.51.100.7/32'], denyOut: ['203.0.113.0/24'], allowPublicTraffic: false },
})
out.sandboxId = sbx.sandboxId
out.trafficAccessToken = sbx.trafficAccessToken
try {
  const net = (await sbx.getInfo()).network
  check(JSON.stringify(net.allowOut) === '["198.51.100.7","example.com"]', `allowOut ${JSON.stringify(net)}`)
  check(JSON.stringify(net.denyOut) === '["203.0.113.0/24"]' && net.allowPublicTraffic === false,
    `network ${JSON.stringify(net)}`)
  await sbx.updateNetwork({ allowOut: ['pypi.org'], allowInternetAccess: false })
  const after = (await Sandbox.getInfo(sbx.sandboxId)).network
  check(JSON.stringify(after.allowOut) === '["pypi.org"]' && JSON.stringify(after.denyOut) === '["0.0.0.0/0"]',
    `after updateNetwork ${JSON.stringify(after)}`)
  out.networkUpdated = true
  const r = await sbx.commands.run('echo $AENV_NODE; hostname')
  const lines = r.stdout.trim().split('\n')
  check(lines[0] === 'from-js', `env var, got ${JSON.stringify(r.stdout)}`)
  check(lines[1] === sbx.sandboxId, `hostname, got ${lines[1]}`)
  const streamed = []
  await sbx.commands.run('echo a; sleep 0.5; echo b', { onStdout: (d) => streamed.push(d.trim()) })
  check(streamed.join(',') === 'a,b', `stream ${streamed}`)
  await sbx.files.write('/home/user/node.txt', 'written by node')
  check((await sbx.files.read('/home/user/node.txt')) === 'written by node', 'file round trip')
  const listed = await Sandbox.list({ query: { metadata: { suite: 'node' } } }).nextItems()
  check(listed.length === 1 && listed[0].sandboxId === sbx.sandboxId, `list ${JSON.stringify(listed)}`)
  const bg = await sbx.commands.run('sleep 1000', { background: true })
  await sbx.pause()
  const info = await Sandbox.getInfo(sbx.sandboxId)
  check(info.state === 'paused', `state after pause: ${info.state}`)
  const again = await Sandbox.connect(sbx.sandboxId)
  check((await again.files.read('/home/user/node.txt')) === 'written by node', 'file after resume')
  const ps = await again.commands.run('ps -eo pid,args')
  check(ps.stdout.includes(String(bg.pid)), 'process survived the pause')
  check((await Sandbox.getInfo(sbx.sandboxId)).state === 'running', 'running after connect')
  out.resumed = true
} finally {
  await Sandbox.kill(sbx.sandboxId)
}
const after = await Sandbox.list({ query: { metadata: { suite: 'node' } } }).nextItems()
check(after.length === 0, 'listed after kill')
out.killed = true
console.log(JSON.stringify(out))
