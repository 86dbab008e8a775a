"""aenv_vm: layered block images over NBD, the QEMU microvm driver, memory and
disk snapshots, fork and the sandbox lifecycle. Uses aenv_store; never aenv_api."""
