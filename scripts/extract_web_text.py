"""Rebuild tests/data/web_genesis_exodus.txt from Debian's sword-text-web package (World English Bible, public domain).

    apt-get install sword-text-web libsword-utils
    mod2imp engWEB2015eb | python scripts/extract_web_text.py > tests/data/web_genesis_exodus.txt

Keeps the books named in BOOKS; drops footnotes, markup and verse numbers; one paragraph per chapter.
"""

from __future__ import annotations

import html
import re
import sys

BOOKS = ("Genesis", "Exodus")
_NOTE = re.compile(r"<note\b.*?</note>", re.DOTALL)
_TITLE = re.compile(r"<title\b.*?</title>", re.DOTALL)
_TAG = re.compile(r"<[^>]+>")
_KEY = re.compile(r"^\$\$\$(.+?) (\d+):(\d+)$")


def main() -> None:
    chapters: dict[tuple[str, int], list[str]] = {}
    key = None
    for line in sys.stdin:
        line = line.rstrip("\n")
        m = _KEY.match(line)
        if line.startswith("$$$"):
            key = (m.group(1), int(m.group(2))) if m and m.group(1) in BOOKS and int(m.group(3)) > 0 else None
            continue
        if key is None:
            continue
        text = html.unescape(_TAG.sub("", _TITLE.sub("", _NOTE.sub(" ", line))))
        text = re.sub(r"\s+([.,;:!?\u2019\u201d)])", r"\1", re.sub(r"\s+", " ", text)).strip()
        if text:
            chapters.setdefault(key, []).append(text)
    for book in BOOKS:
        first = True
        for (b, _c), verses in chapters.items():
            if b != book:
                continue
            if first:
                sys.stdout.write(f"\n= {book} =\n\n")
                first = False
            sys.stdout.write(f"{' '.join(verses)}\n\n")


if __name__ == "__main__":
    main()
