"""The guest tools: envd and the runtime it needs, installed into any image's root
filesystem under /.aenv so the image boots as a sandbox (docs/tools.md)."""
from .install import InstallReport, ToolsInstallError, install_tools
from .tree import TOOLS_DIR, TOOLS_INIT, TOOLS_KEY_META, ToolsTree

__all__ = ["InstallReport", "TOOLS_DIR", "TOOLS_INIT", "TOOLS_KEY_META", "ToolsInstallError", "ToolsTree",
           "install_tools"]
