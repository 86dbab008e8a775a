"""Template builds: E2B's build model (a base image or template, a list of steps,
a start and a ready command) run in a build VM, one store layer per step, a build
cache keyed by (parent, step, copied files), and the running VM frozen as the
template (docs/templates.md)."""
