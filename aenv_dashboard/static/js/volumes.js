// A volume's files (#/volumes/<id>): the volume content API the SDK's Volume uses
// (docs/volumes.md), authorised by the volume's own token (Authorization: Bearer, from
// GET /volumes/<id> with the API key), never the API key itself.

import { ApiError, get } from "./api.js";
import { act, bytes, h, localTime, saveBlob, showError, toast } from "./ui.js";

async function content(volume, method, route, path, body) {
  const query = new URLSearchParams({ path, ...(method === "PUT" ? { force: "true" } : {}) }).toString();
  const resp = await fetch(`/volumecontent/${encodeURIComponent(volume.volumeID)}/${route}?${query}`, {
    method, body, headers: { Authorization: "Bearer " + volume.token } });
  if (!resp.ok) {
    let message = `${resp.status} ${resp.statusText}`;
    try { message = (await resp.json()).message || message; } catch (_) { /* the status line */ }
    throw new ApiError(resp.status, message);
  }
  return resp;
}

export function volumePage(main, [volumeID]) {
  let volume = null;
  let dir = "/";
  const title = h("h2", {}, "Volume ", h("code", {}, volumeID));
  const where = h("p", { class: "muted", id: "volume-path" });
  const list = h("div", { id: "volume-files" });
  const chooser = h("input", { type: "file", id: "volume-upload-input", multiple: true, "aria-label": "files to upload" });
  const send = h("button", { type: "button", id: "volume-upload" }, "Upload");
  send.addEventListener("click", () => act(send, async () => {
    for (const f of chooser.files) await content(volume, "PUT", "file", join(dir, f.name), f);
    toast(`uploaded ${chooser.files.length} file(s) to ${dir}`);
    chooser.value = "";
    await open(dir);
  }));
  main.append(h("section", {}, h("p", {}, h("a", { href: "#/volumes" }, "‹ Volumes")), title,
    h("div", { class: "toolbar" }, h("button", { type: "button", onclick: () => open(parent(dir)) }, "Up"), where,
      chooser, send), list));

  async function open(path) {
    try {
      volume = volume || await get("/volumes/" + encodeURIComponent(volumeID));
      title.replaceChildren("Volume ", h("code", {}, volume.name));
      const entries = await (await content(volume, "GET", "dir", path)).json();
      dir = path;
      where.textContent = path;
      const here = entries.filter((e) => parent(e.path) === normal(path));
      list.replaceChildren(h("table", { class: "grid" },
        h("thead", {}, h("tr", {}, ["Name", "Size", "Modified", ""].map((t) => h("th", {}, t)))),
        h("tbody", {}, here.length ? here.map(row) : h("tr", {}, h("td", { colspan: 4, class: "muted" }, "empty")))));
    } catch (e) { showError(e); }
  }

  function row(e) {
    const isDir = e.type === "directory";
    const name = isDir ? h("a", { href: "#", class: "dir", onclick: (ev) => { ev.preventDefault(); open(e.path); } },
      e.name + "/") : e.name;
    const getIt = e.type !== "file" ? "" : h("button", { type: "button", class: "download", "data-path": e.path,
      onclick: (ev) => act(ev.currentTarget, async () =>
        saveBlob(e.name, await (await content(volume, "GET", "file", e.path)).blob())) }, "Download");
    return h("tr", { "data-path": e.path }, h("td", {}, name), h("td", {}, isDir ? "" : bytes(e.size)),
      h("td", {}, localTime(e.mtime)), h("td", {}, getIt));
  }

  open(dir);
  return null;
}

const normal = (p) => "/" + p.split("/").filter(Boolean).join("/");
const parent = (p) => normal(normal(p).replace(/\/[^/]*$/, ""));
const join = (d, name) => normal(d + "/" + name);
