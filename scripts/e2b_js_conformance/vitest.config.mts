// The `unit` project of the checkout's packages/js-sdk/vitest.config.mts, alone
// (no browser, template, connectionConfig or cloudflare projects, so neither
// playwright nor wrangler is needed), with test files run one at a time.
// Copied next to the checkout's src/ and tests/ by scripts/e2b_js_conformance.sh.
import { defineConfig } from 'vitest/config'

export default defineConfig({
  test: {
    name: 'unit',
    include: ['tests/**/*.test.ts'],
    exclude: [
      'tests/runtimes/**',
      'tests/template/**',
      'tests/connectionConfig.test.ts',
    ],
    isolate: true,
    globals: false,
    testTimeout: 30_000,
    environment: 'node',
    bail: 0,
    setupFiles: ['tests/globalFetchFallback.setup.ts'],
    deps: { interopDefault: true },
    env: { ...(process.env as Record<string, string>) },
    // Other VMs share this machine's CPUs: one test file at a time.
    fileParallelism: false,
    maxWorkers: 1,
    reporters: ['default', 'junit'],
    outputFile: { junit: process.env.AENV_JS_CONFORMANCE_REPORT || 'report.xml' },
  },
})
