"""The sandbox lifecycle of one node (its states and what each operation does in them:
aenv_vm/states.py; the modules that move a sandbox are drawn in manager.py).

manager.py    SandboxManager: the facade that sequences every operation
node_service.py NodeSandboxService: the manager behind aenv_vm.service.SandboxService
runtime.py    NodeRuntime: store, NBD server, networks, guest, run dir, template files (the
              Host of the node's machines)
sandbox.py    Sandbox: a running VM's handle, where it is reached
restore.py    restores as machine restores (aenv_vm/machine): create, pool refill, resume,
              fork children; and a sandbox's teardown
coldboot.py   filesystem-only pauses and cold boot: a paused sandbox booted from its disk
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
lazymem.py    the node's lazy memory mount (memory images served page by page)
metrics.py    the guests' metrics, sampled every 5 s
"""
