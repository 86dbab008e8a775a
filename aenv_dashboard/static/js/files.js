// A sandbox's files through its envd: a directory listing (filesystem.Filesystem/ListDir),
// download (GET /files) and upload (POST /files) of the directory shown.

import { download, rpc, upload } from "./envd.js";
import { act, bytes, h, localTime, saveBlob, showError, toast } from "./ui.js";

const HOME = "/home/user";

export function filesPanel(sandbox) {
  let dir = HOME;
  const pathInput = h("input", { type: "text", id: "files-path", value: dir, "aria-label": "directory",
    onkeydown: (ev) => { if (ev.key === "Enter") open(pathInput.value); } });
  const up = h("button", { type: "button", onclick: () => open(parent(dir)) }, "Up");
  const list = h("div", { id: "files-list" });
  const chooser = h("input", { type: "file", id: "upload-input", multiple: true, "aria-label": "files to upload" });
  const send = h("button", { type: "button", id: "upload-button", onclick: () => act(send, async () => {
    for (const f of chooser.files) await upload(sandbox, join(dir, f.name), f);
    toast(`uploaded ${chooser.files.length} file(s) to ${dir}`);
    chooser.value = "";
    await open(dir);
  }) }, "Upload");
  const panel = h("section", { class: "files" },
    h("div", { class: "toolbar" }, up, pathInput,
      h("button", { type: "button", onclick: () => open(pathInput.value) }, "Open"), chooser, send),
    list);

  async function open(path) {
    try {
      const answer = await rpc(sandbox, "filesystem.Filesystem/ListDir", { path, depth: 1 });
      dir = path;
      pathInput.value = path;
      const entries = (answer.entries || []).slice().sort((a, b) =>
        (a.type === "FILE_TYPE_DIRECTORY" ? 0 : 1) - (b.type === "FILE_TYPE_DIRECTORY" ? 0 : 1) ||
        a.name.localeCompare(b.name));
      list.replaceChildren(h("table", { class: "grid" },
        h("thead", {}, h("tr", {}, ["Name", "Size", "Permissions", "Modified", ""].map((t) => h("th", {}, t)))),
        h("tbody", {}, entries.map((e) => entryRow(e)))));
    } catch (e) { showError(e); }
  }

  function entryRow(e) {
    const isDir = e.type === "FILE_TYPE_DIRECTORY";
    const name = isDir ? h("a", { href: "#", class: "dir", onclick: (ev) => { ev.preventDefault(); open(e.path); } },
      e.name + "/") : e.name;
    const get = isDir ? "" : h("button", { type: "button", class: "download", "data-path": e.path,
      onclick: (ev) => act(ev.currentTarget, async () => saveBlob(e.name, await download(sandbox, e.path))) }, "Download");
    return h("tr", { "data-path": e.path }, h("td", {}, name), h("td", {}, isDir ? "" : bytes(Number(e.size))),
      h("td", {}, e.permissions || ""), h("td", {}, localTime(e.modifiedTime)), h("td", {}, get));
  }

  open(dir);
  return panel;
}

const parent = (p) => p.replace(/\/[^/]+\/?$/, "") || "/";
const join = (d, name) => (d.endsWith("/") ? d : d + "/") + name;
