// Templates (with a build's log), snapshots, volumes and nodes: lists from the same API
// calls the CLI makes, refreshed every few seconds; errors shown as the API's message.

import { call, del, get, post } from "./api.js";
import { act, bytes, h, localTime, table, toast } from "./ui.js";

const REFRESH_MS = 3000;

// A page that (re)draws itself from `load` every REFRESH_MS until the route changes;
// `top` (a form) stays above what is redrawn.
export function polled(main, heading, load, top = null) {
  const box = h("div", { class: "resource" }, h("p", { class: "muted" }, "loading…"));
  main.append(h("section", {}, h("h2", {}, heading), top, box));
  let stopped = false;
  let timer = null;
  const tick = async () => {
    try {
      const content = await load();
      if (!stopped) box.replaceChildren(content);
    } catch (e) {
      if (!stopped) box.replaceChildren(h("p", { class: "error api-error" }, e.message));
    }
    if (!stopped) timer = setTimeout(tick, REFRESH_MS);
  };
  tick();
  return () => { stopped = true; clearTimeout(timer); };
}

// Every page of a list the API pages with X-Next-Token (at most `pages` of them).
async function allPages(path, query = {}, pages = 10) {
  const out = [];
  let token = null;
  for (let i = 0; i < pages; i++) {
    const { body, headers } = await call("GET", path, { query: { ...query, nextToken: token } });
    out.push(...(body || []));
    token = headers.get("X-Next-Token");
    if (!token) break;
  }
  return out;
}

// A build from a Dockerfile, as `aenv template build -f` starts one without a context:
// request it (POST /templates), start it, then follow it on its page.
function buildForm() {
  const name = h("input", { type: "text", id: "build-name", placeholder: "template name", "aria-label": "template name",
    pattern: "[a-z0-9._-]+", required: true });
  const file = h("input", { type: "file", id: "build-dockerfile", "aria-label": "Dockerfile", required: true });
  const go = h("button", { type: "submit", id: "build-start" }, "Build");
  return h("form", { class: "toolbar", onsubmit: (ev) => {
    ev.preventDefault();
    act(go, async () => {
      if (!file.files.length) throw new Error("choose a Dockerfile");
      const dockerfile = await file.files[0].text();
      const requested = await post("/templates", { alias: name.value.trim(), dockerfile });
      const where = `/templates/${encodeURIComponent(requested.templateID)}/builds/${encodeURIComponent(requested.buildID)}`;
      await post(where, {});
      location.hash = "#" + where;
    });
  } }, h("span", { class: "muted" }, "Build from a Dockerfile (no COPY context):"), name, file, go);
}

export function templatesPage(main) {
  return polled(main, "Templates", async () => {
    const templates = await allPages("/v2/templates");
    // each template's builds and tags: its own calls (the list carries neither)
    const withBuilds = await Promise.all(templates.map(async (t) => {
      const id = encodeURIComponent(t.templateID);
      const [detail, tags] = await Promise.all([get("/templates/" + id).catch(() => t),
        get(`/templates/${id}/tags`).catch(() => [])]);
      return { ...detail, tags };
    }));
    return table([
      { title: "Names", cell: (t) => (t.names || t.aliases || []).join(", ") || t.templateID },
      { title: "ID", cell: (t) => h("code", {}, t.templateID) },
      { title: "Tags", cell: (t) => (t.tags || []).map((x) => x.tag).join(", ") },
      { title: "Status", cell: (t) => h("span", { class: "state " + t.buildStatus }, t.buildStatus || "") },
      { title: "CPU / RAM / disk", cell: (t) => `${t.cpuCount} / ${t.memoryMB} MiB / ${t.diskSizeMB} MiB` },
      { title: "Builds", cell: (t) => (t.builds || []).slice(-5).map((b) =>
        h("a", { class: "build " + b.status, href: `#/templates/${encodeURIComponent(t.templateID)}/builds/${b.buildID}`,
          title: b.status }, `${b.status} ${localTime(b.createdAt)}`)) },
      { title: "Updated", cell: (t) => localTime(t.updatedAt) },
    ], withBuilds);
  }, buildForm());
}

export function buildPage(main, [templateID, buildID]) {
  return polled(main, `Build ${buildID}`, async () => {
    const s = await get(`/templates/${encodeURIComponent(templateID)}/builds/${encodeURIComponent(buildID)}/status`,
      { logsOffset: 0, limit: 100 });
    const entries = s.logEntries || [];
    const reason = s.reason ? h("div", { class: "error", id: "build-reason" },
      `failed at step ${s.reason.step ?? "?"}: ${s.reason.message}`) : "";
    return h("div", {}, h("p", {}, h("a", { href: "#/templates" }, "‹ Templates"), " ",
      h("span", { class: "state " + s.status, id: "build-status" }, s.status)), reason,
    h("pre", { class: "logs", id: "build-log" }, entries.map((e) =>
      `${new Date(e.timestamp).toLocaleTimeString()} ${e.step != null ? `[step ${e.step}] ` : ""}${e.level}: ${e.message}\n`)));
  });
}

export function snapshotsPage(main) {
  return polled(main, "Snapshots", async () => table([
    { title: "ID", cell: (s) => h("code", {}, s.snapshotID) },
    { title: "Names", cell: (s) => (s.names || []).join(", ") },
    { title: "", cell: (s) => {
      const b = h("button", { type: "button", class: "danger" }, "Delete");
      b.addEventListener("click", () => act(b, async () => {
        if (!confirm(`Delete snapshot ${s.snapshotID}?`)) return;
        await del("/templates/" + encodeURIComponent(s.snapshotID));
        toast("deleted " + s.snapshotID);
        b.closest("tr").remove();
      }));
      return b;
    } },
  ], await allPages("/snapshots")));
}

export function volumesPage(main) {
  return polled(main, "Volumes", async () => table([
    { title: "Name", cell: (v) => h("a", { href: "#/volumes/" + encodeURIComponent(v.volumeID), class: "volume" }, v.name) },
    { title: "ID", cell: (v) => h("code", {}, v.volumeID) },
    { title: "", cell: (v) => {
      const b = h("button", { type: "button", class: "danger" }, "Delete");
      b.addEventListener("click", () => act(b, async () => {
        if (!confirm(`Delete volume ${v.name} and all its files?`)) return;
        await del("/volumes/" + encodeURIComponent(v.volumeID));
        toast("deleted " + v.name);
        b.closest("tr").remove();
      }));
      return b;
    } },
  ], await get("/volumes")));
}

export function bar(used, total, label) {
  const pct = total > 0 ? Math.min(100, Math.round((100 * used) / total)) : 0;
  return h("div", { class: "bar", title: label, role: "meter", "aria-valuenow": pct, "aria-valuemin": 0,
    "aria-valuemax": 100, "aria-label": label },
  h("div", { class: "fill" + (pct > 85 ? " high" : ""), style: `width:${pct}%` }), h("span", {}, label));
}

// A fleet's gateway lists its nodes (nodeID, drained, free slots, ...) and its events; a
// single node answers E2B's Node (id, status, metrics). Drain and undrain are each one's own call.
export function nodesPage(main) {
  return polled(main, "Nodes", async () => {
    const nodes = await get("/nodes");
    if (nodes.length && "drained" in nodes[0]) return h("div", {}, fleetNodes(nodes),
      h("h3", {}, "Fleet events"), fleetEvents(await get("/cluster/events")));
    return table([
      { title: "Node", cell: (n) => h("code", {}, n.id) },
      { title: "Status", cell: (n) => h("span", { class: "state " + n.status }, n.status) },
      { title: "Sandboxes", cell: (n) => String(n.sandboxCount) },
      { title: "CPU", cell: (n) => bar(n.metrics.cpuPercent, 100, `${n.metrics.cpuPercent}% of ${n.metrics.cpuCount} CPUs`) },
      { title: "Memory", cell: (n) => bar(n.metrics.memoryUsedBytes, n.metrics.memoryTotalBytes,
        `${bytes(n.metrics.memoryUsedBytes)} of ${bytes(n.metrics.memoryTotalBytes)}`) },
      { title: "", cell: (n) => nodeButton(n.id, n.status === "ready" ? "Drain" : "Ready",
        () => post("/nodes/" + encodeURIComponent(n.id), { status: n.status === "ready" ? "draining" : "ready" })) },
    ], nodes);
  });
}

// A gateway's nodes: state, load against capacity as bars, drain/undrain.
function fleetNodes(nodes) {
  return h("div", { id: "fleet-nodes" }, table([
    { title: "Node", cell: (n) => h("code", {}, n.nodeID) },
    { title: "State", cell: (n) => h("span", { class: "state " + (n.drained ? "draining" : n.state) },
      n.state + (n.drained ? " (drained)" : "")) },
    { title: "Sandboxes", cell: (n) => bar(n.running, n.maxSandboxes,
      // a drained (or expired) node has no free slots to give: the gateway says null
      `${n.running} running, ${n.paused} paused, ${n.freeSlots ?? 0} of ${n.maxSandboxes} free`) },
    { title: "Memory", cell: (n) => bar(n.memTotalMiB - n.memAvailableMiB, n.memTotalMiB,
      `${bytes((n.memTotalMiB - n.memAvailableMiB) * 1048576)} of ${bytes(n.memTotalMiB * 1048576)}`) },
    { title: "Restores", cell: (n) => `${n.restoring ?? 0} / ${n.restoreSlots ?? "?"}` },
    { title: "", cell: (n) => nodeButton(n.nodeID, n.drained ? "Undrain" : "Drain",
      () => post(`/nodes/${encodeURIComponent(n.nodeID)}/${n.drained ? "undrain" : "drain"}`, {})) },
  ], nodes));
}

// The gateway's newest fleet events (Redis' stream; the id's first part is its time in ms).
function fleetEvents(events) {
  return h("div", { id: "fleet-events" }, table([
    { title: "When", cell: (e) => new Date(Number(String(e.eventID).split("-")[0])).toLocaleString() },
    { title: "Event", cell: (e) => Object.entries(e).filter(([k, v]) => k !== "eventID" && v !== "")
      .map(([k, v]) => `${k}=${v}`).join(" ") },
  ], events.slice(0, 50)));
}

function nodeButton(id, label, fn) {
  const b = h("button", { type: "button", class: "node-op", "data-node": id }, label);
  b.addEventListener("click", () => act(b, async () => {
    if (label === "Drain" && !confirm(`Drain node ${id}? It takes no new sandboxes until undrained.`)) return;
    await fn();
    toast(`${label.toLowerCase()}: ${id}`);
  }));
  return b;
}
