// The caller's team and its API keys (#/keys): the team routes any key of the team may
// call (GET /teams, GET/POST/DELETE /api-keys; docs/api.md "Teams and API keys"). A new
// key's value is shown once, as the API answers it once. `keyPanel` is the list with its
// create form, also the admin's for any team (team.js, /admin/teams/{id}/api-keys).

import { del, get, post } from "./api.js";
import { act, h, localTime, table, toast } from "./ui.js";

function maskText(mask) {
  if (!mask || typeof mask === "string") return mask || "";
  return `${mask.prefix || ""}${mask.maskedValuePrefix || ""}…${mask.maskedValueSuffix || ""}`;
}

// A team's keys under `base` (/api-keys, or /admin/teams/{id}/api-keys): the list, Create
// (the value shown once), Delete (confirmed). Answers {element, load}; `changed` runs
// after a create or delete.
export function keyPanel(base, changed = () => {}) {
  const created = h("div", { id: "new-key", class: "result" });
  const list = h("div", { id: "keys" });
  const name = h("input", { type: "text", id: "key-name", placeholder: "key name", "aria-label": "key name",
    required: true, maxlength: 200 });
  const make = h("button", { type: "submit", id: "key-create" }, "Create key");
  const form = h("form", { class: "toolbar", onsubmit: (ev) => {
    ev.preventDefault();
    act(make, async () => {
      const key = await post(base, { name: name.value.trim() });
      name.value = "";
      created.replaceChildren(h("span", {}, `New key “${key.name}” — copy it now, it is not shown again: `),
        h("code", { id: "new-key-value" }, key.key));
      await load();
      changed();
    });
  } }, name, make);

  async function load() {
    try {
      list.replaceChildren(table([
        { title: "Name", cell: (k) => k.name },
        { title: "Key", cell: (k) => h("code", {}, maskText(k.mask)) },
        { title: "Created", cell: (k) => localTime(k.createdAt) },
        { title: "", cell: (k) => {
          const b = h("button", { type: "button", class: "danger", "data-key": k.id }, "Delete");
          b.addEventListener("click", () => act(b, async () => {
            if (!confirm(`Delete the API key “${k.name}”? Clients using it are refused at once.`)) return;
            await del(base + "/" + encodeURIComponent(k.id));
            toast("deleted key " + k.name);
            await load();
            changed();
          }));
          return b;
        } },
      ], await get(base)));
    } catch (e) {
      list.replaceChildren(h("p", { class: "error api-error" }, e.message));
    }
  }

  return { element: h("div", {}, form, created, list), load };
}

export function keysPage(main) {
  const team = h("p", { class: "muted", id: "team" });
  const keys = keyPanel("/api-keys");
  main.append(h("section", {}, h("h2", {}, "Team and API keys"), team, keys.element));
  get("/teams").then((teams) => {
    team.textContent = teams.map((t) => `team ${t.name} (${t.teamID})${t.isDefault ? ", the default team" : ""}`)
      .join("; ");
  }, (e) => team.replaceChildren(h("span", { class: "error api-error" }, e.message)));
  keys.load();
  return null;
}
