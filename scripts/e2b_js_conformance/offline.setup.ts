// The `offline` project's tests (vitest.config.mts) mock or derive the E2B URLs
// from the domain, as in E2B's CI: aenv's URL overrides would bypass them.
delete process.env.E2B_API_URL
delete process.env.E2B_SANDBOX_URL
delete process.env.E2B_DOMAIN
