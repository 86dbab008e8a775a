"""Which team may do what with an E2B template (the builder's records: ``owner`` on
each template definition, aenv_vm/builds/records.py).

- A template, its tags, builds, build logs and upload URLs are its team's: another
  team's id or name is answered 404, as one that does not exist (ids are no oracle).
- A template made **public** (``PATCH /templates/{id}`` ``{"public": true}``, E2B's
  ``TemplateUpdateRequest``) can also be read (get, alias), created from and built from
  by every team; it stays its team's to change, tag, rebuild and delete.
- The node's own templates are every team's to read and use: ``base`` (and whatever
  the node's base template is called) and ``code-interpreter-v1`` (the code interpreter
  SDK's default, docs/code-interpreter.md), which stays public whoever built it. A
  template that is no E2B template (a snapshot, a template record made by ``aenv
  template``'s CLI build before builds had records) is not judged here.
- Names are one namespace across the node's teams (E2B's aliases before its team
  namespaces, ``team-slug/alias``, which aenv does not have): a name another team holds
  is refused with 409 when a build asks for it.
- A template recorded before teams existed has no owner: the default team's."""
from __future__ import annotations

from aenv_vm.builds.template_builds import TemplateBuilds, TemplateView
from aenv_vm.errors import VmError

from .errors import ApiError
from .keystore import DEFAULT_TEAM_ID

CODE_INTERPRETER = "code-interpreter-v1"
NODE_PUBLIC = ("base", CODE_INTERPRETER)


def owner_of(team_id: str) -> str:
    """A team as the builder's records name it ("" the default team)."""
    return "" if team_id == DEFAULT_TEAM_ID else team_id


def unknown(ref: str) -> ApiError:
    """The answer to a template that does not exist (the builder's own words)."""
    return ApiError(404, f"unknown template {ref!r}")


class TemplateAccess:
    def __init__(self, builds: TemplateBuilds) -> None:
        self.builds = builds

    def node_public(self, ref: str) -> bool:
        name = ref.split(":", 1)[0].lower()
        return name in NODE_PUBLIC or name == self.builds.settings.base_template

    def view(self, ref: str) -> TemplateView | None:
        """The E2B template ``ref`` names, None when it names none."""
        try:
            return self.builds.get(ref)
        except VmError:
            return None

    def is_template(self, ref: str) -> bool:
        """Whether ``ref`` names an E2B template (the node's own, or one with a build record)."""
        return self.node_public(ref) or self.view(ref) is not None

    def may_read(self, view: TemplateView, team_id: str) -> bool:
        return view.owner == owner_of(team_id) or view.public or view.template_id in NODE_PUBLIC

    def check_own(self, ref: str, team_id: str, message: str = "") -> None:
        """404 unless ``ref`` is no E2B template or ``team_id``'s own; ``message``: what the
        route answers a template or build that does not exist (default: ``unknown``'s), so
        the two answers are the same."""
        v = self.view(ref)
        if v is not None and v.owner != owner_of(team_id):
            raise ApiError(404, message) if message else unknown(ref)

    @staticmethod
    def no_build(ref: str, build_id: str) -> str:
        """The builder's answer to a build it does not have (template_builds.py)."""
        return f"no build {build_id} of template {ref}"

    def check_read(self, ref: str, team_id: str) -> None:
        """404 unless ``team_id`` may read and use ``ref`` (its own, public, or the node's)."""
        if self.node_public(ref):
            return
        v = self.view(ref)
        if v is not None and not self.may_read(v, team_id):
            raise unknown(ref)
