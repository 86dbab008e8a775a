// One sandbox: what get_info says (polled), its CPU/memory/disk charts (the metrics API),
// its logs followed, its files and a terminal (through its envd), and the actions.

import { get, post, del } from "./api.js";
import { lineChart } from "./charts.js";
import { filesPanel } from "./files.js";
import { terminalPanel } from "./terminal.js";
import { act, age, bytes, h, localTime, metadataText, nodeOf, showError, toast, until } from "./ui.js";

const INFO_MS = 2000;
const METRICS_MS = 5000;    // the node samples a guest every 5 s
const LOGS_MS = 2000;
const RESUME_TIMEOUT = 300; // seconds a resumed sandbox lives (the SDK's connect default)

export function sandboxPage(main, [id]) {
  const path = "/sandboxes/" + encodeURIComponent(id);
  let info = null;
  let stopped = false;
  const timers = new Set();
  let panelClose = null;
  let tab = "metrics";

  const title = h("h2", {}, "Sandbox ", h("code", {}, id));
  const stateBadge = h("span", { id: "sandbox-state", class: "state" });
  const facts = h("dl", { class: "facts", id: "sandbox-facts" });
  const result = h("div", { id: "action-result", class: "result", role: "status" });
  const forkCount = h("input", { type: "number", id: "fork-count", min: 1, max: 100, value: 1, "aria-label": "fork count" });
  const timeoutInput = h("input", { type: "number", id: "timeout-seconds", min: 1, value: RESUME_TIMEOUT,
    "aria-label": "timeout in seconds" });
  const snapName = h("input", { type: "text", id: "snapshot-name", placeholder: "name (optional)", "aria-label": "snapshot name" });
  const button = (label, idName, fn, cls) => {
    const b = h("button", { type: "button", id: idName, class: cls || "" }, label);
    // act() enables the button again when done: pause/resume then follow the state
    b.addEventListener("click", async () => { await act(b, fn); syncButtons(); });
    return b;
  };

  const pauseButton = button("Pause", "pause", async () => {
    await post(path + "/pause", {});
    toast("paused");
    await refresh();
  });
  const resumeButton = button("Resume", "resume", async () => {
    await post(path + "/connect", { timeout: Number(timeoutInput.value) || RESUME_TIMEOUT });
    toast("running");
    await refresh();
  });
  function syncButtons() {
    if (!info) return;
    pauseButton.disabled = info.state !== "running";
    resumeButton.disabled = info.state !== "paused";
  }
  const actions = h("div", { class: "actions" }, pauseButton, resumeButton,
    h("span", { class: "group" }, forkCount, button("Fork", "fork", async () => {
      const count = Number(forkCount.value);
      const answer = await post(path + "/fork", { count });
      const made = answer.filter((a) => a.sandbox).map((a) => a.sandbox.sandboxID);
      const failed = answer.filter((a) => a.error).map((a) => a.error.message);
      result.replaceChildren(h("span", {}, `forked ${made.length} of ${count}: `),
        ...made.map((c) => h("a", { class: "child", href: "#/sandboxes/" + c, "data-id": c }, c)),
        failed.length ? h("span", { class: "error" }, " failed: " + failed.join("; ")) : "");
    })),
    h("span", { class: "group" }, snapName, button("Snapshot", "snapshot", async () => {
      const body = snapName.value.trim() ? { name: snapName.value.trim() } : {};
      const answer = await post(path + "/snapshots", body);
      result.replaceChildren(h("span", { id: "snapshot-id" }, "snapshot " + answer.snapshotID));
    })),
    h("span", { class: "group" }, timeoutInput, button("Set timeout", "set-timeout", async () => {
      await post(path + "/timeout", { timeout: Number(timeoutInput.value) });
      toast(`ends in ${timeoutInput.value} s`);
      await refresh();
    })),
    button("Kill", "kill", async () => {
      if (!confirm(`Kill sandbox ${id}? Its processes and files are gone for good.`)) return;
      await del(path);
      toast("killed " + id);
      location.hash = "#/sandboxes";
    }, "danger"));

  const tabs = ["metrics", "logs", "files", "terminal"];
  const tabBar = h("div", { class: "tabs", role: "tablist" }, tabs.map((t) =>
    h("button", { type: "button", role: "tab", id: "tab-" + t, onclick: () => show(t) }, t[0].toUpperCase() + t.slice(1))));
  const panel = h("div", { class: "panel", role: "tabpanel" });

  main.append(h("section", { class: "sandbox" }, h("p", {}, h("a", { href: "#/sandboxes" }, "‹ Sandboxes")),
    h("div", { class: "titlebar" }, title, stateBadge), facts, actions, result, tabBar, panel));

  let generation = 0;      // a loop of an earlier tab stops when the tab changes
  function every(ms, fn) {
    const mine = generation;
    const live = () => !stopped && mine === generation;
    const tick = async () => {
      if (!live()) return;
      await fn();
      if (live()) timers.add(setTimeout(tick, ms));
    };
    tick();
  }

  async function refresh() {
    try {
      info = await get(path);
    } catch (e) {
      if (e.status === 404) { stateBadge.textContent = "gone"; stateBadge.className = "state gone"; }
      showError(e);
      return;
    }
    stateBadge.textContent = info.state;
    stateBadge.className = "state " + info.state;
    const rows = [["Template", info.alias || info.templateID], ["Started", `${localTime(info.startedAt)} (${age(info.startedAt)} ago)`],
      ["Ends", `${localTime(info.endAt)} (${until(info.endAt)})`], ["On timeout", info.lifecycle ? info.lifecycle.onTimeout : ""],
      ["CPU", info.cpuCount], ["Memory", info.memoryMB + " MiB"], ["Disk", info.diskSizeMB + " MiB"],
      ["Node", nodeOf(info)], ["Metadata", metadataText(info.metadata) || "—"]];
    facts.replaceChildren(...rows.flatMap(([k, v]) => [h("dt", {}, k), h("dd", {}, String(v ?? ""))]));
    syncButtons();
  }

  function metricsPanel() {
    const box = h("div", { class: "charts", id: "charts" }, h("p", { class: "muted" }, "loading metrics…"));
    every(METRICS_MS, async () => {
      try {
        const samples = await get(path + "/metrics");
        const at = (m) => (m.timestampUnix ? m.timestampUnix * 1000 : Date.parse(m.timestamp));
        const last = samples[samples.length - 1] || {};
        box.replaceChildren(
          lineChart({ id: "chart-cpu", title: "CPU", points: samples.map((m) => ({ t: at(m), v: m.cpuUsedPct })),
            max: 100, format: (v) => v.toFixed(0) + " %" }),
          lineChart({ id: "chart-memory", title: "Memory", points: samples.map((m) => ({ t: at(m), v: m.memUsed })),
            max: last.memTotal, format: bytes }),
          lineChart({ id: "chart-disk", title: "Disk", points: samples.map((m) => ({ t: at(m), v: m.diskUsed })),
            max: last.diskTotal, format: bytes }));
      } catch (e) { showError(e); }
    });
    return box;
  }

  function logsPanel() {
    const pre = h("pre", { class: "logs", id: "logs" });
    const seen = new Set();
    let since = 0;
    every(LOGS_MS, async () => {
      try {
        const answer = await get(path + "/logs", { start: since, limit: 1000 });
        const atBottom = pre.scrollTop + pre.clientHeight >= pre.scrollHeight - 4;
        // logEntries (level, message, fields) where the server gives them, else E2B's {timestamp, line}
        const entries = answer.logEntries || (answer.logs || []).map((e) => ({ ...e, message: e.line }));
        for (const e of entries) {
          const fields = Object.entries(e.fields || {}).map(([k, v]) => ` ${k}=${v}`).join("");
          const text = `${e.level && e.level !== "info" ? e.level.toUpperCase() + " " : ""}${e.message}${fields}`;
          const key = e.timestamp + "\u0000" + text;
          if (seen.has(key)) continue;
          seen.add(key);
          since = Math.max(since, Date.parse(e.timestamp) || 0);
          pre.append(`${new Date(e.timestamp).toLocaleTimeString()}  ${text}\n`);
        }
        if (atBottom) pre.scrollTop = pre.scrollHeight;    // follow unless the reader scrolled up
      } catch (e) { showError(e); }
    });
    return pre;
  }

  async function envdPanel(make) {
    // files and the terminal need the sandbox running and its envd token (get_info has it)
    if (!info || info.state !== "running") await refresh();
    if (!info) return h("p", { class: "error" }, "the sandbox is not available");
    if (info.state !== "running") return h("p", { class: "muted" }, "The sandbox is paused: resume it first.");
    return make(info);
  }

  async function show(name) {
    tab = name;
    for (const b of tabBar.children) b.setAttribute("aria-selected", String(b.id === "tab-" + name));
    for (const t of [...timers]) { clearTimeout(t); timers.delete(t); }
    if (panelClose) { panelClose(); panelClose = null; }
    generation++;
    panel.replaceChildren();
    every(INFO_MS, refresh);
    let content;
    if (name === "metrics") content = metricsPanel();
    else if (name === "logs") content = logsPanel();
    else if (name === "files") content = await envdPanel(filesPanel);
    else content = await envdPanel((s) => { const t = terminalPanel(s); panelClose = t.close; return t.panel; });
    if (tab === name) panel.replaceChildren(content);
  }

  show("metrics");
  return () => {
    stopped = true;
    for (const t of timers) clearTimeout(t);
    if (panelClose) panelClose();
  };
}
