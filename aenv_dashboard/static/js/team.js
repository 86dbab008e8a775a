// One team, for the admin (#/teams/{id}): its use against its quotas and its metrics as
// charts (refreshed), its quota form, its API keys, and the admin's actions on it: kill
// every sandbox, cancel every build, delete the team (each confirmed). Calls: GET/PUT
// /admin/teams/{id}/quota, /admin/teams/{id}/api-keys, POST …/sandboxes/kill,
// …/builds/cancel, DELETE /admin/teams/{id}, GET /teams/{id}/metrics (X-Team-ID).

import { del, get, post, put } from "./api.js";
import { lineChart } from "./charts.js";
import { keyPanel } from "./keys.js";
import { polled } from "./resources.js";
import { rateText, teamPath, teamUse, useBar } from "./teams.js";
import { act, h, localTime, toast } from "./ui.js";

const WINDOW_S = 900;       // the charts' span: the last 15 minutes

// [wire name, label, input attributes]: what PUT /admin/teams/{id}/quota takes
const QUOTA_FIELDS = [
  ["runningSandboxes", "running sandboxes", { min: 0, step: 1 }],
  ["pausedSandboxes", "paused sandboxes", { min: 0, step: 1 }],
  ["createsPerSecond", "creates per second", { min: 0, step: "any" }],
  ["concurrentBuilds", "concurrent builds", { min: 0, step: 1 }],
  ["volumeBytes", "volume bytes (sum of maxBytes)", { min: 0, step: 1 }],
  ["snapshotBytes", "snapshot bytes", { min: 0, step: 1 }],
];

async function usage(teamID) {
  const id = encodeURIComponent(teamID);
  const start = Math.floor(Date.now() / 1000) - WINDOW_S;
  const [teams, use, series] = await Promise.all([get("/admin/teams"), teamUse(),
    get(`/teams/${id}/metrics`, { start }, { team: teamID })]);
  const team = teams.find((t) => t.teamID === teamID);
  if (!team) throw new Error(`no team ${teamID}`);
  const q = team.quota || {};
  const now = use.get(teamID) || { running: 0, paused: 0 };
  const points = (key) => series.map((m) => ({ t: m.timestampUnix * 1000, v: m[key] }));
  return h("div", {},
    h("dl", { class: "facts", id: "team-facts" },
      h("dt", {}, "Name"), h("dd", { id: "team-title" }, team.name + (team.isDefault ? " (the default team)" : "")),
      h("dt", {}, "ID"), h("dd", {}, h("code", {}, team.teamID)),
      h("dt", {}, "Created"), h("dd", {}, localTime(team.createdAt)),
      h("dt", {}, "Running"), h("dd", { id: "team-running" }, useBar(now.running, q.runningSandboxes, "running")),
      h("dt", {}, "Paused"), h("dd", { id: "team-paused" }, useBar(now.paused, q.pausedSandboxes, "paused")),
      h("dt", {}, "Builds at once"), h("dd", {}, String(q.concurrentBuilds ?? "no quota"))),
    h("div", { class: "charts" },
      lineChart({ id: "chart-concurrent", title: "Running sandboxes", points: points("concurrentSandboxes"),
        max: q.runningSandboxes, format: (v) => String(Math.round(v)) }),
      lineChart({ id: "chart-starts", title: "Starts per second", points: points("sandboxStartRate"),
        max: q.createsPerSecond, format: rateText })));
}

function quotaForm(base) {
  const inputs = QUOTA_FIELDS.map(([wire, label, attrs]) => [wire, h("input", { type: "number", id: "quota-" + wire,
    name: wire, placeholder: "no quota", "aria-label": label, ...attrs })]);
  const error = h("p", { class: "error", id: "quota-error", role: "alert" });
  const save = h("button", { type: "submit", id: "quota-save" }, "Save quota");
  const fill = (q) => { for (const [wire, input] of inputs) input.value = q[wire] ?? ""; };
  const form = h("form", { class: "quota", onsubmit: (ev) => {
    ev.preventDefault();
    error.textContent = "";
    act(save, async () => {
      const body = Object.fromEntries(inputs.map(([wire, input]) =>
        [wire, input.value === "" ? null : Number(input.value)]));
      try {
        fill(await put(base + "/quota", body));
        toast("quota saved");
      } catch (e) {
        error.textContent = e.message;
        throw e;
      }
    });
  } }, inputs.map(([wire, input], i) => h("label", { for: input.id }, QUOTA_FIELDS[i][1], input)), save, error);
  get(base + "/quota").then(fill, (e) => { error.textContent = e.message; });
  return h("section", {}, h("h3", {}, "Quota"),
    h("p", { class: "muted" }, "Empty: no quota. The whole quota is sent: a field left empty is unlimited."), form);
}

// An admin action on the whole team: confirmed, then its answer's counts in a toast and on the page.
function actionButton(id, label, question, fn, result) {
  const b = h("button", { type: "button", class: "danger", id }, label);
  b.addEventListener("click", () => act(b, async () => {
    if (!confirm(question)) return;
    const said = await fn();
    if (said === undefined) return;
    result.textContent = said;
    toast(said);
  }));
  return b;
}

export function teamPage(main, [teamID]) {
  const base = teamPath(teamID);
  const result = h("span", { id: "team-action-result", role: "status" });
  const actions = h("div", { class: "actions" }, h("a", { href: "#/teams" }, "‹ Teams"),
    actionButton("team-kill", "Kill all sandboxes", `Kill every sandbox of team ${teamID}, running or paused?`,
      async () => {
        const r = await post(base + "/sandboxes/kill");
        return `killed ${r.killedCount}, failed ${r.failedCount}`;
      }, result),
    actionButton("team-cancel-builds", "Cancel all builds", `Cancel every running or waiting build of team ${teamID}?`,
      async () => {
        const r = await post(base + "/builds/cancel");
        return `cancelled ${r.cancelledCount} build(s), failed ${r.failedCount}`;
      }, result),
    actionButton("team-delete", "Delete team", `Delete team ${teamID} and its API keys? Its keys are refused at once.`,
      async () => { await del(base); toast("deleted team " + teamID); location.hash = "#/teams"; return undefined; },
      result),
    result);
  const stop = polled(main, "Team", () => usage(teamID), actions);
  const keys = keyPanel(base + "/api-keys");
  main.append(quotaForm(base), h("section", {}, h("h3", {}, "API keys"), keys.element));
  keys.load();
  return stop;
}
