# Run by every Python kernel of the code interpreter before the first cell
# (pykernel.main, in the user's namespace: everything is inside a function that
# deletes itself). It registers the MIME types the E2B SDKs map
# beyond Jupyter's own.
def _codeint_setup():
    import importlib.util
    import json
    import os
    import sys

    import IPython
    from IPython.core.formatters import BaseFormatter, JSONFormatter
    from traitlets import ObjectName, Unicode

    spec = importlib.util.spec_from_file_location(
        "_codeint_charts", os.path.join(os.path.dirname(os.path.realpath(_CODEINT_STARTUP)), "charts.py"))
    charts = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(charts)

    def jsonable(value):
        return json.loads(json.dumps(value, default=str))

    class DataFormatter(BaseFormatter):
        """A pandas DataFrame as columns of plain values (the SDK's ``data``)."""
        format_type = Unicode("e2b/data")
        print_method = ObjectName("_repr_e2b_data_")
        _return_type = (dict, str)

        def __call__(self, obj):
            pd = sys.modules.get("pandas")   # a DataFrame exists only if pandas was imported
            if pd is None or not isinstance(obj, pd.DataFrame) or obj.size > 100_000:
                return super().__call__(obj)
            return jsonable({str(k): [v.isoformat() if hasattr(v, "isoformat") else v for v in col]
                             for k, col in obj.to_dict(orient="list").items()})

    class ChartFormatter(BaseFormatter):
        """A matplotlib figure's data (the SDK's ``chart``)."""
        format_type = Unicode("e2b/chart")
        print_method = ObjectName("_repr_e2b_chart_")
        _return_type = (dict, str)

        def __call__(self, obj):
            mpl = sys.modules.get("matplotlib.figure")
            if mpl is None or not isinstance(obj, mpl.Figure):
                return super().__call__(obj)
            try:
                chart = charts.figure_chart(obj)
                return jsonable(chart) if chart else None
            except Exception:
                return None

    class PlainJSONFormatter(JSONFormatter):
        """Lists and dicts also as ``application/json`` (E2B's ``result.json``)."""
        def __call__(self, obj):
            if isinstance(obj, (list, dict)):
                try:
                    return jsonable(obj), {"expanded": True}
                except (TypeError, ValueError):
                    pass
            return super().__call__(obj)

    # `kill -USR1 <kernel>` writes every thread's stack to the kernel's log (sys.__stderr__) (a hung or
    # spinning kernel can be looked at from a shell in the sandbox)
    import faulthandler
    import signal
    faulthandler.register(signal.SIGUSR1, file=sys.__stderr__, all_threads=True)

    ip = IPython.get_ipython()
    fmt = ip.display_formatter
    fmt.formatters["e2b/data"] = DataFormatter(parent=fmt)
    fmt.formatters["e2b/chart"] = ChartFormatter(parent=fmt)
    fmt.formatters["application/json"] = PlainJSONFormatter(parent=fmt)


_CODEINT_STARTUP = __file__ if "__file__" in globals() else "/opt/aenv/codeint/ipython_startup.py"
_codeint_setup()
del _codeint_setup, _CODEINT_STARTUP
