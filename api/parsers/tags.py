"""Tag scanning shared by the streaming parsers.

`next_tag` splits a buffer at the earliest of several tags; without a complete tag it keeps back
the longest suffix that is a proper prefix of one of them (it may still grow into the tag), so a
streaming parser never acts on text that the next chunk could turn into a tag.
"""

from flint_sched.engine.stop_strings import held_suffix_len


def find_first(text: str, tags: tuple[str, ...], start: int = 0) -> tuple[int, str] | None:
    """The position and tag of the earliest occurrence of any of `tags` at or after `start`."""
    best = None
    for tag in tags:
        index = text.find(tag, start)
        if index != -1 and (best is None or index < best[0]):
            best = (index, tag)
    return best


def without_held_suffix(text: str, tags: tuple[str, ...]) -> str:
    return text[: len(text) - held_suffix_len(text, tags)]


def next_tag(buffer: str, tags: tuple[str, ...]) -> tuple[str, str | None, str]:
    """(text before the earliest tag, the tag, text after it), or, when no tag is complete,
    (the text that is safe to use now, None, the suffix to hold back)."""
    hit = find_first(buffer, tags)
    if hit is not None:
        index, tag = hit
        return buffer[:index], tag, buffer[index + len(tag):]
    safe = without_held_suffix(buffer, tags)
    return safe, None, buffer[len(safe):]
