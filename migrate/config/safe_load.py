"""Bounded reading and parsing of what the tools read: config YAML, `key=value` values, JSON.

A small hostile input must not hang the tool, exhaust its memory or its stack. Files are read
up to a size bound; YAML goes through PyYAML's event stream (iterative, nothing constructed)
with a budget first: nesting depth, and the node count *after* alias expansion (each alias
counts the full size of what it names), so a 1 KB alias bomb is refused in microseconds. Only
then is it loaded, with the safe loader. JSON is size-bounded and its nesting caught.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from migrate.errors import BadInput, describe_os_error, shorten

MAX_DEPTH = 32  # nested collections; configs use 3
MAX_NODES = 100_000  # scalars and collections after alias expansion; base.yml has ~150
MAX_YAML_BYTES = 1 << 20


class ParseError(BadInput, ValueError):
    """A file or value that cannot be read or parsed within the bounds; names the source."""


def read_text(path: str | Path, max_bytes: int, what: str = "file") -> str:
    """The UTF-8 text of the file at `path`, at most `max_bytes` long; a missing, unreadable,
    looping or oversized path, a directory, or bytes that are not UTF-8 raise ParseError."""
    try:
        with open(path, "rb") as f:
            data = f.read(max_bytes + 1)
    except OSError as e:
        raise ParseError(f"cannot read {what} {path}: {describe_os_error(e)}") from None
    if len(data) > max_bytes:
        raise ParseError(f"{what} {path}: larger than {max_bytes} bytes; refusing to parse it")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ParseError(f"{what} {path}: not UTF-8 text ({e.reason} at byte {e.start})") from None


def _check_budget(text: str, source: str) -> None:
    """Walk the event stream once: depth, expanded node count, no alias into itself."""
    sizes: dict[str, int] = {}  # anchor -> expanded node count of what it names
    open_collections: list[list] = []  # [expanded count so far, anchor]
    total = 0
    for event in yaml.parse(text, Loader=yaml.SafeLoader):
        if isinstance(event, yaml.CollectionStartEvent):
            if len(open_collections) >= MAX_DEPTH:
                raise ParseError(f"{source}: nested deeper than {MAX_DEPTH} levels")
            open_collections.append([1, event.anchor])
            continue
        if isinstance(event, yaml.CollectionEndEvent):
            count, anchor = open_collections.pop()
            if anchor is not None:
                sizes[anchor] = count
        elif isinstance(event, yaml.AliasEvent):
            if any(anchor == event.anchor for _, anchor in open_collections):
                raise ParseError(f"{source}: alias *{event.anchor} refers to itself")
            count = sizes.get(event.anchor, 1)  # undefined: the loader reports it
        elif isinstance(event, yaml.ScalarEvent):
            count = 1
            if event.anchor is not None:
                sizes[event.anchor] = 1
        else:
            continue
        if open_collections:
            open_collections[-1][0] += count
            count = open_collections[-1][0]
        else:
            total += count
            count = total
        if count > MAX_NODES:
            raise ParseError(
                f"{source}: expands to more than {MAX_NODES} values (aliases count in full); "
                "refusing to load it"
            )


class _DuplicateKey(ValueError):
    pass


class _StrictLoader(yaml.SafeLoader):
    """The safe loader, refusing a mapping that states one key twice (PyYAML keeps the last one
    silently, so a config that says `S: 4` and later `S: 2` would run with 2). A key a merge
    (`<<: *base`) brings in may still be overridden: only the mapping's own keys count."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        if isinstance(node, yaml.MappingNode):
            first_line: dict[Any, int] = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=True)
                line = key_node.start_mark.line + 1
                try:
                    earlier = first_line.get(key)
                except TypeError:  # an unhashable key: the base loader reports it
                    continue
                if earlier is not None:
                    raise _DuplicateKey(
                        f"key {shorten(repr(key), 80)} appears twice (lines {earlier} and "
                        f"{line}); keep one"
                    )
                first_line[key] = line
        return super().construct_mapping(node, deep=deep)


def yaml_problem(error: yaml.YAMLError) -> str:
    """PyYAML's error as the rest of one line: where (line and column, counted from 1) and what.
    PyYAML's own text spans several lines (the context, a quote of the source, a caret)."""
    if isinstance(error, yaml.MarkedYAMLError):
        mark = error.problem_mark or error.context_mark
        what = error.problem or error.context or "cannot parse"
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        context = f" ({error.context})" if error.problem and error.context else ""
        return where + ": " + shorten(" ".join(f"{what}{context}".split()), 300)
    lines = str(error).strip().splitlines()
    return f": {shorten(lines[0].strip(), 300)}" if lines else ""


def load_yaml(text: str, source: str) -> Any:
    """`yaml.safe_load(text)` within the bounds, no key stated twice in one mapping; any problem
    is a ParseError naming `source`."""
    if len(text) > MAX_YAML_BYTES:
        raise ParseError(f"{source}: longer than {MAX_YAML_BYTES} characters")
    try:
        _check_budget(text, source)
        return yaml.load(text, Loader=_StrictLoader)
    except _DuplicateKey as e:
        raise ParseError(f"{source}: {e}") from None
    except yaml.YAMLError as e:
        raise ParseError(f"{source}: not valid YAML{yaml_problem(e)}") from None
    except (ValueError, TypeError, OverflowError, RecursionError) as e:
        if isinstance(e, ParseError):
            raise
        # e.g. an integer of more digits than Python converts, a date out of range
        raise ParseError(f"{source}: {type(e).__name__}: {shorten(str(e), 300)}") from None


def load_json_file(path: str | Path, max_bytes: int, what: str = "JSON file") -> Any:
    """The JSON document at `path`, size-bounded; unreadable or invalid -> ParseError."""
    text = read_text(path, max_bytes, what)
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as e:
        raise ParseError(f"{what} {path}: not valid JSON: {shorten(str(e), 300)}") from None
