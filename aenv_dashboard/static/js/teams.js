// The admin's teams (#/teams, with the admin credential): every team with its keys, its
// running and paused sandboxes against its quotas (bars) and its start rate; create a team,
// delete one (confirmed). Calls: GET/POST /admin/teams, DELETE /admin/teams/{id},
// GET /admin/sandboxes/running-counts, GET /admin/teams/{id}/api-keys,
// GET /teams/{id}/metrics/max (X-Team-ID). One team's page is team.js.

import { del, get, post } from "./api.js";
import { bar, polled } from "./resources.js";
import { act, h, table, toast } from "./ui.js";

export const teamPath = (id) => "/admin/teams/" + encodeURIComponent(id);

// A count against its quota (null: unlimited) as a bar; at the quota it is drawn full.
export function useBar(used, limit, what) {
  const label = limit === null || limit === undefined ? `${used} ${what}, no quota` : `${used} of ${limit} ${what}`;
  return bar(used, limit ?? 0, label);
}

// Every team's {running, paused} now (the fleet's sum through a gateway).
export async function teamUse() {
  const counts = await get("/admin/sandboxes/running-counts");
  return new Map((counts.teams || []).map((c) => [c.teamID, { running: c.runningSandboxes,
    paused: c.pausedSandboxes ?? 0 }]));
}

export const rateText = (r) => (r >= 10 ? r.toFixed(0) : r.toFixed(2).replace(/\.?0+$/, "") || "0");

// The page redraws every few seconds: the element the keyboard was on (data-focus) keeps the focus.
function refocusAfterRedraw() {
  const key = document.activeElement?.dataset?.focus;
  if (key) setTimeout(() => document.querySelector(`[data-focus="${CSS.escape(key)}"]`)?.focus(), 0);
}

async function teamRows() {
  const [teams, use] = await Promise.all([get("/admin/teams"), teamUse()]);
  const since = Math.floor(Date.now() / 1000) - 60;
  return Promise.all(teams.map(async (t) => {
    const [keys, peak] = await Promise.all([
      get(teamPath(t.teamID) + "/api-keys").then((k) => k.length, () => "?"),
      get(`/teams/${encodeURIComponent(t.teamID)}/metrics/max`, { metric: "sandbox_start_rate", start: since },
        { team: t.teamID }).then((m) => m.value, () => null),
    ]);
    return { ...t, keys, peak, use: use.get(t.teamID) || { running: 0, paused: 0 }, quota: t.quota || {} };
  }));
}

function deleteButton(t) {
  if (t.isDefault) return h("span", { class: "muted" }, "the default team");
  const b = h("button", { type: "button", class: "danger team-delete", "data-team": t.teamID,
    "data-focus": "delete-" + t.teamID }, "Delete");
  b.addEventListener("click", () => act(b, async () => {
    if (!confirm(`Delete team “${t.name}” and its API keys? Its keys are refused at once.`)) return;
    await del(teamPath(t.teamID));
    toast("deleted team " + t.name);
    b.closest("tr").remove();
  }));
  return b;
}

function createForm() {
  const name = h("input", { type: "text", id: "team-name", placeholder: "team name", "aria-label": "team name",
    required: true, maxlength: 200 });
  const go = h("button", { type: "submit", id: "team-create" }, "Create team");
  return h("form", { class: "toolbar", onsubmit: (ev) => {
    ev.preventDefault();
    act(go, async () => {
      const team = await post("/admin/teams", { name: name.value.trim() });
      toast("created team " + team.name);
      location.hash = "#/teams/" + encodeURIComponent(team.teamID);
    });
  } }, name, go);
}

export function teamsPage(main) {
  return polled(main, "Teams", async () => {
    const rows = await teamRows();
    refocusAfterRedraw();
    return h("div", { id: "teams" }, table([
      { title: "Team", cell: (t) => h("a", { href: "#/teams/" + encodeURIComponent(t.teamID), class: "team",
        "data-team": t.teamID, "data-focus": "team-" + t.teamID }, t.name) },
      { title: "ID", cell: (t) => h("code", {}, t.teamID) },
      { title: "Keys", cell: (t) => String(t.keys) },
      { title: "Running", cell: (t) => useBar(t.use.running, t.quota.runningSandboxes, "running") },
      { title: "Paused", cell: (t) => useBar(t.use.paused, t.quota.pausedSandboxes, "paused") },
      { title: "Starts/s (peak, last min)", cell: (t) => (t.peak === null ? "?" : rateText(t.peak))
        + (t.quota.createsPerSecond ? ` of ${rateText(t.quota.createsPerSecond)}` : "") },
      { title: "Builds at once", cell: (t) => (t.quota.concurrentBuilds ?? "no quota") },
      { title: "", cell: deleteButton },
    ], rows));
  }, createForm());
}
