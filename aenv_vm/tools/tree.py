"""The guest tools tree a node has: where it is and what it is (its build key).

Built by the guest build's "tools" stage (fixtures/guest_tools.py) and found
through ``GuestImage.tools_tree``; installed into images by install.py.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

TOOLS_DIR = ".aenv"                 # the tools' directory in an image's root
TOOLS_INIT = f"/{TOOLS_DIR}/init"   # what the initramfs starts in an image that has it
TOOLS_KEY_META = "tools_key"        # image record meta: the key of the tools it was converted with


@dataclass(frozen=True)
class ToolsTree:
    path: Path                      # the tree that becomes /.aenv
    key: str

    def exists(self) -> bool:
        return (self.path / "init").is_file() and (self.path / "envd" / "__main__.py").is_file()

    def describe(self) -> dict:
        """tools.json of the tree (what the build put in it), or {} if unreadable."""
        try:
            data = json.loads((self.path / "tools.json").read_text())
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}
