// A terminal in the browser: xterm.js (vendored by scripts/install.sh) over envd's PTY API,
// as the SDK's sandbox.pty does it: process.Process/Start with a pty (a Connect server
// stream of output events), SendInput for keystrokes, Update for the size.

import { fromBase64, rpc, rpcStream, toBase64 } from "./envd.js";
import { h, showError } from "./ui.js";

function loadStyles() {
  if (document.getElementById("xterm-css")) return;
  document.head.append(h("link", { rel: "stylesheet", id: "xterm-css", href: "/dashboard/vendor/xterm.css" }));
}

export function terminalPanel(sandbox) {
  loadStyles();
  const screen = h("div", { id: "terminal", class: "terminal" });
  const status = h("p", { class: "muted", id: "terminal-status" }, "starting a shell…");
  const panel = h("section", { class: "term" }, status, screen);
  const abort = new AbortController();
  let pid = null;
  let closed = false;
  let sending = Promise.resolve();

  (async () => {
    let Terminal, FitAddon;
    try {
      ({ Terminal } = await import("/dashboard/vendor/xterm.mjs"));
      ({ FitAddon } = await import("/dashboard/vendor/addon-fit.mjs"));
    } catch (e) {
      status.textContent = "the terminal's assets are not built: run scripts/install.sh (xterm.js from npm)";
      return;
    }
    const term = new Terminal({ cursorBlink: true, convertEol: false, fontSize: 14, scrollback: 5000 });
    const fit = new FitAddon();
    term.loadAddon(fit);
    term.open(screen);
    try { fit.fit(); } catch (_) { /* not laid out yet: the default size stays */ }
    const encoder = new TextEncoder();
    term.onData((text) => {
      if (pid === null) return;
      const data = toBase64(encoder.encode(text));
      // in order, one call after another: keystrokes must reach the shell as typed
      sending = sending.then(() => rpc(sandbox, "process.Process/SendInput",
        { process: { pid }, input: { pty: data } })).catch((e) => { if (!closed) showError(e); });
    });
    const onResize = () => {
      try { fit.fit(); } catch (_) { return; }
      if (pid !== null) rpc(sandbox, "process.Process/Update",
        { process: { pid }, pty: { size: { cols: term.cols, rows: term.rows } } }).catch(() => {});
    };
    window.addEventListener("resize", onResize);
    abort.signal.addEventListener("abort", () => { window.removeEventListener("resize", onResize); term.dispose(); });
    try {
      await rpcStream(sandbox, "process.Process/Start", {
        process: { cmd: "/bin/bash", args: ["-i", "-l"], envs: { TERM: "xterm-256color" }, cwd: "/home/user" },
        pty: { size: { cols: term.cols, rows: term.rows } },
      }, (msg) => {
        const ev = msg.event || {};
        if (ev.start) {
          pid = ev.start.pid;
          status.textContent = `shell pid ${pid} (${term.cols}×${term.rows})`;
          panel.dataset.ready = "true";
          term.focus();
        } else if (ev.data && ev.data.pty) {
          term.write(fromBase64(ev.data.pty));
        } else if (ev.end) {
          status.textContent = `the shell exited (${ev.end.status || ev.end.exitCode || "done"})`;
        }
      }, abort.signal);
    } catch (e) {
      if (!closed) { status.textContent = "terminal closed: " + e.message; }
    }
  })();

  return { panel, close: () => {
    closed = true;
    if (pid !== null) rpc(sandbox, "process.Process/SendSignal", { process: { pid }, signal: "SIGNAL_SIGKILL" })
      .catch(() => {});
    abort.abort();
  } };
}
