"""Every error message the library and the models raise, and every flag of
the commands, is exercised by a test.

A static audit: for each ``raise SomeError("...")`` in ``jax_flashoverlap/``
and ``models/``, some phrase of its message (ten characters or more between
punctuation) must appear in a test file, where a ``pytest.raises(...,
match=...)`` or an assertion on the text names it. A new message without a
test fails here, naming its file and line.
"""

import ast
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
SOURCES = sorted([*(ROOT / "jax_flashoverlap").rglob("*.py"), *(ROOT / "models").glob("*.py")])
# Regex escapes are dropped, so that r"\(2, 8\)" in a test reads as "(2, 8)".
TESTS_TEXT = "\n".join(p.read_text() for p in (ROOT / "tests").glob("*.py")).replace("\\", "")
_BREAKS = re.compile(r"[;:,.()=`]\s|\s[(`']|[\[\]]")


def _literal_parts(node: ast.AST) -> list[str]:
    """The constant text of a message: a string, an f-string's literal parts,
    or a concatenation of them."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, ast.JoinedStr):
        return [v.value for v in node.values if isinstance(v, ast.Constant)]
    if isinstance(node, ast.BinOp):
        return _literal_parts(node.left) + _literal_parts(node.right)
    return []


def _phrases(message: ast.AST) -> list[str]:
    phrases = []
    for part in _literal_parts(message):
        for piece in _BREAKS.split(part):
            piece = piece.strip(" ;:,.()'`\"")
            if len(piece) >= 10:
                phrases.append(piece)
    return phrases


def _raised_messages():
    """(file:line, phrases) for each raise with a literal message."""
    for path in SOURCES:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call) and node.exc.args:
                phrases = _phrases(node.exc.args[0])
                if phrases:
                    yield f"{path.relative_to(ROOT)}:{node.lineno}", phrases


def test_the_audit_finds_the_raise_sites():
    sites = dict(_raised_messages())
    assert len(sites) >= 100, len(sites)
    assert any(site.startswith("models/ssd_pallas.py") for site in sites)


def test_every_error_message_is_triggered_by_a_test():
    untested = [f"{site}: {phrases[0]!r}" for site, phrases in _raised_messages()
                if not any(phrase in TESTS_TEXT for phrase in phrases)]
    assert not untested, "error messages no test names:\n" + "\n".join(untested)


def test_every_command_line_flag_is_used_by_a_test():
    """Each ``add_argument("--flag", ...)`` of the commands (jax_flashoverlap/cli)
    appears in some test."""
    tests_text = "\n".join(p.read_text() for p in (ROOT / "tests").glob("*.py"))
    flags = {(path.name, flag) for path in (ROOT / "jax_flashoverlap" / "cli").glob("*.py")
             for flag in re.findall(r'add_argument\(\s*"(--[\w-]+)"', path.read_text())}
    assert len(flags) >= 40, len(flags)
    unused = sorted(f"{name}: {flag}" for name, flag in flags if flag not in tests_text)
    assert not unused, "flags no test uses:\n" + "\n".join(unused)
