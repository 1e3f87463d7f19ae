"""Names made safe for each place they are shown: a terminal, XML, Markdown.

Span names come from the user's program and from traces of any origin: a module named with
an ANSI colour code, a kernel name with a newline, a 1 MB name. Shown as they are, they set
the terminal's title or clear its screen, make JUnit XML invalid, break Markdown tables and
code spans, and overflow a pull-request comment. Each function here makes a name safe for one
such place, keeping what can be kept visible (a control character becomes ``\\x1b``).
"""

from __future__ import annotations

import re
from typing import Final

_CONTROL: Final = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")
"""C0 and C1 control characters, DEL: everything a terminal may act on, but tab and newline."""
_XML_FORBIDDEN: Final = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\ud800-\udfff\ufffe\uffff]")
_LINE_BREAKS: Final = re.compile(r"\r\n|[\n\r\u2028\u2029\x85]")
MARKDOWN_NAME_CHARACTERS: Final = 200
"""A name in a Markdown report is shortened to this many characters (in the middle)."""
CI_NAME_CHARACTERS: Final = 1_000
"""A name in a JSON or JUnit report keeps this many of its characters (the cut said in it)."""
PR_COMMENT_CHARACTERS: Final = 65_536
"""What a GitHub pull-request comment holds."""


def _visible(match: re.Match[str]) -> str:
    return f"\\x{ord(match.group()):02x}"


def printable(text: str) -> str:
    """``text`` with every control character but tab and newline shown as ``\\xNN``: nothing a
    terminal acts on (escape sequences, bells, NUL) reaches it."""
    return _CONTROL.sub(_visible, text)


_SHOWN_BREAKS: Final = {"\r\n": "\\r\\n", "\n": "\\n", "\r": "\\r", "\u2028": "\\u2028", "\u2029": "\\u2029",
                         "\x85": "\\x85"}


def one_line(text: str) -> str:
    """``text`` printable and on one line (each line break shown as its escape: ``\\n``, ``\\r``...)."""
    return printable(_LINE_BREAKS.sub(lambda match: _SHOWN_BREAKS[match.group()], text))


def xml_text(text: str) -> str:
    """``text`` with what XML 1.0 forbids shown as ``\\xNN`` (ElementTree escapes the rest)."""
    return _XML_FORBIDDEN.sub(lambda m: f"\\x{ord(m.group()):02x}" if ord(m.group()) < 0x100
                              else f"\\u{ord(m.group()):04x}", text)


def capped(text: str, limit: int = CI_NAME_CHARACTERS) -> str:
    """``text`` whole, or its start and end with what was cut said between them
    (``…[1,046,576 characters cut]…``): for the machine-read CI formats (JSON, JUnit), where a
    name must stay recognisable and the file small."""
    if len(text) <= limit:
        return text
    head = limit // 2
    return f"{text[:head]}…[{len(text) - limit:,} characters cut]…{text[len(text) - (limit - head):]}"


def shortened(text: str, limit: int) -> str:
    """``text`` cut to ``limit`` characters in the middle (a path's start and end say the most)."""
    if len(text) <= limit:
        return text
    head = (limit - 1) // 2 + (limit - 1) % 2
    return text[:head] + "…" + text[len(text) - (limit - 1 - head):]


def markdown_code(text: str, limit: int = MARKDOWN_NAME_CHARACTERS) -> str:
    """``text`` as an inline code span that stays one: on one line, shortened, fenced with more
    backticks than any run inside it, and safe in a table cell (``|`` escaped)."""
    body = shortened(one_line(text), limit).replace("|", "\\|")
    longest = max((len(run) for run in re.findall(r"`+", body)), default=0)
    fence = "`" * (longest + 1)
    padding = " " if body.startswith("`") or body.endswith("`") or not body.strip() else ""
    return f"{fence}{padding}{body}{padding}{fence}"


def markdown_text(text: str, limit: int = MARKDOWN_NAME_CHARACTERS * 2) -> str:
    """``text`` as plain Markdown prose or a table cell: one line, shortened, with the characters
    Markdown and HTML would act on escaped."""
    body = shortened(one_line(text), limit)
    return re.sub(r"([\\`*_{}\[\]<>|#])", r"\\\1", body)


def within(lines: list[str], limit: int = PR_COMMENT_CHARACTERS) -> list[str]:
    """``lines`` cut so that joined with newlines they hold at most ``limit`` characters, the
    cut said on a last line."""
    total, kept = 0, list[str]()
    for line in lines:
        if total + len(line) + 1 > limit - 200:
            kept.append(f"\n_… {len(lines) - len(kept)} more lines cut: the report is longer than a pull-request "
                        "comment holds (the JSON output has everything)._")
            return kept
        kept.append(line)
        total += len(line) + 1
    return kept
