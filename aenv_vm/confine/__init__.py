"""Confinement of every QEMU the node starts, like Firecracker's jailer
(docs/security.md "QEMU confinement").

* ``policy.py``: ``Confinement``, the node's policy (``[vm] confine``: auto /
  required / off) over what this host allows (``probe_host``); it hands out a
  ``Jail`` per sandbox.
* ``jail.py``: the ``Jail`` record, the jail's file view (which host paths a
  QEMU sees, as a plan of mounts) and the child-side setup run between fork and
  exec (cgroup, namespaces, mounts, uid, death signal, no_new_privs).
* ``cgroups.py``: one control group per QEMU bounding CPU, memory and
  processes, on cgroup v2 or v1.
* ``uids.py``: host-wide leases of the uids sandboxes run as.
* ``romem.py`` (+ ``romem.c``): how QEMU 7.2 maps a memory file it may only read.
"""
