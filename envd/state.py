"""Sandbox-wide settings that /init changes at run time."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field

from . import users

log = logging.getLogger("envd")


@dataclass
class EnvdState:
    default_user: str = "user"
    access_token: str | None = None
    env_vars: dict[str, str] = field(default_factory=dict)
    default_workdir: str | None = None
    sync_clock: bool = False
    set_identity: bool = False  # /init may set the hostname and reseed the kernel RNG (guest only)

    def user(self, requested: str | None) -> users.User:
        """The user for an operation: the requested one (must exist), else the
        default one, else -- when the default does not exist on this system,
        e.g. envd on a bare host -- the user envd runs as."""
        if requested:
            return users.lookup(requested)
        try:
            return users.lookup(self.default_user)
        except users.UnknownUser:
            return users.current()

    def base_env(self, user: users.User) -> dict[str, str]:
        env = {
            "PATH": os.environ.get("PATH", "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"),
            "HOME": user.home,
            "USER": user.name,
            "LOGNAME": user.name,
            "SHELL": user.shell,
        }
        for key in ("LANG", "LC_ALL", "TZ"):
            if key in os.environ:
                env[key] = os.environ[key]
        env.update(self.env_vars)
        return env
