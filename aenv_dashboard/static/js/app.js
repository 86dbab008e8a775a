// The dashboard's shell: a hash router (#/sandboxes, #/sandboxes/<id>, ...) over views.
// A view is a function (main element, route parameters) that fills the element and
// answers a clean-up function (its timers and streams stop when the route changes).

import { apiKey, ApiError, forgetApiKey, get, setApiKey } from "./api.js";
import { h } from "./ui.js";
import { sandboxList } from "./list.js";
import { sandboxPage } from "./sandbox.js";
import { nodesPage, snapshotsPage, templatesPage, volumesPage, buildPage } from "./resources.js";
import { volumePage } from "./volumes.js";
import { keysPage } from "./keys.js";

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

let cleanup = null;

function loginPage(main) {
  const input = h("input", { type: "password", id: "api-key", name: "api-key", autocomplete: "off",
    placeholder: "e2b_…", required: true, autofocus: true });
  const error = h("p", { class: "error", id: "login-error", role: "alert" });
  const form = h("form", { class: "login", onsubmit: async (ev) => {
    ev.preventDefault();
    error.textContent = "";
    const key = input.value.trim();
    try {
      // the key is checked with a call any key may make: one sandbox of the list
      await get("/v2/sandboxes", { limit: 1 }, { key });
      setApiKey(key);
      location.hash = "#/sandboxes";
    } catch (e) {
      error.textContent = e instanceof ApiError ? e.message : "the server did not answer: " + e.message;
    }
  } },
  h("h1", {}, "aenv"),
  h("label", { for: "api-key" }, "API key"),
  input,
  h("button", { type: "submit" }, "Log in"),
  error,
  h("p", { class: "muted" }, "The key the server printed (E2B_API_KEY). It is kept in this tab only."));
  main.append(form);
  input.focus();
  return null;
}

function render() {
  if (cleanup) { try { cleanup(); } catch (_) { /* a view's clean-up never blocks the next */ } }
  cleanup = null;
  const main = document.getElementById("main");
  main.replaceChildren();
  const hash = location.hash || "#/sandboxes";
  const loggedIn = Boolean(apiKey());
  document.getElementById("nav").hidden = !loggedIn;
  if (!loggedIn || hash === "#/login") {
    if (loggedIn) { location.hash = "#/sandboxes"; return; }
    cleanup = loginPage(main);
    return;
  }
  for (const [pattern, view] of routes) {
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
