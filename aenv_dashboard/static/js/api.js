// The dashboard's one way to the API: the same HTTP API the SDKs use, with the key the
// user typed (X-API-Key), kept in sessionStorage (gone with the tab). A 401 forgets the
// key and returns to the login; any other error is thrown with the API's own message.

const KEY = "aenv.apiKey";

export class ApiError extends Error {
  constructor(status, message, body) {
    super(message);
    this.status = status;
    this.body = body;
  }
}

export const apiKey = () => sessionStorage.getItem(KEY);
export const setApiKey = (key) => sessionStorage.setItem(KEY, key);
export const forgetApiKey = () => sessionStorage.removeItem(KEY);

// Turns a query object into a query string; array values repeat the name (state=a&state=b).
export function queryString(query) {
  const params = new URLSearchParams();
  for (const [name, value] of Object.entries(query || {})) {
    if (value === undefined || value === null || value === "") continue;
    for (const v of Array.isArray(value) ? value : [value]) params.append(name, String(v));
  }
  const s = params.toString();
  return s ? "?" + s : "";
}

async function errorOf(resp) {
  let body = null;
  let message = `${resp.status} ${resp.statusText}`;
  try {
    body = await resp.json();
    if (body && typeof body.message === "string") message = body.message;
  } catch (_) { /* not JSON: the status line says what happened */ }
  return new ApiError(resp.status, message, body);
}

// One API call; answers {body, headers}. `key` overrides the stored key (the login's check).
export async function call(method, path, { body, query, key, signal } = {}) {
  const headers = { "X-API-Key": key ?? apiKey() ?? "" };
  const init = { method, headers, signal };
  if (body !== undefined) {
    headers["Content-Type"] = "application/json";
    init.body = JSON.stringify(body);
  }
  const resp = await fetch(path + queryString(query), init);
  if (resp.status === 401 && key === undefined) {
    forgetApiKey();
    location.hash = "#/login";
  }
  if (!resp.ok) throw await errorOf(resp);
  const text = resp.status === 204 ? "" : await resp.text();
  return { body: text ? JSON.parse(text) : null, headers: resp.headers };
}

export const get = async (path, query, opts = {}) => (await call("GET", path, { query, ...opts })).body;
export const post = async (path, body, opts = {}) => (await call("POST", path, { body, ...opts })).body;
export const del = async (path) => (await call("DELETE", path)).body;
