"""YAML text -> Python data with limits: nesting depth, nodes after alias expansion, keys per mapping.

PyYAML's safe_load builds whatever the text describes: a "billion laughs" (nine anchors, each a list of
nine aliases of the previous one) becomes a structure of 9^9 references that validation and error
messages then walk; a recursive anchor (`a: &a [*a]`) a cyclic one; 5,000 nested brackets a
RecursionError in the composer. Here the node graph is built from the parser's events (libyaml's when
present, which keeps its own stack) by a loop that counts every node an alias would expand to and
stops at the first limit crossed, before anything is constructed. Construction then uses PyYAML's safe
constructors; any value they cannot build (`!!float 'x'`, an int of 5,000 digits, an unknown tag) is a
YamlLimitError at that value's line and column.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import yaml
from yaml import events as ev
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

from llmc.inputs.excerpt import escape, excerpt, shorten

MAX_DEPTH = 32  # a recipe nests about 6 deep
MAX_NODES = 20_000  # after alias expansion; a recipe has a few hundred
MAX_KEYS = 1_000  # per mapping

_Parser = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


class YamlLimitError(Exception):
    """The text is not YAML llmc reads: a syntax error, a limit crossed, or a value that cannot be built."""

    def __init__(self, problem: str, line: int | None = None, column: int | None = None, fix: str = "") -> None:
        super().__init__(problem)
        self.problem = problem
        self.line = line  # 1-based, None when unknown
        self.column = column
        self.fix = fix or "check indentation and quoting around that line"

    @property
    def where(self) -> str:
        return f" at line {self.line}, column {self.column}" if self.line is not None else ""


def _at(mark: Any) -> tuple[int | None, int | None]:
    return (mark.line + 1, mark.column + 1) if mark is not None else (None, None)


@dataclass
class _Open:
    node: SequenceNode | MappingNode
    anchor: str | None
    size: int = 1  # nodes under it after alias expansion, itself included
    height: int = 1
    key: Node | None = None  # a mapping's key waiting for its value
    keys: set = field(default_factory=set)  # scalar keys seen, for duplicates


class _Composer:
    """Events -> node graph, iteratively, with the limits checked as each node arrives."""

    def __init__(self) -> None:
        self.resolver = yaml.SafeLoader("")  # its resolve() gives untagged scalars their implicit tags
        self.anchors: dict[str, tuple[Node, int, int]] = {}  # anchor -> (node, expanded size, height)
        self.open_anchors: set[str] = set()
        self.stack: list[_Open] = []
        self.total = 0
        self.root: Node | None = None

    def compose(self, text: str) -> Node | None:
        documents = 0
        try:
            for event in yaml.parse(text, Loader=_Parser):
                if isinstance(event, ev.DocumentStartEvent):
                    documents += 1
                    if documents > 1:
                        raise YamlLimitError("more than one YAML document ('---') in the file", *_at(event.start_mark),
                                             fix="keep one recipe per file")
                elif isinstance(event, (ev.ScalarEvent, ev.AliasEvent, ev.SequenceStartEvent, ev.MappingStartEvent,
                                        ev.SequenceEndEvent, ev.MappingEndEvent)):
                    self._event(event)
        except yaml.MarkedYAMLError as e:
            if "maximum nesting depth" in (e.problem or ""):  # libyaml >= 0.2.6 stops at 1,000 levels, scanning ahead
                raise YamlLimitError(f"nested more than {MAX_DEPTH} levels deep (more than libyaml's own limit of "
                                     "1,000)", *_at(e.problem_mark),
                                     fix="a recipe nests a few levels; remove the extra nesting") from None
            problem = shorten(e.problem or str(e), 120)
            if e.context_mark is not None and e.context:  # where the unfinished construct began, then where it broke
                line, col = _at(e.problem_mark)
                raise YamlLimitError(f"{shorten(e.context, 60)}: {problem}" + (f" (line {line}, column {col})"
                                     if line is not None else ""), *_at(e.context_mark)) from None
            raise YamlLimitError(problem, *_at(e.problem_mark)) from None
        except yaml.reader.ReaderError as e:  # a character YAML does not allow: a position, no mark
            line = text.count("\n", 0, e.position) + 1
            column = e.position - (text.rfind("\n", 0, e.position) + 1) + 1
            raise YamlLimitError(f"character {escape(chr(e.character)) if isinstance(e.character, int) else '?'} "
                                 f"(#x{e.character if isinstance(e.character, int) else 0:04x}) is not allowed in YAML",
                                 line, column, fix="remove the control character, or check that this is the recipe "
                                 "you meant") from None
        except yaml.YAMLError as e:
            raise YamlLimitError(shorten(str(e), 160)) from None
        return self.root

    def _event(self, event: ev.Event) -> None:
        line, col = _at(event.start_mark)
        if isinstance(event, ev.AliasEvent):
            if event.anchor in self.open_anchors:
                raise YamlLimitError(f"alias *{shorten(event.anchor, 40)} refers to a node that "
                                     "contains it (a recursive anchor)", line, col,
                                     fix="a recipe is a tree: write the value out instead of the alias")
            if event.anchor not in self.anchors:
                raise YamlLimitError(f"alias *{shorten(event.anchor, 40)} has no anchor before it",
                                     line, col, fix="define the anchor (&name) before using it")
            node, size, height = self.anchors[event.anchor]
            self._add(node, size, height, line, col)
        elif isinstance(event, ev.ScalarEvent):
            tag = event.tag
            if tag is None or tag == "!":
                tag = self.resolver.resolve(ScalarNode, event.value, event.implicit)
            node = ScalarNode(tag, event.value, event.start_mark, event.end_mark, style=event.style)
            node.explicit_tag = event.tag not in (None, "!")
            self._anchor(event.anchor, node, 1, 1)
            self._add(node, 1, 1, line, col)
        elif isinstance(event, (ev.SequenceStartEvent, ev.MappingStartEvent)):
            if len(self.stack) + 1 > MAX_DEPTH:
                raise YamlLimitError(f"nested more than {MAX_DEPTH} levels deep", line, col,
                                     fix="a recipe nests a few levels; remove the extra nesting")
            kind = SequenceNode if isinstance(event, ev.SequenceStartEvent) else MappingNode
            tag = event.tag
            if tag is None or tag == "!":
                tag = self.resolver.resolve(kind, None, event.implicit)
            node = kind(tag, [], event.start_mark, None, flow_style=event.flow_style)
            node.explicit_tag = event.tag not in (None, "!")
            self._count(1, line, col)
            if event.anchor is not None:
                self.open_anchors.add(event.anchor)
            self.stack.append(_Open(node, event.anchor))
        else:  # the end of a sequence or mapping
            done = self.stack.pop()
            done.node.end_mark = event.end_mark
            if done.anchor is not None:
                self.open_anchors.discard(done.anchor)
                self._anchor(done.anchor, done.node, done.size, done.height)
            self.total -= 1  # counted at its start already
            self._add(done.node, done.size, done.height, line, col)

    def _anchor(self, anchor: str | None, node: Node, size: int, height: int) -> None:
        if anchor is not None:
            self.anchors[anchor] = (node, size, height)

    def _count(self, n: int, line: int | None, col: int | None) -> None:
        self.total += n
        if self.total > MAX_NODES:
            raise YamlLimitError(f"the recipe expands to more than {MAX_NODES:,} values (counting every alias "
                                 "as a copy of its anchor)", line, col,
                                 fix="a recipe has a few hundred values; remove the repeated aliases or the bulk")

    def _add(self, node: Node, size: int, height: int, line: int | None, col: int | None) -> None:
        self._count(size, line, col)
        if len(self.stack) + height > MAX_DEPTH:
            raise YamlLimitError(f"nested more than {MAX_DEPTH} levels deep (with aliases expanded)", line, col,
                                 fix="a recipe nests a few levels; remove the extra nesting")
        if not self.stack:
            self.root = node
            return
        parent = self.stack[-1]
        parent.size += size
        parent.height = max(parent.height, height + 1)
        if isinstance(parent.node, SequenceNode):
            parent.node.value.append(node)
        elif parent.key is None:
            if len(parent.node.value) >= MAX_KEYS:
                raise YamlLimitError(f"a mapping with more than {MAX_KEYS:,} keys", line, col,
                                     fix="a recipe section has a handful of keys; remove the bulk")
            if isinstance(node, ScalarNode) and node.tag != "tag:yaml.org,2002:merge":
                seen = (node.tag, node.value)
                if seen in parent.keys:
                    raise YamlLimitError(f"key {excerpt(node.value)} appears twice in one mapping", line, col,
                                         fix="keep one of them (YAML would silently use the last)")
                parent.keys.add(seen)
            parent.key = node
        else:
            parent.node.value.append((parent.key, node))
            parent.key = None


class _Constructor(yaml.SafeLoader):
    """PyYAML's safe constructors, with the position of any value they cannot build."""

    def construct_object(self, node: Node, deep: bool = False) -> Any:
        try:
            return super().construct_object(node, deep=deep)
        except YamlLimitError:
            raise
        except Exception as e:  # noqa: BLE001 - int('abc'), float('x'), unknown tags, unhashable keys...
            line, col = _at(node.start_mark)
            what = excerpt(node.value) if isinstance(node, ScalarNode) else f"a {node.id}"
            tag = node.tag.replace("tag:yaml.org,2002:", "!!")
            problem = getattr(e, "problem", None) or f"{type(e).__name__}: {e}"
            raise YamlLimitError(
                f"cannot read {what} as {shorten(tag, 40)} ({shorten(problem, 100)})",
                line, col,
                fix=f"remove the tag {shorten(tag, 40)}, or write a value of that type" if getattr(node, "explicit_tag", False)
                else "quote the value to make it a string, or write a value that fits the field (a whole number of "
                "at most a few dozen digits, a date that exists)",
            ) from None


def load_yaml(text: str) -> Any:
    """The single document in text as Python data (None for an empty one); YamlLimitError otherwise."""
    node = _Composer().compose(text)
    if node is None:
        return None
    constructor = _Constructor("")
    try:
        return constructor.construct_document(node)
    except YamlLimitError:
        raise
    except yaml.MarkedYAMLError as e:
        raise YamlLimitError(shorten(e.problem or str(e), 120), *_at(e.problem_mark)) from None
    except Exception as e:  # noqa: BLE001 - anything else a constructor raises is still the recipe's fault
        raise YamlLimitError(f"cannot read the recipe's values ({shorten(f'{type(e).__name__}: {e}', 100)})") from None
