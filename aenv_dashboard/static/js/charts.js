// Line charts drawn as SVG: one series over time, its samples marked, the newest value
// in the title. The chart says how many samples it holds (data-samples) for whoever reads it.

const SVG = "http://www.w3.org/2000/svg";
const W = 360;
const H = 140;
const PAD = { left: 62, right: 10, top: 10, bottom: 22 };

function svg(tag, attrs = {}, text) {
  const el = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs)) el.setAttribute(k, String(v));
  if (text !== undefined) el.textContent = text;
  return el;
}

// points: [{t: ms since the epoch, v: number}] oldest first; max: the y axis' top (>0);
// format: a value as text.
export function lineChart({ id, title, points, max, format }) {
  const figure = document.createElement("figure");
  figure.className = "chart";
  figure.id = id;
  figure.dataset.samples = String(points.length);
  const newest = points.length ? format(points[points.length - 1].v) : "no samples yet";
  const caption = document.createElement("figcaption");
  caption.textContent = `${title}: ${newest}`;
  const top = Math.max(max || 0, ...points.map((p) => p.v), 1e-9);
  const t0 = points.length ? points[0].t : 0;
  const t1 = points.length > 1 ? points[points.length - 1].t : t0 + 1;
  const x = (t) => PAD.left + ((t - t0) / (t1 - t0)) * (W - PAD.left - PAD.right);
  const y = (v) => H - PAD.bottom - (v / top) * (H - PAD.top - PAD.bottom);
  const root = svg("svg", { viewBox: `0 0 ${W} ${H}`, role: "img", "aria-label": caption.textContent });
  for (const frac of [0, 0.5, 1]) {
    const yy = y(top * frac);
    root.append(svg("line", { x1: PAD.left, x2: W - PAD.right, y1: yy, y2: yy, class: "gridline" }));
    root.append(svg("text", { x: PAD.left - 4, y: yy + 4, "text-anchor": "end", class: "axis" }, format(top * frac)));
  }
  if (points.length) {
    const span = Math.round((t1 - t0) / 1000);
    root.append(svg("text", { x: W - PAD.right, y: H - 6, "text-anchor": "end", class: "axis" },
      points.length > 1 ? `last ${span}s` : "one sample"));
    root.append(svg("polyline", { class: "series", points: points.map((p) => `${x(p.t)},${y(p.v)}`).join(" ") }));
    for (const p of points) root.append(svg("circle", { class: "sample", cx: x(p.t), cy: y(p.v), r: 2.5 }));
  }
  figure.append(caption, root);
  return figure;
}
