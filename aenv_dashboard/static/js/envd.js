// The sandbox's envd, reached as the E2B SDK (>= 2.7) reaches it: same origin as the API,
// routed by the E2b-Sandbox-Id / E2b-Sandbox-Port headers, authenticated by the sandbox's
// envd access token (X-Access-Token, from get_info or connect). No API key is sent: the
// proxy drops it anyway, and envd's calls are not the control plane's.

import { ApiError } from "./api.js";

export const ENVD_PORT = 49983;
const USER = "user";

export function envdHeaders(sandbox, extra = {}) {
  const headers = { "E2b-Sandbox-Id": sandbox.sandboxID, "E2b-Sandbox-Port": String(ENVD_PORT),
    // envd runs the call as this user (the SDK's default)
    Authorization: "Basic " + btoa(USER + ":"), ...extra };
  if (sandbox.envdAccessToken) headers["X-Access-Token"] = sandbox.envdAccessToken;
  return headers;
}

async function failure(resp) {
  let message = `${resp.status} ${resp.statusText}`;
  try {
    const body = await resp.json();
    message = body.message || body.code || message;
  } catch (_) { /* keep the status line */ }
  return new ApiError(resp.status, message);
}

// A Connect unary call (JSON).
export async function rpc(sandbox, method, message, signal) {
  const resp = await fetch("/" + method, { method: "POST", signal,
    headers: envdHeaders(sandbox, { "Content-Type": "application/json", "Connect-Protocol-Version": "1" }),
    body: JSON.stringify(message) });
  if (!resp.ok) throw await failure(resp);
  return resp.json();
}

// Connect's enveloped framing: a flags byte, a big-endian uint32 length, the JSON.
export function envelope(message, flags = 0) {
  const data = new TextEncoder().encode(JSON.stringify(message));
  const out = new Uint8Array(5 + data.length);
  out[0] = flags;
  new DataView(out.buffer).setUint32(1, data.length);
  out.set(data, 5);
  return out;
}

// A Connect server-streaming call over fetch: onMessage gets each message; answers when
// the stream ends (its end-of-stream error thrown as an ApiError).
export async function rpcStream(sandbox, method, message, onMessage, signal) {
  const resp = await fetch("/" + method, { method: "POST", signal,
    headers: envdHeaders(sandbox, { "Content-Type": "application/connect+json", "Connect-Protocol-Version": "1" }),
    body: envelope(message) });
  if (!resp.ok) throw await failure(resp);
  const reader = resp.body.getReader();
  let buf = new Uint8Array(0);
  const decoder = new TextDecoder();
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    const joined = new Uint8Array(buf.length + value.length);
    joined.set(buf);
    joined.set(value, buf.length);
    buf = joined;
    while (buf.length >= 5) {
      const len = new DataView(buf.buffer, buf.byteOffset).getUint32(1);
      if (buf.length < 5 + len) break;
      const flags = buf[0];
      const payload = JSON.parse(decoder.decode(buf.subarray(5, 5 + len)) || "{}");
      buf = buf.slice(5 + len);
      if (flags & 2) {
        if (payload.error) throw new ApiError(500, payload.error.message || payload.error.code);
        return;
      }
      onMessage(payload);
    }
  }
}

export function toBase64(bytes) {
  let s = "";
  for (let i = 0; i < bytes.length; i += 0x8000) s += String.fromCharCode(...bytes.subarray(i, i + 0x8000));
  return btoa(s);
}

export function fromBase64(text) {
  const s = atob(text);
  const out = new Uint8Array(s.length);
  for (let i = 0; i < s.length; i++) out[i] = s.charCodeAt(i);
  return out;
}

// envd's /files: a file's bytes, or an upload (the bytes as application/octet-stream).
export function fileUrl(path) {
  return "/files?" + new URLSearchParams({ path, username: USER }).toString();
}

export async function download(sandbox, path) {
  const resp = await fetch(fileUrl(path), { headers: envdHeaders(sandbox) });
  if (!resp.ok) throw await failure(resp);
  return resp.blob();
}

export async function upload(sandbox, path, file) {
  const resp = await fetch(fileUrl(path), { method: "POST", body: file,
    headers: envdHeaders(sandbox, { "Content-Type": "application/octet-stream" }) });
  if (!resp.ok) throw await failure(resp);
  return resp.json();
}
