// The e2b npm SDK's Template API against `aenv server` (run by
// tests/aenv_vm/builds/test_sdk_node.py): build from base with RUN, ENV, WORKDIR, COPY,
// USER and a start + ready command, exists, tags, create from it, check, delete.
import { Template, Sandbox, waitForPort } from 'e2b'
import { mkdtempSync, rmSync, writeFileSync } from 'node:fs'
import { tmpdir } from 'node:os'
import { join } from 'node:path'

const ctx = mkdtempSync(join(tmpdir(), 'aenv-npm-ctx-'))
process.on('exit', () => rmSync(ctx, { recursive: true, force: true }))
writeFileSync(join(ctx, 'data.txt'), 'from npm copy\n')
const logs = []
const template = Template({ fileContextPath: ctx })
  .fromTemplate('base')
  .setUser('root')
  .runCmd('echo npm-built > /opt/npm.txt')
  .setUser('user')
  .setEnvs({ NPM_VAR: 'yes' })
  .setWorkdir('/home/user/npm')
  .copy('data.txt', '/home/user/npm/')
  .setStartCmd('python3 -m http.server 8081', waitForPort(8081))

const info = await Template.build(template, 'npm-app', { onBuildLogs: (e) => logs.push(e.message) })
const exists = await Template.exists('npm-app')
const missing = await Template.exists('npm-missing')
const tagged = await Template.assignTags('npm-app', ['stable'])
const tags = (await Template.getTags('npm-app')).map((t) => t.tag).sort()
const sbx = await Sandbox.create('npm-app:stable')
const r = await sbx.commands.run('pwd; echo $NPM_VAR; cat data.txt /opt/npm.txt; ps -eo args | grep "[h]ttp.server 8081"')
await sbx.kill()
const again = []
await Template.build(template, 'npm-app', { onBuildLogs: (e) => again.push(e.message) })
console.log(JSON.stringify({
  templateId: info.templateId, exists, missing, tags, taggedBuild: tagged.buildId,
  stdout: r.stdout, steps: logs.filter((l) => l.startsWith('[')).length,
  cachedAgain: again.filter((l) => l.startsWith('CACHED')).length,
}))
