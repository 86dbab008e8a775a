// Preloaded (NODE_OPTIONS=--require) by scripts/e2b_js_conformance.sh when the
// server serves host names over TLS: the names under the server's domain
// (AENV_JS_CONFORMANCE_LOCAL_DOMAIN, e.g. 8000-<sandboxID>.aenv.test, which
// sandbox.getHost() gives) resolve to 127.0.0.1 in the test processes, so the
// tests' fetch(`https://${sandbox.getHost(port)}`) reaches the local server
// and no DNS is asked.
const dns = require('node:dns')

const domain = process.env.AENV_JS_CONFORMANCE_LOCAL_DOMAIN
if (domain) {
  const suffix = '.' + domain
  const lookup = dns.lookup
  dns.lookup = function (hostname, options, callback) {
    if (typeof hostname === 'string' && (hostname === domain || hostname.endsWith(suffix))) {
      if (typeof options === 'function') {
        callback = options
        options = {}
      }
      if (typeof options === 'number') options = { family: options }
      if (options && options.all) {
        process.nextTick(callback, null, [{ address: '127.0.0.1', family: 4 }])
      } else {
        process.nextTick(callback, null, '127.0.0.1', 4)
      }
      return {}
    }
    return lookup.apply(this, arguments)
  }
}
