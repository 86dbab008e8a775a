// The `unit` project of the checkout's packages/js-sdk/vitest.config.mts (no
// browser, template, connectionConfig or cloudflare projects, so neither
// playwright nor wrangler is needed), split in two, with test files run one at
// a time. Copied next to the checkout's src/ and tests/ by
// scripts/e2b_js_conformance.sh.
//
//   aenv     the tests that talk to a server: they run against aenv, through
//            E2B_API_KEY / E2B_API_URL / E2B_SANDBOX_URL.
//   offline  the tests that talk to no server: those that mock the API with msw
//            (their handlers match `https://api.${E2B_DOMAIN || 'e2b.app'}`) and
//            those that only build SDK objects and check the URLs derived from
//            a domain. They assume the API and sandbox URLs are the defaults,
//            as in E2B's own CI, so they run with E2B_API_URL, E2B_SANDBOX_URL
//            and E2B_DOMAIN unset (offline.setup.ts); they test the SDK alone.
import { readFileSync, readdirSync, writeFileSync } from 'node:fs'
import path from 'node:path'
import { defineConfig } from 'vitest/config'

const excluded = [/^tests\/runtimes\//, /^tests\/template\//, /^tests\/connectionConfig\.test\.ts$/]

// Tests that send traffic to the public internet, from the sandbox (curl to
// 1.1.1.1, 8.8.8.8, connectivitycheck.gstatic.com) or to a sandbox of E2B's
// own `httpbin` template: this machine reaches no public address and sends it
// no traffic, so they are left out unless AENV_JS_CONFORMANCE_PUBLIC=1.
const publicFiles = ['tests/sandbox/internetAccess.test.ts']
const publicTests = [
  // tests/sandbox/network.test.ts
  'allow specific IP with deny all traffic',
  'deny specific IP address',
  'deny all traffic using allTraffic selector',
  'allow takes precedence over deny',
  'injected header is reflected by the httpbin sidecar',
  'denies a previously reachable IP after update',
  'omitting fields replaces all egress rules',
]
// Tests that fetch https://${sandbox.getHost(port)} from the host: they run
// when the script serves the host names over TLS on port 443 (it sets
// AENV_JS_CONFORMANCE_HOSTS=1; see resolve-local.cjs), else they are left out
// (they would look the E2B cloud's names up in the public DNS).
const hostTests = [
  'ping server in running sandbox', // host.test.ts
  'ping server in non-running sandbox', // host.test.ts
  'pause and resume a sandbox with http server', // snapshot.test.ts
  'auto-resume wakes paused sandbox on http request', // lifecyclePayload.test.ts
  'sandbox requires traffic access token', // network.test.ts
  'sandbox works without token', // network.test.ts
  'verify maskRequestHost modifies Host header correctly', // network.test.ts
]
const withPublic = process.env.AENV_JS_CONFORMANCE_PUBLIC === '1'
const withHosts = withPublic || process.env.AENV_JS_CONFORMANCE_HOSTS === '1'
const leftOut = [...(withPublic ? [] : publicTests), ...(withHosts ? [] : hostTests)]
const escape = (s: string) => s.replace(/[.*+?^${}()|[\]\\]/g, '\\$&')

function testFiles(dir: string): string[] {
  return readdirSync(dir, { withFileTypes: true }).flatMap((e) => {
    const p = path.posix.join(dir, e.name)
    if (e.isDirectory()) return testFiles(p)
    return e.name.endsWith('.test.ts') && !excluded.some((re) => re.test(p)) ? [p] : []
  })
}

function isOffline(file: string): boolean {
  const src = readFileSync(file, 'utf8')
  if (/from '(msw|msw\/node)'/.test(src)) return true
  return !/\bsandboxTest\b/.test(src) && !/\bSandbox\.(create|connect|list|kill|betaCreate)\(/.test(src)
}

const files = testFiles('tests').filter((f) => withPublic || !publicFiles.includes(f))
const offline = files.filter(isOffline)
const live = files.filter((f) => !offline.includes(f))

const common = {
  isolate: true,
  globals: false,
  testTimeout: 30_000,
  environment: 'node' as const,
  bail: 0,
  deps: { interopDefault: true },
  env: { ...(process.env as Record<string, string>) },
}

// For the totals of scripts/e2b_js_conformance.sh.
if (process.env.AENV_JS_CONFORMANCE_OFFLINE_LIST) {
  writeFileSync(process.env.AENV_JS_CONFORMANCE_OFFLINE_LIST, offline.join('\n') + '\n')
}

export default defineConfig({
  test: {
    // Other VMs share this machine's CPUs: one test file at a time.
    fileParallelism: false,
    ...(leftOut.length
      ? { testNamePattern: new RegExp(`^(?!.*(?:${leftOut.map(escape).join('|')})$)`) }
      : {}),
    maxWorkers: 1,
    reporters: ['default', 'junit'],
    outputFile: { junit: process.env.AENV_JS_CONFORMANCE_REPORT || 'report.xml' },
    projects: [
      {
        test: {
          ...common,
          name: 'aenv',
          include: live,
          setupFiles: ['tests/globalFetchFallback.setup.ts'],
        },
      },
      {
        test: {
          ...common,
          name: 'offline',
          include: offline,
          env: Object.fromEntries(
            Object.entries(common.env).filter(([k]) => !['E2B_API_URL', 'E2B_SANDBOX_URL', 'E2B_DOMAIN'].includes(k))
          ),
          setupFiles: ['offline.setup.ts', 'tests/globalFetchFallback.setup.ts'],
        },
      },
    ],
  },
})
