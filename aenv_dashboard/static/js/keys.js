// The caller's team and its API keys (#/keys): the team routes any key of the team may
// call (GET /teams, GET/POST/DELETE /api-keys; docs/api.md "Teams and API keys"). A new
// key's value is shown once, as the API answers it once.

import { del, get, post } from "./api.js";
import { act, h, localTime, table, toast } from "./ui.js";

function maskText(mask) {
  if (!mask || typeof mask === "string") return mask || "";
  return `${mask.prefix || ""}${mask.maskedValuePrefix || ""}…${mask.maskedValueSuffix || ""}`;
}

export function keysPage(main) {
  const team = h("p", { class: "muted", id: "team" });
  const created = h("div", { id: "new-key", class: "result" });
  const list = h("div", { id: "keys" });
  const name = h("input", { type: "text", id: "key-name", placeholder: "key name", "aria-label": "key name",
    required: true, maxlength: 200 });
  const make = h("button", { type: "submit", id: "key-create" }, "Create key");
  const form = h("form", { class: "toolbar", onsubmit: (ev) => {
    ev.preventDefault();
    act(make, async () => {
      const key = await post("/api-keys", { name: name.value.trim() });
      name.value = "";
      created.replaceChildren(h("span", {}, `New key “${key.name}” — copy it now, it is not shown again: `),
        h("code", { id: "new-key-value" }, key.key));
      await load();
    });
  } }, name, make);
  main.append(h("section", {}, h("h2", {}, "Team and API keys"), team, form, created, list));

  async function load() {
    try {
      const [teams, keys] = await Promise.all([get("/teams"), get("/api-keys")]);
      team.textContent = teams.map((t) => `team ${t.name} (${t.teamID})${t.isDefault ? ", the default team" : ""}`)
        .join("; ");
      list.replaceChildren(table([
        { title: "Name", cell: (k) => k.name },
        { title: "Key", cell: (k) => h("code", {}, maskText(k.mask)) },
        { title: "Created", cell: (k) => localTime(k.createdAt) },
        { title: "", cell: (k) => {
          const b = h("button", { type: "button", class: "danger", "data-key": k.id }, "Delete");
          b.addEventListener("click", () => act(b, async () => {
            if (!confirm(`Delete the API key “${k.name}”? Clients using it are refused at once.`)) return;
            await del("/api-keys/" + encodeURIComponent(k.id));
            toast("deleted key " + k.name);
            await load();
          }));
          return b;
        } },
      ], keys));
    } catch (e) {
      list.replaceChildren(h("p", { class: "error api-error" }, e.message));
    }
  }

  load();
  return null;
}
