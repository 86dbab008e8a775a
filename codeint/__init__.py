"""The in-guest code interpreter: the execution server the ``e2b-code-interpreter`` SDK
talks to on port 49999 (docs/code-interpreter.md).

Runs inside the sandbox on the guest's own Python; Python cells run in IPython
(Debian's ``python3-ipython``, pykernel.py). It imports nothing of the host packages
(like ``envd/``)."""

CODEINT_PORT = 49999
ENVD_PORT = 49983
DEFAULT_CWD = "/home/user"
