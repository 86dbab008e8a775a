"""Dockerfile syntax: instructions, directives, continuations, heredocs, Docker's word rules."""
from __future__ import annotations

import fnmatch
import string

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aenv_api.dockerfile import DockerfileError
from aenv_api.dockerfile.context import compile_pattern
from aenv_api.dockerfile.syntax import Lexer, json_form, parse, raw_words, split_flags


def unknown(_name: str) -> None:
    return None


def test_instructions_lines_comments_continuations() -> None:
    df = parse("# a comment\n\nfrom  alpine\nrun echo a \\\n  # dropped\n\n  b\n  ENV A=1\r\n")
    assert [(i.keyword, i.text, i.line) for i in df.instructions] == [
        ("FROM", "alpine", 3), ("RUN", "echo a   b", 4), ("ENV", "A=1", 8)]


def test_continuation_with_trailing_blanks_and_at_end_of_file() -> None:
    df = parse("FROM a\nRUN x \\  \n y \\")
    assert df.instructions[1].text == "x  y"


def test_directives_only_at_the_top() -> None:
    df = parse("# syntax=docker/dockerfile:1\n# escape=`\nFROM a\nRUN dir `\n c:\\x")
    assert df.escape == "`" and df.instructions[1].text == "dir  c:\\x"
    # after any other line a directive is a comment
    assert parse("FROM a\n# escape=`\nRUN x \\\n y").instructions[1].text == "x  y"
    with pytest.raises(DockerfileError, match="line 1: invalid escape token"):
        parse("# escape=x\nFROM a")
    with pytest.raises(DockerfileError, match="line 2: only one escape"):
        parse("# escape=`\n# escape=\\\nFROM a")


def test_byte_order_mark_and_bad_lines() -> None:
    assert parse("\ufeffFROM a").instructions[0].keyword == "FROM"
    with pytest.raises(DockerfileError, match="line 2: not an instruction"):
        parse("FROM a\n--x y")


def test_heredocs() -> None:
    df = parse("FROM a\nRUN <<EOF\necho 1\n  echo 2\nEOF\nCOPY <<-'X' /f\n\t\tbody\n\tX\nRUN echo done")
    run, copy, last = df.instructions[1:]
    assert run.heredocs[0].content == "echo 1\n  echo 2\n" and run.heredocs[0].expand
    assert copy.heredocs[0].content == "body\n" and copy.heredocs[0].chomp and not copy.heredocs[0].expand
    assert (last.text, last.line) == ("echo done", 9)
    # a quoted marker is a file name, not a heredoc
    assert parse('FROM a\nCOPY "<<EOF" /x').instructions[1].heredocs == ()
    with pytest.raises(DockerfileError, match="line 2: heredoc 'EOF' has no terminating"):
        parse("FROM a\nRUN <<EOF\necho")


def test_words_quotes_and_escapes() -> None:
    lex = Lexer()
    assert lex.words(r"""a 'b c' "d \"e\" \x" f\ g""", unknown) == ["a", "b c", 'd "e" \\x', "f g"]
    assert lex.words("''  \"\" x", unknown) == ["", "", "x"]
    assert lex.word("trailing\\", unknown) == "trailing"
    with pytest.raises(DockerfileError, match="line 4: unterminated single quote"):
        lex.words("'open", unknown, line=4)
    with pytest.raises(DockerfileError, match="unterminated double quote"):
        lex.words('"open', unknown)
    assert Lexer("`").words("a` b c\\d", unknown) == ["a b", "c\\d"]


def test_variables() -> None:
    env = {"A": "1", "E": "", "P": "x y"}.get
    lex = Lexer()
    assert lex.word("$A-${A}-'$A'-\"$A\"-\\$A", env) == "1-1-$A-1-$A"
    assert lex.words("$P", env) == ["x y"]          # a value is not split again
    assert lex.word("${E:-d}|${E-d}|${E:+s}|${E+s}|${N:-d}|${A:+s}", env) == "d|||s|${N:-d}|s"
    assert lex.word("$UNKNOWN/${UNKNOWN}/$1/$", env) == "$UNKNOWN/${UNKNOWN}/$1/$"
    assert lex.word("${A:-${E}}", env) == "1" and lex.word("${E:-${A}z}", env) == "1z"
    with pytest.raises(DockerfileError, match="E: must be set"):
        lex.word("${E:?must be set}", env)
    with pytest.raises(DockerfileError, match="unsupported modifier"):
        lex.word("${A%%x}", env)
    with pytest.raises(DockerfileError, match="missing"):
        lex.word("${A", env)
    assert lex.substitute("it's \"$A\"", env) == "it's \"1\""


def test_flags_json_form_raw_words() -> None:
    flags, rest = split_flags('--chown=a:b --link  --chmod="755" src  "d e"')
    assert [(n, v) for n, v, _ in flags] == [("chown", "a:b"), ("link", None), ("chmod", "755")]
    assert rest == 'src  "d e"'
    assert json_form('["a", "b c"]') == ["a", "b c"]
    assert json_form("[not json") is None and json_form('["a", 1]') is None and json_form("echo") is None
    assert raw_words("a 'b c' \"d\\\" e\"") == ["a", "'b c'", '"d\\" e"']


# --- properties -----------------------------------------------------------

_CHARS = st.text(st.characters(blacklist_categories=("Cs", "Cc")), max_size=12)


def quote(word: str) -> str:
    """A word in Docker's double-quoted form: escape ", $ and \\."""
    return '"' + "".join("\\" + c if c in '"$\\' else c for c in word) + '"'


@given(st.lists(_CHARS, max_size=6))
def test_quoted_words_round_trip(words: list[str]) -> None:
    assert Lexer().words(" ".join(quote(w) for w in words), unknown) == words


@given(st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,8}", fullmatch=True), _CHARS)
def test_substitution_of_known_and_unknown_names(name: str, value: str) -> None:
    lex = Lexer()
    env = {name: value}.get
    assert lex.word(f"${{{name}}}", env) == value
    assert lex.word(f"<${name}>", env) == f"<{value}>"
    assert lex.word(f"${{{name}:-d}}", env) == (value or "d")
    # unknown names stay as written, for the server to expand in the image's environment
    assert lex.word(f"a${{{name}:-d}}/${name}", unknown) == f"a${{{name}:-d}}/${name}"


@given(st.lists(st.from_regex(r"[a-z0-9=/._-]{1,8}", fullmatch=True), min_size=1, max_size=8),
       st.lists(st.sampled_from([" ", " \\\n", "\t\\\n  ", " \\\n# c\n "]), min_size=8, max_size=8))
def test_continuations_keep_the_words(words: list[str], seps: list[str]) -> None:
    text = "FROM a\nRUN " + "".join(w + seps[i] for i, w in enumerate(words[:-1])) + words[-1] + "\nUSER u\n"
    ins = parse(text).instructions
    assert [i.keyword for i in ins] == ["FROM", "RUN", "USER"]
    assert ins[1].text.split() == words


@settings(max_examples=300)
@given(st.text(st.sampled_from(list("FROMRUNCOPYENV \n\\#=$'\"`[]<{}-:") + ["\t"]), max_size=80))
def test_parse_fails_only_with_dockerfile_errors(text: str) -> None:
    from aenv_api.dockerfile.convert import convert

    try:
        convert(parse(text))
    except DockerfileError as e:
        assert str(e).startswith("Dockerfile")


@given(st.text(st.sampled_from(list(string.ascii_lowercase[:3]) + [".", "-"]), max_size=6),
       st.lists(st.sampled_from(list("ab.*?") + ["[ab]", "[!a]"]), max_size=5).map("".join))
def test_patterns_match_as_fnmatch_within_a_name(name: str, pattern: str) -> None:
    assert bool(compile_pattern(pattern).match(name)) == fnmatch.fnmatchcase(name, pattern)


def test_pattern_separators_and_globstar() -> None:
    assert compile_pattern("a/*.py").match("a/x.py") and not compile_pattern("a/*.py").match("a/b/x.py")
    assert compile_pattern("**/x").match("x") and compile_pattern("**/x").match("a/b/x")
    assert compile_pattern("a/**").match("a/b/c") and not compile_pattern("?").match("/")
