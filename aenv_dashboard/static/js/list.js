// The sandbox list: polled twice a second, paged as the API pages (100 a page, X-Next-Token),
// and virtualised: only the rows in view are in the DOM, so a page of any length (a
// gateway's merged list, a fixture of 1,000) scrolls as fast as one of ten.

import { call } from "./api.js";
import { age, h, metadataText, nodeOf, showError, until } from "./ui.js";

const POLL_MS = 500;       // a new sandbox shows within a second of its create
const ROW_HEIGHT = 36;      // px; style.css .vrow has the same height
const OVERSCAN = 8;         // rows rendered beyond the visible ones, each side
const PAGE_SIZE = 100;      // the API's largest page

const COLUMNS = [
  ["ID", (s) => s.sandboxID],
  ["State", (s) => h("span", { class: "state " + s.state }, s.state)],
  ["Template", (s) => s.alias || s.templateID],
  ["Node", nodeOf],
  ["Age", (s) => age(s.startedAt)],
  ["Ends", (s) => until(s.endAt)],
  ["CPU / RAM", (s) => `${s.cpuCount} / ${s.memoryMB} MiB`],
  ["Metadata", (s) => metadataText(s.metadata)],
];

// Filter words of the form key=value go to the API (its metadata filter, the SDK's
// encoding: each key and value quoted, the pairs joined as a form); the rest match
// any column's text here.
export function parseFilter(text) {
  const words = text.trim().split(/\s+/).filter(Boolean);
  const pairs = words.filter((w) => /^[^=]+=.*$/.test(w));
  const metadata = pairs.map((w) => {
    const i = w.indexOf("=");
    return encodeURIComponent(w.slice(0, i)) + "=" + encodeURIComponent(w.slice(i + 1));
  }).join("&");
  return { metadata, terms: words.filter((w) => !pairs.includes(w)).map((w) => w.toLowerCase()) };
}

export function matches(s, terms) {
  if (!terms.length) return true;
  const text = [s.sandboxID, s.alias, s.templateID, s.state, nodeOf(s), metadataText(s.metadata)]
    .join(" ").toLowerCase();
  return terms.every((t) => text.includes(t));
}

export function sandboxList(main) {
  let rows = [];            // the page as the API answered it
  let shown = [];           // after the local filter
  const tokens = [null];    // the token of each page visited: tokens[i] opens page i
  let page = 0;
  let nextToken = null;
  let timer = null;
  let stopped = false;
  let generation = 0;       // answers of an older query (page, filter) are dropped

  const filter = h("input", { type: "search", id: "filter", placeholder: "filter: text, or key=value for metadata",
    "aria-label": "filter sandboxes", oninput: () => { restart(); } });
  const state = h("select", { id: "state-filter", "aria-label": "state", onchange: () => { restart(); } },
    h("option", { value: "running,paused" }, "running and paused"),
    h("option", { value: "running" }, "running"),
    h("option", { value: "paused" }, "paused"));
  const prev = h("button", { type: "button", id: "prev-page", onclick: () => go(page - 1) }, "‹ Prev");
  const next = h("button", { type: "button", id: "next-page", onclick: () => go(page + 1) }, "Next ›");
  const info = h("span", { id: "list-info", class: "muted" });
  const header = h("div", { class: "vrow vhead", role: "row" }, COLUMNS.map(([t]) => h("span", { role: "columnheader" }, t)));
  const spacer = h("div", { class: "vspacer" });
  const body = h("div", { class: "vbody", id: "sandbox-rows", role: "rowgroup" }, spacer);
  const scroller = h("div", { class: "vscroll", role: "table", "aria-label": "sandboxes", onscroll: () => draw() },
    header, body);

  main.append(h("section", { class: "list" },
    h("div", { class: "toolbar" }, h("h2", {}, "Sandboxes"), filter, state, prev, next, info),
    scroller));

  function draw() {
    spacer.style.height = shown.length * ROW_HEIGHT + "px";
    const top = Math.max(0, scroller.scrollTop - header.offsetHeight);
    const first = Math.max(0, Math.floor(top / ROW_HEIGHT) - OVERSCAN);
    const last = Math.min(shown.length, Math.ceil((top + scroller.clientHeight) / ROW_HEIGHT) + OVERSCAN);
    const now = Date.now();
    const nodes = [];
    for (let i = first; i < last; i++) {
      const s = shown[i];
      const row = h("a", { class: "vrow", role: "row", href: "#/sandboxes/" + encodeURIComponent(s.sandboxID),
        "data-id": s.sandboxID, "data-index": String(i) },
      COLUMNS.map(([, cell]) => h("span", { role: "cell" }, cell(s, now))));
      row.style.top = i * ROW_HEIGHT + "px";
      nodes.push(row);
    }
    // the rows are new each poll: a row that had the keyboard's focus gets it back
    const focused = body.contains(document.activeElement) ? document.activeElement.dataset.id : null;
    body.replaceChildren(spacer, ...nodes);
    if (focused) {
      const again = nodes.find((n) => n.dataset.id === focused);
      if (again) again.focus({ preventScroll: true });
    }
    prev.disabled = page === 0;
    next.disabled = !nextToken;
  }

  async function poll() {
    const gen = generation;
    const { metadata, terms } = parseFilter(filter.value);
    try {
      const { body: list, headers } = await call("GET", "/v2/sandboxes", {
        query: { state: state.value.split(","), limit: PAGE_SIZE, nextToken: tokens[page], metadata } });
      if (gen !== generation || stopped) return;
      rows = list || [];
      nextToken = headers.get("X-Next-Token");
      shown = rows.filter((s) => matches(s, terms));
      const running = headers.get("X-Total-Running");
      info.textContent = `page ${page + 1}: ${shown.length} of ${rows.length} shown` +
        (running !== null ? ` · ${running} running in all` : "");
      draw();
    } catch (e) {
      if (gen === generation && !stopped) showError(e);
    }
    if (gen === generation && !stopped) timer = setTimeout(poll, POLL_MS);
  }

  function restart() {
    generation++;
    clearTimeout(timer);
    poll();
  }

  function go(to) {
    if (to < 0) return;
    if (to > page) {
      if (!nextToken) return;
      tokens[to] = nextToken;
    }
    page = to;
    tokens.length = page + 1;
    scroller.scrollTop = 0;
    restart();
  }

  restart();
  return () => { stopped = true; clearTimeout(timer); };
}
