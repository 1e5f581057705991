"""colo/textsafe.py, character by character: each class of character it escapes, at the edges of
its ranges, and what it must leave alone (test_textsafe.py has the attack through the real CLI)."""
from __future__ import annotations

import pytest

from colo.textsafe import safe, safe_all, safe_tree


@pytest.mark.parametrize("ch,shown", [
    ("\x00", "\\x00"), ("\x07", "\\x07"), ("\x1b", "\\x1b"), ("\x1f", "\\x1f"),  # C0
    ("\n", "\\n"), ("\r", "\\r"), ("\t", "\\t"),  # named as Python names them
    ("\x7f", "\\x7f"),  # DEL
    ("\x80", "\\x80"), ("\x85", "\\x85"), ("\x9b", "\\x9b"), ("\x9f", "\\x9f"),  # C1: 0x9b is a CSI
    ("\u200b", "\\u200b"), ("\u200e", "\\u200e"), ("\u202a", "\\u202a"), ("\u202e", "\\u202e"),  # zero width, bidi
    ("\u2066", "\\u2066"), ("\u2069", "\\u2069"), ("\ufeff", "\\ufeff"), ("\u0600", "\\u0600"),  # isolates, BOM
    ("\ufff9", "\\ufff9"), ("\u2028", "\\u2028"), ("\u2029", "\\u2029"),  # annotation, line/paragraph separators
    ("\udcff", "\\udcff"), ("\ud800", "\\ud800"),  # lone surrogates (bytes that were not UTF-8)
    ("\U000e0001", "\\U000e0001"), ("\U0001d173", "\\U0001d173"),  # format characters past the BMP
])
def test_each_class_of_character_is_escaped(ch, shown):
    assert safe(f"a{ch}b") == f"a{shown}b"
    assert safe(ch) == shown


@pytest.mark.parametrize("ch", [" ", "~", "\\", "\xa0", "\xa1", "\xff", "\u0100", "é", "日", "\uffff", "\U0001f600",
                                "\u05d0", "\u0660"])
def test_printable_text_passes_even_beside_escaped_characters(ch):
    assert safe(ch) == ch
    assert safe(f"{ch}\x1b{ch}") == f"{ch}\\x1b{ch}"  # the slow path, not only the all-ASCII one


def test_keep_passes_only_the_characters_named():
    assert safe("a\nb\tc\rd", keep="\n") == "a\nb\\tc\\rd"
    assert safe("a\x1b\n", keep="\x1b") == "a\x1b\\n"
    assert safe("\x9f\x7f", keep="\x7f") == "\\x9f\x7f"
    assert safe("plain", keep="\n") == "plain"


def test_anything_is_shown_as_its_text():
    assert safe(5) == "5" and safe(None) == "None" and safe(b"\x1b") == "b'\\x1b'"
    assert safe(["\x1b"]) == "['\\x1b']"  # str() of the list already wrote it escaped


def test_safe_all_checks_a_column_at_once_and_escapes_each_value():
    col = ["a", "b c", "~"]
    assert safe_all(col) is col
    assert safe_all(["a", "\x7f", "é", "\x9f"]) == ["a", "\\x7f", "é", "\\x9f"]
    assert safe_all(["é", "日"]) == ["é", "日"]
    assert safe_all(["a", "\x1b[2J"]) == ["a", "\\x1b[2J"]  # all ASCII, not all printable
    assert safe_all([]) == []


def test_safe_tree_escapes_every_string_keys_too():
    assert safe_tree({"E\x7f": {"k\n": ("\x9b", 1, 2.5, None, True)}, 3: ["\u202e"]}) == {
        "E\\x7f": {"k\\n": ["\\x9b", 1, 2.5, None, True]}, 3: ["\\u202e"]}
    assert safe_tree("\x1b") == "\\x1b" and safe_tree(7) == 7 and safe_tree(None) is None
