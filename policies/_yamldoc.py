"""Parse a policy file's YAML and remember where every node is.

pydantic reports a field path (``rules[2].match.message``); the operator wants
the line too. We compose the YAML node tree once, construct the data from it,
and keep the tree to look paths up afterwards. Parsing is bounded: the text's
size, the node count (aliases counted each time they are used, so a "billion
laughs" file is refused before anything walks it) and the nesting depth.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass

import yaml

from supervisor.errors import PolicyError, PolicyIssue

MAX_TEXT_CHARS = 1_000_000
MAX_NODES = 200_000
MAX_DEPTH = 64

PathElem = str | int

_PLAIN_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


@dataclass(frozen=True, slots=True)
class YamlDoc:
    """The constructed data of a policy file and its node tree, for line lookups."""

    data: object
    root: yaml.Node
    source: str

    def line_of(self, path: Sequence[PathElem]) -> int | None:
        """1-based line of the node at ``path``: a key's line for a mapping entry.

        Walks as far as the path exists and answers for the deepest node found,
        so a missing key points at the mapping that lacks it.
        """
        node: yaml.Node = self.root
        line = node.start_mark.line + 1
        for elem in path:
            if isinstance(node, yaml.MappingNode):
                found = _find_key(node, elem)
                if found is None:
                    return line
                key, node = found
                line = key.start_mark.line + 1
            elif isinstance(node, yaml.SequenceNode) and isinstance(elem, int):
                if not 0 <= elem < len(node.value):
                    return line
                node = node.value[elem]
                line = node.start_mark.line + 1
            else:
                return line
        return line


def _find_key(node: yaml.MappingNode, elem: PathElem) -> tuple[yaml.Node, yaml.Node] | None:
    wanted = str(elem)
    for key, value in node.value:
        if isinstance(key, yaml.ScalarNode) and key.value == wanted:
            return key, value
    return None


def join_path(prefix: str, elem: PathElem) -> str:
    """Append one element to a dotted field path: ``rules[2].match``, ``attributes["a.b"]``."""
    if isinstance(elem, int):
        return f"{prefix}[{elem}]"
    if _PLAIN_KEY.fullmatch(elem):
        return f"{prefix}.{elem}" if prefix else elem
    return f"{prefix}[{json.dumps(elem, ensure_ascii=False)}]"


def parse(text: str, source: str) -> YamlDoc:
    """Parse ``text`` as one YAML document; raise ``PolicyError`` listing every problem found."""
    if len(text) > MAX_TEXT_CHARS:
        raise PolicyError(
            [PolicyIssue(source, "", None, f"policy file over {MAX_TEXT_CHARS} characters")]
        )
    try:
        loader = yaml.SafeLoader(text)
    except yaml.reader.ReaderError as exc:
        line = text.count("\n", 0, max(exc.position, 0)) + 1
        message = f"YAML syntax error: character #x{exc.character:04x} is not allowed"
        raise PolicyError([PolicyIssue(source, "", line, message)]) from None
    try:
        root = loader.get_single_node()
        if root is None:
            raise PolicyError([PolicyIssue(source, "", 1, "empty policy document")])
        _check_tree(root, source)
        data = loader.construct_document(root)
    except yaml.MarkedYAMLError as exc:
        raise PolicyError([_yaml_issue(exc, source)]) from None
    except yaml.YAMLError as exc:
        raise PolicyError([PolicyIssue(source, "", None, f"YAML error: {exc}")]) from None
    except RecursionError:
        raise PolicyError(
            [PolicyIssue(source, "", None, "YAML nested too deeply to parse")]
        ) from None
    finally:
        loader.dispose()
    return YamlDoc(data=data, root=root, source=source)


def _yaml_issue(exc: yaml.MarkedYAMLError, source: str) -> PolicyIssue:
    mark = exc.problem_mark or exc.context_mark
    parts = [p for p in (exc.context, exc.problem) if p]
    message = "YAML syntax error: " + (", ".join(parts) or "cannot parse")
    return PolicyIssue(source, "", None if mark is None else mark.line + 1, message)


def _check_tree(root: yaml.Node, source: str) -> None:
    """Refuse trees too big or too deep once aliases are expanded; flag duplicate keys."""
    issues: list[PolicyIssue] = []
    sizes: dict[int, int] = {}
    active: set[int] = set()

    def size(node: yaml.Node, depth: int, path: str) -> int:
        ident = id(node)
        if ident in sizes:
            return sizes[ident]
        if ident in active:
            raise PolicyError(
                [PolicyIssue(source, "", node.start_mark.line + 1, "recursive YAML alias")]
            )
        if depth > MAX_DEPTH:
            raise PolicyError(
                [
                    PolicyIssue(
                        source, "", node.start_mark.line + 1, f"nested deeper than {MAX_DEPTH}"
                    )
                ]
            )
        total = 1
        active.add(ident)
        if isinstance(node, yaml.SequenceNode):
            for index, child in enumerate(node.value):
                total += size(child, depth + 1, f"{path}[{index}]")
        elif isinstance(node, yaml.MappingNode):
            seen: dict[str, yaml.Node] = {}
            for key, _ in node.value:
                if not isinstance(key, yaml.ScalarNode) or key.value == "<<":
                    continue
                first = seen.setdefault(key.value, key)
                if first is not key:
                    issues.append(
                        PolicyIssue(
                            source,
                            join_path(path, key.value),
                            key.start_mark.line + 1,
                            f"duplicate key {key.value!r} (first at line"
                            f" {first.start_mark.line + 1})",
                        )
                    )
            for key, value in node.value:
                where = join_path(path, key.value if isinstance(key, yaml.ScalarNode) else "?")
                total += size(key, depth + 1, where) + size(value, depth + 1, where)
        active.discard(ident)
        sizes[ident] = total
        if total > MAX_NODES:
            raise PolicyError(
                [PolicyIssue(source, "", None, f"more than {MAX_NODES} YAML nodes once expanded")]
            )
        return total

    size(root, 0, "")
    if issues:
        raise PolicyError(issues)
