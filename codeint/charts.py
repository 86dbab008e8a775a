"""A matplotlib figure as the chart object the E2B SDKs parse (``e2b/chart``): the
figure's type (line, scatter, bar, pie; several axes make a ``superchart``), titles,
labels, units, ticks and the plotted data. Runs inside the kernel, on the user's figure;
anything it does not recognise is ``{"type": "unknown"}`` with no elements."""
from __future__ import annotations

import datetime as _dt
import re
from typing import Any

_UNIT = re.compile(r"\s\((.*?)\)|\[(.*?)\]")


def _plain(v: Any) -> Any:
    """A JSON-ready scalar: numpy numbers as floats/ints, dates as ISO strings."""
    if isinstance(v, (_dt.date, _dt.datetime)):
        return v.isoformat()
    if hasattr(v, "dtype") and getattr(v.dtype, "kind", "") == "M":     # numpy datetime64
        return str(v.astype("datetime64[s]"))
    if hasattr(v, "item"):
        v = v.item()
    if isinstance(v, float) and v != v:
        return None
    return v if isinstance(v, (str, int, float, bool)) or v is None else str(v)


def _label(text: str) -> str | None:
    return text or None


def _unit(label: str | None) -> str | None:
    m = _UNIT.search(label or "")
    return (m.group(1) or m.group(2)) if m else None


def _is_grid(line: Any) -> bool:
    xs, ys = list(line.get_xdata()), list(line.get_ydata())
    return len(xs) == 2 and (xs[0] == xs[1] or ys[0] == ys[1]) and str(line.get_label()).startswith("_")


def _kind(ax: Any) -> str:
    from matplotlib.collections import PathCollection
    from matplotlib.lines import Line2D
    from matplotlib.patches import Rectangle, Wedge
    from matplotlib.text import Text
    children = getattr(ax, "_children", None)    # what the user added (matplotlib >= 3.5)
    if children is None:
        children = [*ax.lines, *ax.collections, *ax.patches]
    objs = [o for o in children if not isinstance(o, Text)]
    objs = [o for o in objs if not (isinstance(o, Line2D) and _is_grid(o))]
    if not objs:
        return "unknown"
    if all(isinstance(o, Line2D) for o in objs):
        return "line"
    if all(isinstance(o, PathCollection) for o in objs):
        return "scatter"
    if all(isinstance(o, Wedge) for o in objs):
        return "pie"
    if all(isinstance(o, Rectangle) for o in objs) and ax.containers:
        return "bar"
    return "unknown"


def _axis(ax: Any, which: str) -> dict[str, Any]:
    axis = ax.xaxis if which == "x" else ax.yaxis
    ticks = [_plain(t) for t in (ax.get_xticks() if which == "x" else ax.get_yticks())]
    labels = [t.get_text() for t in (ax.get_xticklabels() if which == "x" else ax.get_yticklabels())]
    scale = ax.get_xscale() if which == "x" else ax.get_yscale()
    conv = type(getattr(axis, "converter", None) or getattr(axis, "get_converter", lambda: None)()).__name__
    if "Date" in conv:
        import matplotlib.dates as mdates
        ticks = [mdates.num2date(t).isoformat() for t in ticks]
        scale = "datetime"
    elif scale == "linear" and labels and any(lb for lb in labels) and all(
            t == i and lb != str(i) for i, (t, lb) in enumerate(zip(ticks, labels))):
        scale = "categorical"
    return {f"{which}_ticks": ticks, f"{which}_tick_labels": labels, f"{which}_scale": scale}


def _two_d(ax: Any, kind: str) -> dict[str, Any]:
    x, y = _label(ax.get_xlabel()), _label(ax.get_ylabel())
    return {"type": kind, "title": _label(ax.get_title()), "x_label": x, "y_label": y,
            "x_unit": _unit(x), "y_unit": _unit(y), "elements": []}


def axes_chart(ax: Any) -> dict[str, Any]:
    kind = _kind(ax)
    if kind in ("line", "scatter"):
        chart = _two_d(ax, kind)
        chart.update(_axis(ax, "x"))
        chart.update(_axis(ax, "y"))
        if kind == "line":
            for i, ln in enumerate(ax.get_lines()):
                if _is_grid(ln):
                    continue
                label = str(ln.get_label())
                chart["elements"].append({
                    "label": f"Line {i}" if label.startswith("_") else label,
                    "points": [[_plain(a), _plain(b)] for a, b in zip(ln.get_xdata(), ln.get_ydata())]})
        else:
            for i, coll in enumerate(ax.collections):
                label = str(coll.get_label())
                chart["elements"].append({
                    "label": f"Series {i}" if label.startswith("_") else label,
                    "points": [[_plain(a), _plain(b)] for a, b in coll.get_offsets()]})
        return chart
    if kind == "bar":
        chart = _two_d(ax, "bar")
        for i, cont in enumerate(ax.containers):
            group = str(cont.get_label())
            group = f"Group {i}" if group.startswith("_") else group
            rects = list(cont)
            horizontal = len(rects) > 1 and len({r.get_height() for r in rects}) == 1 and \
                len({r.get_width() for r in rects}) > 1
            labels = [t.get_text() for t in (ax.get_yticklabels() if horizontal else ax.get_xticklabels())]
            ticks = list(ax.get_yticks() if horizontal else ax.get_xticks())
            for r in rects:
                pos = r.get_y() + r.get_height() / 2 if horizontal else r.get_x() + r.get_width() / 2
                tick_label = next((lb for t, lb in zip(ticks, labels) if abs(t - pos) < 1e-6), None)
                chart["elements"].append({"label": tick_label if tick_label is not None else str(_plain(pos)),
                                          "group": group,
                                          "value": _plain(r.get_width() if horizontal else r.get_height())})
            if horizontal:
                chart["x_label"], chart["y_label"] = chart["y_label"], chart["x_label"]
                chart["x_unit"], chart["y_unit"] = chart["y_unit"], chart["x_unit"]
        return chart
    if kind == "pie":
        from matplotlib.text import Text
        texts = [t.get_text() for t in ax.get_children() if isinstance(t, Text) and t.get_text()]
        elements = []
        for i, w in enumerate(ax.patches):
            label = str(w.get_label())
            elements.append({"label": texts[i] if label.startswith("_") and i < len(texts) else label,
                             "angle": _plain(abs(w.theta2 - w.theta1)), "radius": _plain(w.r)})
        return {"type": "pie", "title": _label(ax.get_title()), "elements": elements}
    return {"type": "unknown", "title": _label(ax.get_title()), "elements": []}


def figure_chart(fig: Any) -> dict[str, Any] | None:
    axes = [ax for ax in fig.get_axes() if ax.has_data()]
    if not axes:
        return None
    if len(axes) == 1:
        return axes_chart(axes[0])
    title = fig._suptitle.get_text() if getattr(fig, "_suptitle", None) is not None else None
    return {"type": "superchart", "title": title or None, "elements": [axes_chart(ax) for ax in axes]}
