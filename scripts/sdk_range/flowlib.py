"""What flows.py and flows_ci.py share: running one flow and printing its line,
``<version>\\t<flow>\\tPASS|FAIL|NONE[\\twhy]``. Standard library only (it runs in every
SDK version's venv, imported from the script's own directory)."""
from __future__ import annotations

import sys
import traceback
from typing import Any, Callable


class Missing(Exception):
    """The SDK version has no such call."""


def need(obj: Any, *names: str) -> Any:
    for name in names:
        if hasattr(obj, name):
            return getattr(obj, name)
    raise Missing("/".join(names))


def runner(version: str) -> Callable[[str, Callable[[], object]], bool]:
    """``flow(name, fn)``: runs ``fn`` and prints its line for ``version``; False if it failed."""
    def flow(name: str, fn: Callable[[], object]) -> bool:
        try:
            fn()
        except Missing as e:
            print(f"{version}\t{name}\tNONE\tno {e} in this version", flush=True)
            return True
        except Exception as e:  # noqa: BLE001 - reported, one line per flow
            why = f"{type(e).__name__}: {e}".replace("\n", " ")[:300]
            if "-v" in sys.argv:
                traceback.print_exc()
            print(f"{version}\t{name}\tFAIL\t{why}", flush=True)
            return False
        print(f"{version}\t{name}\tPASS", flush=True)
        return True
    return flow
