// The e2b npm SDK's Volume against `aenv server` (run by tests/aenv_vm/volumes/test_volume_node.py):
// create, content round trip (a 4 MiB stream too), list with depth, metadata, errors, destroy.
import { Volume, VolumeError, VolumePathNotFoundError, AuthenticationError } from 'e2b'

const out = {}
const vol = await Volume.create(`node-${Date.now()}`)
try {
  out.listed = (await Volume.list()).some((v) => v.volumeId === vol.volumeId)
  const info = await Volume.getInfo(vol.volumeId)
  out.sameToken = info.token === vol.token
  const st = await vol.writeFile('/a/b/hello.txt', 'hello from node', { force: true, mode: 0o640 })
  out.written = { path: st.path, size: st.size, mode: st.mode, type: st.type }
  out.text = await vol.readFile('/a/b/hello.txt')
  const big = new Uint8Array(4 << 20).map((_, i) => i % 251)
  const stream = new ReadableStream({
    start(c) { for (let i = 0; i < big.length; i += 1 << 20) c.enqueue(big.slice(i, i + (1 << 20))); c.close() },
  })
  out.bigSize = (await vol.writeFile('/big.bin', stream)).size
  const back = await vol.readFile('/big.bin', { format: 'bytes' })
  out.bigSame = back.length === big.length && back.every((b, i) => b === big[i])
  await vol.makeDir('/d/e', { force: true })
  out.listing = (await vol.list('/', { depth: 3 })).map((e) => e.path).sort()
  out.mode = (await vol.updateMetadata('/a/b/hello.txt', { mode: 0o600 })).mode
  out.exists = [await vol.exists('/d/e'), await vol.exists('/nope')]
  try { await vol.writeFile('/a/b/hello.txt', 'again') } catch (e) { out.noForce = e instanceof VolumeError }
  try { await vol.readFile('/nope') } catch (e) { out.missing = e instanceof VolumePathNotFoundError }
  try {
    await new Volume(vol.volumeId, vol.name, 'wrong-token').readFile('/a/b/hello.txt')
  } catch (e) { out.wrongToken = e instanceof AuthenticationError }
  await vol.remove('/a')
  out.removed = !(await vol.exists('/a'))
} finally {
  out.destroyed = await Volume.destroy(vol.volumeId)
}
console.log(JSON.stringify(out))
