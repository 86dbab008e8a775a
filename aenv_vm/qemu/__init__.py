"""QEMU process control: the QMP client (qmp.py), command-line building and
process launch (launcher.py), device-state save/load (migration.py)."""
