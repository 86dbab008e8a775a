// The dashboard's one way to the API: the same HTTP API the SDKs use, with the key the
// user typed (X-API-Key) or the node's admin credential (X-Admin-Token), kept in
// sessionStorage (gone with the tab). A 401 forgets the credential and returns to the
// login; any other error is thrown with the API's own message.

const KEY = "aenv.apiKey";
const ADMIN = "aenv.adminToken";

export class ApiError extends Error {
  constructor(status, message, body) {
    super(message);
    this.status = status;
    this.body = body;
  }
}

export const apiKey = () => sessionStorage.getItem(KEY);
export const adminToken = () => sessionStorage.getItem(ADMIN);
// the admin's view: logged in with the admin credential (and no API key)
export const isAdmin = () => !apiKey() && Boolean(adminToken());
export const setApiKey = (key) => { sessionStorage.removeItem(ADMIN); sessionStorage.setItem(KEY, key); };
export const setAdminToken = (token) => { sessionStorage.removeItem(KEY); sessionStorage.setItem(ADMIN, token); };
export const forgetApiKey = () => { sessionStorage.removeItem(KEY); sessionStorage.removeItem(ADMIN); };

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

function credentialHeaders(key, admin, team) {
  if (admin !== undefined) return { "X-Admin-Token": admin };
  if (key === undefined && isAdmin())
    return team ? { "X-Admin-Token": adminToken(), "X-Team-ID": team } : { "X-Admin-Token": adminToken() };
  return { "X-API-Key": key ?? apiKey() ?? "" };
}

// One API call; answers {body, headers}. `key` or `admin` overrides the stored credential
// (the login's check); `team` names the team an admin call is for (X-Team-ID).
export async function call(method, path, { body, query, key, admin, team, signal } = {}) {
  const headers = credentialHeaders(key, admin, team);
  const init = { method, headers, signal };
  if (body !== undefined) {
    headers["Content-Type"] = "application/json";
    init.body = JSON.stringify(body);
  }
  const resp = await fetch(path + queryString(query), init);
  // (an admin call for a team that answers 401 is shown, not a logout: the credential may be
  // right and the route not take it there, as an older gateway's team metrics)
  if (resp.status === 401 && key === undefined && admin === undefined && !team) {
    forgetApiKey();
    location.hash = "#/login";
  }
  if (!resp.ok) throw await errorOf(resp);
  const text = resp.status === 204 ? "" : await resp.text();
  return { body: text ? JSON.parse(text) : null, headers: resp.headers };
}

export const get = async (path, query, opts = {}) => (await call("GET", path, { query, ...opts })).body;
export const post = async (path, body, opts = {}) => (await call("POST", path, { body, ...opts })).body;
export const put = async (path, body, opts = {}) => (await call("PUT", path, { body, ...opts })).body;
export const del = async (path, opts = {}) => (await call("DELETE", path, opts)).body;
