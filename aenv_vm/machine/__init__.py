"""Machines: the one way a VM comes up on a node, and the one way it goes.

Every QEMU the project runs with a guest in it comes up through ``bring_up`` (a
sandbox's restore, a cold boot from a paused sandbox's disk, a template build's VM,
the base template's boot) or ``start_standby`` (a paused sandbox's next QEMU), and
goes through ``teardown``. Nothing outside this package and aenv_vm/qemu/ starts a
QEMU (tests/test_imports.py says so).

plan.py      MachinePlan and its modes (restore, cold_boot, build), Shape, Disk, Greeting
host.py      Host: what a node lends its machines; standalone_host for the base template's boot
spec.py      a plan's VmSpec, and where its envd is reached
bringup.py   bring_up (disk, NBD export, jail, network, QEMU, state, envd greeting), start_standby
machine.py   Machine (a running one), teardown, halt (stopped for a freeze)
"""
