"""QEMU process control: the QMP client (qmp.py), command-line building and
process launch (launcher.py), device-state save/load (migration.py), the
accelerator probe (accel.py). Guests are brought up through aenv_vm/machine:
besides the probe's bare kernel, nothing else starts a QEMU."""
