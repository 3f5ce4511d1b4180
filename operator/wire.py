"""JSON from the API server, read so that no object in it can stop the operator.

The API server stores objects nested up to 10,000 levels where a schema lets them; Python's JSON parser raises
RecursionError at about 1,000 and `copy.deepcopy` at about 500, and one such object in a list or a watch event
would fail every list of its namespace, and kopf's watch with it (the operator exits). `loads` reads every value
nested deeper than MAX_DEPTH as the string TOO_DEEP instead: the object keeps its name and uid, the spec's own
validation fails it (`api.CompressionSpec`), and every other object is read as it is. `kopf_input.read_bounded`
makes kopf read the API server's answers so.
"""

from __future__ import annotations

import json
import re
from typing import Any

MAX_DEPTH = 64  # what the operator reads nests under 20 levels (managedFields included), a list page adds 3
TOO_DEEP = f"(nested deeper than {MAX_DEPTH} levels: not read)"
# a JSON string (escapes included) or a bracket: the brackets inside strings are not the document's
_TOKENS = re.compile(r'"(?:[^"\\]|\\.)*"|[\[\]{}]')


def _cut(text: str, max_depth: int) -> str | None:
    """`text` with every value that opens deeper than `max_depth` replaced by TOO_DEEP; None where none does."""
    pieces: list[str] = []
    depth, start, kept = 0, -1, 0
    for token in _TOKENS.finditer(text):
        char = token.group()[0]
        if char in "[{":
            depth += 1
            if depth == max_depth + 1:
                start = token.start()
        elif char in "]}":
            if depth == max_depth + 1:
                pieces += [text[kept:start], json.dumps(TOO_DEEP)]
                kept = token.end()
            depth -= 1
    return "".join([*pieces, text[kept:]]) if pieces else None


def loads(data: str | bytes | bytearray, max_depth: int = MAX_DEPTH) -> Any:
    """`json.loads`, with values nested deeper than `max_depth` read as TOO_DEEP."""
    text = data.decode() if isinstance(data, bytes | bytearray) else data
    if text.count("{") + text.count("[") > max_depth:  # cheap: no deeper nesting is possible without as many
        text = _cut(text, max_depth) or text
    return json.loads(text)


def nesting(value: Any) -> int:
    """How many objects and lists deep `value` nests (0 for a scalar), without recursion."""
    deepest, stack = 0, [(value, 0)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict | list):
            deepest = max(deepest, depth + 1)
            stack.extend((child, depth + 1) for child in (node.values() if isinstance(node, dict) else node))
    return deepest
