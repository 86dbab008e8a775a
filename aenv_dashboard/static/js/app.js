// The dashboard's shell: a hash router (#/sandboxes, #/sandboxes/<id>, ...) over views.
// A view is a function (main element, route parameters) that fills the element and
// answers a clean-up function (its timers and streams stop when the route changes).

import { apiKey, ApiError, forgetApiKey, get, isAdmin, setAdminToken, setApiKey } from "./api.js";
import { h } from "./ui.js";
import { sandboxList } from "./list.js";
import { sandboxPage } from "./sandbox.js";
import { nodesPage, snapshotsPage, templatesPage, volumesPage, buildPage } from "./resources.js";
import { volumePage } from "./volumes.js";
import { keysPage } from "./keys.js";
import { teamsPage } from "./teams.js";
import { teamPage } from "./team.js";

const routes = [
  [/^#\/sandboxes$/, sandboxList],
  [/^#\/sandboxes\/([^/]+)$/, sandboxPage],
  [/^#\/templates$/, templatesPage],
  [/^#\/templates\/([^/]+)\/builds\/([^/]+)$/, buildPage],
  [/^#\/snapshots$/, snapshotsPage],
  [/^#\/volumes$/, volumesPage],
  [/^#\/volumes\/([^/]+)$/, volumePage],
  [/^#\/nodes$/, nodesPage],
  [/^#\/keys$/, keysPage],
];
// the admin credential's pages (X-Admin-Token): it opens no other route, a team's key none of these
const adminRoutes = [
  [/^#\/teams$/, teamsPage],
  [/^#\/teams\/([^/]+)$/, teamPage],
];

let cleanup = null;

const LOGIN_AS = {
  key: { label: "API key", placeholder: "e2b_…", hint: "The key the server printed (E2B_API_KEY), or a team's key." },
  admin: { label: "Admin token", placeholder: "AENV_ADMIN_TOKEN",
    hint: "The node's admin credential (AENV_ADMIN_TOKEN): teams, their quotas and keys." },
};

function loginPage(main) {
  const input = h("input", { type: "password", id: "api-key", name: "api-key", autocomplete: "off",
    placeholder: LOGIN_AS.key.placeholder, required: true, autofocus: true });
  const label = h("label", { for: "api-key" }, LOGIN_AS.key.label);
  const hint = h("span", {}, LOGIN_AS.key.hint);
  const as = () => (document.getElementById("login-as-admin").checked ? "admin" : "key");
  const choice = (value, text) => h("label", {}, h("input", { type: "radio", name: "login-as", value,
    id: "login-as-" + value, checked: value === "key", onchange: () => {
      const c = LOGIN_AS[as()];
      label.textContent = c.label;
      input.placeholder = c.placeholder;
      hint.textContent = c.hint;
    } }), " ", text);
  const error = h("p", { class: "error", id: "login-error", role: "alert" });
  const form = h("form", { class: "login", onsubmit: async (ev) => {
    ev.preventDefault();
    error.textContent = "";
    const secret = input.value.trim();
    try {
      if (as() === "admin") {
        // the admin credential is checked with the one call it is for: the teams
        await get("/admin/teams", {}, { admin: secret });
        setAdminToken(secret);
        location.hash = "#/teams";
      } else {
        // the key is checked with a call any key may make: one sandbox of the list
        await get("/v2/sandboxes", { limit: 1 }, { key: secret });
        setApiKey(secret);
        location.hash = "#/sandboxes";
      }
    } catch (e) {
      error.textContent = e instanceof ApiError ? e.message : "the server did not answer: " + e.message;
    }
  } },
  h("h1", {}, "aenv"),
  h("fieldset", { class: "login-as" }, h("legend", {}, "Log in with"), choice("key", "an API key"),
    choice("admin", "the admin token")),
  label,
  input,
  h("button", { type: "submit" }, "Log in"),
  error,
  h("p", { class: "muted" }, hint, " It is kept in this tab only."));
  main.append(form);
  input.focus();
  return null;
}

function render() {
  if (cleanup) { try { cleanup(); } catch (_) { /* a view's clean-up never blocks the next */ } }
  cleanup = null;
  const main = document.getElementById("main");
  main.replaceChildren();
  const admin = isAdmin();
  const home = admin ? "#/teams" : "#/sandboxes";
  const hash = location.hash || home;
  const loggedIn = Boolean(apiKey()) || admin;
  document.getElementById("nav").hidden = !loggedIn;
  document.querySelector("header .brand").setAttribute("href", home);
  for (const a of document.querySelectorAll("#nav a")) a.hidden = admin !== ("admin" in a.dataset);
  if (!loggedIn || hash === "#/login") {
    if (loggedIn) { location.hash = home; return; }
    cleanup = loginPage(main);
    return;
  }
  const [mine, others] = admin ? [adminRoutes, routes] : [routes, adminRoutes];
  if (!mine.some(([pattern]) => pattern.test(hash)) && others.some(([pattern]) => pattern.test(hash))) {
    main.append(h("p", { class: "error", id: "wrong-credential" }, admin
      ? "This page needs a team's API key: the admin token opens the Teams pages only. Log out and log in with a key."
      : "This page needs the admin token: log out and log in with it."));
    return;
  }
  for (const [pattern, view] of mine) {
    const m = hash.match(pattern);
    if (m) {
      for (const a of document.querySelectorAll("#nav a"))
        a.classList.toggle("active", hash.startsWith(a.getAttribute("href")));
      cleanup = view(main, m.slice(1).map(decodeURIComponent));
      return;
    }
  }
  main.append(h("p", { class: "error" }, "No such page: " + hash));
}

document.getElementById("logout").addEventListener("click", () => {
  forgetApiKey();
  location.hash = "#/login";
  render();
});
window.addEventListener("hashchange", render);
render();
