// Small DOM helpers: an element builder, a toast for messages and errors, formatting.

export function h(tag, attrs = {}, ...children) {
  const el = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs || {})) {
    if (value === undefined || value === null || value === false) continue;
    if (name.startsWith("on") && typeof value === "function") el.addEventListener(name.slice(2), value);
    else if (name === "class") el.className = value;
    else if (name in el && typeof value !== "string") el[name] = value;
    else el.setAttribute(name, value === true ? "" : value);
  }
  for (const c of children.flat()) if (c !== null && c !== undefined && c !== false)
    el.append(c instanceof Node ? c : String(c));
  return el;
}

let toastTimer = null;
export function toast(message, kind = "info") {
  const el = document.getElementById("toast");
  el.textContent = message;
  el.className = "show " + kind;
  clearTimeout(toastTimer);
  toastTimer = setTimeout(() => { el.className = ""; }, kind === "error" ? 8000 : 3000);
}

export const showError = (e) => toast(e && e.message ? e.message : String(e), "error");

// Runs an action from a button: disabled while it runs, its error shown as the API's message.
export async function act(button, fn) {
  button.disabled = true;
  try { return await fn(); } catch (e) { showError(e); return undefined; } finally { button.disabled = false; }
}

export function age(iso, now = Date.now()) {
  const t = Date.parse(iso);
  if (Number.isNaN(t)) return "";
  let s = Math.max(0, Math.round((now - t) / 1000));
  if (s < 60) return s + "s";
  if (s < 3600) return Math.floor(s / 60) + "m " + (s % 60) + "s";
  const hours = Math.floor(s / 3600);
  if (hours < 48) return hours + "h " + Math.floor((s % 3600) / 60) + "m";
  return Math.floor(hours / 24) + "d";
}

export function until(iso, now = Date.now()) {
  const t = Date.parse(iso);
  if (Number.isNaN(t)) return "";
  const s = Math.round((t - now) / 1000);
  return s >= 0 ? "in " + age(new Date(now - s * 1000).toISOString(), now) : age(iso, now) + " ago";
}

export function bytes(n) {
  if (n === undefined || n === null) return "";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return (i ? n.toFixed(1) : String(n)) + " " + units[i];
}

export const localTime = (iso) => (iso ? new Date(iso).toLocaleString() : "");

// The node running a sandbox: E2B's clientID, which aenv sets to the node's (fleet) name;
// "aenv" names no node (a sandbox a fleet released to its repository).
export function nodeOf(s) {
  return s.clientID && s.clientID !== "aenv" ? s.clientID : "—";
}

export function metadataText(metadata) {
  return Object.entries(metadata || {}).map(([k, v]) => `${k}=${v}`).join(" ");
}

export function table(columns, rows) {
  return h("table", { class: "grid" },
    h("thead", {}, h("tr", {}, columns.map((c) => h("th", {}, c.title)))),
    h("tbody", {}, rows.length ? rows.map((r) => h("tr", {}, columns.map((c) => h("td", {}, c.cell(r)))))
      : h("tr", {}, h("td", { colspan: columns.length, class: "muted" }, "none"))));
}

// Hands bytes the page fetched to the browser as a download named `name`.
export function saveBlob(name, blob) {
  const url = URL.createObjectURL(blob);
  const a = h("a", { href: url, download: name });
  document.body.append(a);
  a.click();
  a.remove();
  setTimeout(() => URL.revokeObjectURL(url), 10000);
}
