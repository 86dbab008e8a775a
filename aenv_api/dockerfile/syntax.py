"""Dockerfile syntax: text → instructions, and Docker's word rules.

Follows BuildKit's reading of a Dockerfile (the rules `docker build` applies):
parser directives (``# escape=``, ``# syntax=``, ``# check=``) only before anything
else; ``#`` comment lines, also inside a continuation; a line ending in the escape
character continues on the next one (the lines are joined as they are); RUN, COPY
and ADD may carry heredocs (``<<EOF`` … ``EOF``) whose bodies follow the line.

Words (``Lexer``): outside quotes the escape character takes the next character
literally; ``'…'`` is literal; in ``"…"`` the escape character escapes only ``"``,
``$`` and itself. ``$NAME``, ``${NAME}`` and ``${NAME:-word}`` / ``-`` / ``:+`` /
``+`` / ``:?`` / ``?`` are substituted from a resolver. A name the resolver does not
know (not declared by an ARG or ENV of this Dockerfile: e.g. the base image's
``PATH``) is kept as written, so the build server can expand it in the image's
environment, as Docker takes such names from the image's config.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Callable

from . import DockerfileError

Resolver = Callable[[str], "str | None"]   # a variable's value; None = unknown here

_DIRECTIVE = re.compile(r"^#\s*([a-zA-Z][a-zA-Z0-9]*)\s*=\s*(.+?)\s*$")
_DIRECTIVES = {"syntax", "escape", "check"}
_HEREDOC_KEYWORDS = {"RUN", "COPY", "ADD"}
_HEREDOC = re.compile(r"""^<<(-?)(?:"([^"]+)"|'([^']+)'|([A-Za-z0-9_.\-]+))$""")
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_SPACE = " \t\r\n\f\v"


@dataclass(frozen=True)
class Heredoc:
    name: str
    content: str        # the body, every line with its newline
    expand: bool        # an unquoted name: the body is subject to $VAR substitution
    chomp: bool         # <<-: leading tabs are stripped from the body's lines


@dataclass(frozen=True)
class Instruction:
    keyword: str                      # upper case: RUN, COPY, …
    text: str                         # what follows the keyword, continuation lines joined
    line: int                         # 1-based line of the keyword
    heredocs: tuple[Heredoc, ...] = ()


@dataclass(frozen=True)
class Dockerfile:
    instructions: tuple[Instruction, ...]
    escape: str = "\\"


def parse(text: str) -> Dockerfile:
    """Split a Dockerfile into instructions. Syntax errors name their line."""
    lines = text.lstrip("\ufeff").splitlines()
    escape = "\\"
    i = 0
    seen: set[str] = set()
    while i < len(lines):            # parser directives: only at the very top
        m = _DIRECTIVE.match(lines[i])
        if not m or m.group(1).lower() not in _DIRECTIVES:
            break
        key = m.group(1).lower()
        if key in seen:
            raise DockerfileError(f"only one {key} parser directive can be used", i + 1)
        seen.add(key)
        if key == "escape":
            if m.group(2) not in ("\\", "`"):
                raise DockerfileError(f"invalid escape token {m.group(2)!r}: it must be \\ or `", i + 1)
            escape = m.group(2)
        i += 1
    continuation = re.compile(re.escape(escape) + r"[ \t]*$")
    out: list[Instruction] = []
    while i < len(lines):
        start = i
        line = lines[i]
        i += 1
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        parts = [line]
        while continuation.search(parts[-1]):
            parts[-1] = continuation.sub("", parts[-1])
            # comment and empty lines inside a continuation are dropped, as BuildKit does
            while i < len(lines) and (not lines[i].strip() or lines[i].lstrip().startswith("#")):
                i += 1
            if i >= len(lines):
                break
            parts.append(lines[i])
            i += 1
        joined = "".join(parts).strip()
        m = re.match(r"(\S+)\s*(.*)", joined, re.S)
        keyword, rest = (m.group(1).upper(), m.group(2).strip()) if m else ("", "")
        if not re.fullmatch(r"[A-Z]+", keyword):
            raise DockerfileError(f"not an instruction: {joined[:60]!r}", start + 1)
        heredocs: list[Heredoc] = []
        if keyword in _HEREDOC_KEYWORDS and "<<" in rest and not rest.startswith("["):
            for chomp, name, expand in heredoc_markers(rest, escape):
                body: list[str] = []
                while True:
                    if i >= len(lines):
                        raise DockerfileError(f"heredoc {name!r} has no terminating {name!r} line", start + 1)
                    cur = lines[i]
                    i += 1
                    if (cur.lstrip("\t") if chomp else cur) == name:
                        break
                    body.append((cur.lstrip("\t") if chomp else cur) + "\n")
                heredocs.append(Heredoc(name, "".join(body), expand, chomp))
        out.append(Instruction(keyword, rest, start + 1, tuple(heredocs)))
    return Dockerfile(tuple(out), escape)


def raw_words(text: str, escape: str = "\\") -> list[str]:
    """Split on whitespace outside quotes, keeping quotes and escapes as written."""
    words: list[str] = []
    cur: list[str] = []
    quote = ""
    in_word = False
    i = 0
    while i < len(text):
        ch = text[i]
        if quote:
            cur.append(ch)
            if ch == escape and quote == '"' and i + 1 < len(text):
                cur.append(text[i + 1])
                i += 1
            elif ch == quote:
                quote = ""
        elif ch in _SPACE:
            if in_word:
                words.append("".join(cur))
                cur, in_word = [], False
        else:
            in_word = True
            cur.append(ch)
            if ch == escape and i + 1 < len(text):
                cur.append(text[i + 1])
                i += 1
            elif ch in "'\"":
                quote = ch
        i += 1
    if in_word:
        words.append("".join(cur))
    return words


def heredoc_markers(text: str, escape: str = "\\") -> list[tuple[bool, str, bool]]:
    """(chomp, name, expand) of each heredoc marker word (``<<EOF``, ``<<-"EOF"``); a
    quoted word such as ``"<<EOF"`` is a literal, not a marker."""
    found = []
    for word in raw_words(text, escape):
        m = _HEREDOC.match(word)
        if m:
            name = m.group(2) or m.group(3) or m.group(4)
            found.append((m.group(1) == "-", name, m.group(4) is not None))
    return found


def split_flags(text: str, escape: str = "\\") -> tuple[list[tuple[str, str | None, str]], str]:
    """Leading ``--name[=value]`` words → [(name, value or None, raw word)], and the rest
    of the text exactly as written (a shell-form RUN keeps its spacing and quotes)."""
    flags: list[tuple[str, str | None, str]] = []
    pos = 0
    while True:
        while pos < len(text) and text[pos] in _SPACE:
            pos += 1
        if not text.startswith("--", pos):
            break
        word = raw_words(text[pos:], escape)[0]
        body = word[2:]
        name, sep, value = body.partition("=")
        flags.append((name, Lexer(escape).word(value, lambda _n: None) if sep else None, word))
        pos += len(word)
    return flags, text[pos:].strip()


def json_form(text: str) -> list[str] | None:
    """The exec (JSON array of strings) form, or None for the shell form (Docker treats
    text that is not a valid JSON string array as a shell command)."""
    if not text.startswith("["):
        return None
    try:
        value = json.loads(text)
    except ValueError:
        return None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        return None
    return value


class Lexer:
    """Docker's word processing (see the module docstring) for one escape character."""

    def __init__(self, escape: str = "\\") -> None:
        self.escape = escape

    def word(self, text: str, env: Resolver, line: int | None = None) -> str:
        """The whole text as one word (whitespace kept), quotes removed, variables substituted."""
        return _Scan(text, self.escape, env, line).run(split=False, quotes=True)[0]

    def words(self, text: str, env: Resolver, line: int | None = None) -> list[str]:
        """Split on whitespace outside quotes; quotes removed, variables substituted."""
        return _Scan(text, self.escape, env, line).run(split=True, quotes=True)

    def substitute(self, text: str, env: Resolver, line: int | None = None) -> str:
        """Variables only; quotes are ordinary characters (the strings of a JSON form)."""
        return _Scan(text, self.escape, env, line).run(split=False, quotes=False)[0]


class _Scan:
    def __init__(self, text: str, escape: str, env: Resolver, line: int | None) -> None:
        self.text, self.escape, self.env, self.line = text, escape, env, line
        self.pos = 0

    def error(self, message: str) -> DockerfileError:
        return DockerfileError(message, self.line)

    def run(self, split: bool, quotes: bool) -> list[str]:
        words: list[str] = []
        cur: list[str] = []
        in_word = False
        t = self.text
        while self.pos < len(t):
            ch = t[self.pos]
            self.pos += 1
            if split and ch in _SPACE:
                if in_word:
                    words.append("".join(cur))
                    cur, in_word = [], False
                continue
            in_word = True
            if ch == self.escape and quotes:
                if self.pos < len(t):          # an escape at the very end is dropped, as Docker does
                    cur.append(t[self.pos])
                    self.pos += 1
            elif ch == "'" and quotes:
                end = t.find("'", self.pos)
                if end < 0:
                    raise self.error("unterminated single quote")
                cur.append(t[self.pos:end])
                self.pos = end + 1
            elif ch == '"' and quotes:
                cur.append(self.double_quoted())
            elif ch == "$":
                cur.append(self.variable())
            else:
                cur.append(ch)
        if in_word or not split:
            words.append("".join(cur))
        return words

    def double_quoted(self) -> str:
        out: list[str] = []
        t = self.text
        while self.pos < len(t):
            ch = t[self.pos]
            self.pos += 1
            if ch == '"':
                return "".join(out)
            if ch == self.escape and self.pos < len(t) and t[self.pos] in ('"', "$", self.escape):
                out.append(t[self.pos])
                self.pos += 1
            elif ch == "$":
                out.append(self.variable())
            else:
                out.append(ch)
        raise self.error("unterminated double quote")

    def variable(self) -> str:
        """At a ``$`` (already consumed): its substitution, or the reference as written."""
        t = self.text
        start = self.pos - 1
        if self.pos < len(t) and t[self.pos] == "{":
            self.pos += 1
            m = _NAME.match(t, self.pos)
            if not m:
                raise self.error(f"bad substitution in {t[start:start + 20]!r}")
            name = m.group(0)
            self.pos = m.end()
            if self.pos >= len(t):
                raise self.error(f"missing '}}' in {t[start:]!r}")
            if t[self.pos] == "}":
                self.pos += 1
                value = self.env(name)
                return t[start:self.pos] if value is None else value
            op = t[self.pos]
            if op == ":" and self.pos + 1 < len(t):
                op = t[self.pos:self.pos + 2]
            if op not in (":-", "-", ":+", "+", ":?", "?"):
                raise self.error(f"unsupported modifier in {t[start:self.pos + 2]!r} "
                                 "(supported: :- - :+ + :? ?)")
            self.pos += len(op)
            word = self.until_brace()
            value = self.env(name)
            if value is None:
                return t[start:self.pos]
            empty_counts = op.startswith(":")
            present = value != "" or not empty_counts
            if op.endswith("-"):
                return value if present else word
            if op.endswith("+"):
                return word if present else ""
            if not present:
                raise self.error(f"{name}: {word or 'is not set'}")
            return value
        m = _NAME.match(t, self.pos)
        if m:
            self.pos = m.end()
            value = self.env(m.group(0))
            return "$" + m.group(0) if value is None else value
        return "$"

    def until_brace(self) -> str:
        """The word of a ``${NAME:-word}`` up to its closing brace (may hold variables)."""
        out: list[str] = []
        t = self.text
        while self.pos < len(t):
            ch = t[self.pos]
            self.pos += 1
            if ch == "}":
                return "".join(out)
            if ch == self.escape and self.pos < len(t):
                out.append(t[self.pos])
                self.pos += 1
            elif ch == "$":
                out.append(self.variable())
            else:
                out.append(ch)
        raise self.error("missing '}' in a ${…} substitution")
