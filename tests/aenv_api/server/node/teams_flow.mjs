// Two teams through the e2b npm SDK against `aenv server` (run by
// tests/aenv_api/server/test_sdk_teams.py): team A (KEY_A) creates, lists, pauses,
// connects, forks, snapshots and makes a volume; team B (KEY_B) sees none of it and
// gets "not found" for A's sandbox, snapshot and volume, as for ids that do not exist.
import { NotFoundError, Sandbox, Volume, VolumeNotFoundError } from 'e2b'

const A = { apiKey: process.env.KEY_A }
const B = { apiKey: process.env.KEY_B }
const out = {}

async function refused(fn) {
  try {
    await fn()
    return 'allowed'
  } catch (e) {
    // the SDK maps a 404 to NotFoundError, or (create from a template) to a SandboxError "404: ..."
    return e instanceof NotFoundError || e instanceof VolumeNotFoundError || /^404: /.test(e.message) ? 'not found' : `${e.constructor.name}: ${e.message}`
  }
}

const sbx = await Sandbox.create({ ...A, timeoutMs: 300_000, metadata: { team: 'a' } })
const made = [sbx.sandboxId]
const vol = await Volume.create(`teams-npm-${Date.now()}`, A)
let snap = null
try {
  await sbx.files.write('/home/user/mark', 'from team a')
  out.aLists = (await Sandbox.list({ ...A }).nextItems()).map((s) => s.sandboxId)
  out.bLists = (await Sandbox.list({ ...B }).nextItems()).map((s) => s.sandboxId)
  out.bConnect = await refused(() => Sandbox.connect(sbx.sandboxId, B))
  out.bInfo = await refused(() => Sandbox.getInfo(sbx.sandboxId, B))
  out.bKill = await Sandbox.kill(sbx.sandboxId, B)
  out.bFork = await refused(() => Sandbox.fork(sbx.sandboxId, { ...B, count: 1 }))
  out.bSnapshot = await refused(() => Sandbox.createSnapshot(sbx.sandboxId, B))

  snap = await sbx.createSnapshot(A)
  out.bListsSnapshots = (await Sandbox.listSnapshots(B).nextItems()).map((x) => x.snapshotId)
  try {
    out.bDeletesSnapshot = await Sandbox.deleteSnapshot(snap.snapshotId, B)     // false: no such snapshot
  } catch (e) {
    out.bDeletesSnapshot = e instanceof NotFoundError ? 'not found' : `${e.constructor.name}: ${e.message}`
  }
  out.bFromSnapshot = await refused(() => Sandbox.create(snap.snapshotId, { ...B, timeoutMs: 60_000 }))
  const fromSnap = await Sandbox.create(snap.snapshotId, { ...A, timeoutMs: 300_000 })
  made.push(fromSnap.sandboxId)
  out.aFromSnapshot = await fromSnap.files.read('/home/user/mark')

  const kids = await sbx.fork({ ...A, count: 1 })
  for (const k of kids) if (!(k instanceof Error)) made.push(k.sandboxId)
  out.aForked = kids.length === 1 && !(kids[0] instanceof Error) ? await kids[0].files.read('/home/user/mark') : String(kids[0])

  out.bVolumes = (await Volume.list(B)).map((v) => v.volumeId).includes(vol.volumeId)
  out.aVolumes = (await Volume.list(A)).map((v) => v.volumeId).includes(vol.volumeId)
  out.bVolumeInfo = await refused(() => Volume.getInfo(vol.volumeId, B))

  out.aPaused = await sbx.pause()
  out.bResume = await refused(() => Sandbox.connect(sbx.sandboxId, B))
  const back = await Sandbox.connect(sbx.sandboxId, A)
  out.aResumed = await back.files.read('/home/user/mark')
} finally {
  for (const id of made) await Sandbox.kill(id, A)
  await Volume.destroy(vol.volumeId, A)
  if (snap) out.aDeletesSnapshot = await Sandbox.deleteSnapshot(snap.snapshotId, A)
}
console.log(JSON.stringify(out))
