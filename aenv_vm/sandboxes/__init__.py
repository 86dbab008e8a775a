"""The sandbox lifecycle of one node (its states and what each operation does in them:
aenv_vm/states.py; the modules that move a sandbox are drawn in manager.py).

manager.py    SandboxManager: the facade that sequences every operation
node_service.py NodeSandboxService: the manager behind aenv_vm.service.SandboxService
runtime.py    NodeRuntime: store, NBD server, networks, guest, run dir, template files
sandbox.py    Sandbox: a running VM's handle, where it is reached
restore.py    the one restore path (create, pool refill, resume, fork children)
capture.py    stop a VM and take its device state and private pages
pause.py      pause, the background commit, standby QEMUs
resume.py     resume from a pause (local files or the store)
snapshots.py  named snapshots (templates made from running sandboxes)
fork.py       fork: children from a hidden snapshot
pool.py       the warm pool
ttl.py        TTL expiry watcher
recovery.py   what a restarted node does with its records
records.py    the sandbox records (LMDB)
handover.py   adopt and release: a paused sandbox moving between nodes of one repository
"""
