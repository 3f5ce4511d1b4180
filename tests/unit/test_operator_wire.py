"""Nothing a tenant writes stops the operator: JSON from the API server read with its deep values cut
(`wire.loads`), kopf made to read so (`kopf_input.read_bounded`), its progress records checked for their shape
(`kopf_input.TenantProgress`), and planOverrides bounded by its schema and by the spec's validation."""

from __future__ import annotations

import asyncio
import inspect
import json
import random
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import aiohttp
import kopf
import pytest
from kopf._cogs.clients import api as kopf_api
from pydantic import ValidationError

from tailor.operator import api, kopf_input, wire
from tailor.operator.crd import build_crd

from corpus import patched

PAST_THE_PARSER = 1500  # Python's json raises RecursionError at about 1,000 levels


def nested(depth: int, leaf: Any = 1) -> str:
    return '{"a":' * depth + json.dumps(leaf) + "}" * depth


def test_a_deep_object_in_a_list_is_cut_and_the_others_read_whole() -> None:
    with pytest.raises(RecursionError):
        json.loads(nested(PAST_THE_PARSER))
    page = (f'{{"items": [{{"metadata": {{"name": "deep", "uid": "u1"}}, "spec": {nested(PAST_THE_PARSER)}}}, '
            f'{{"metadata": {{"name": "plain"}}, "spec": {{"x": [1, {{"y": "]}}[{{"}}]}}}}]}}')
    items = wire.loads(page.encode())["items"]
    assert items[0]["metadata"] == {"name": "deep", "uid": "u1"}
    assert items[1] == {"metadata": {"name": "plain"}, "spec": {"x": [1, {"y": "]}[{"}]}}
    assert wire.nesting(items[0]) == wire.MAX_DEPTH - 2  # the page and its list hold it
    leaf: Any = items[0]["spec"]
    while isinstance(leaf, dict):
        leaf = leaf["a"]
    assert leaf == wire.TOO_DEEP


def test_what_nests_within_the_bound_reads_as_json_does() -> None:
    rng = random.Random(0)

    def document(depth: int) -> Any:
        if depth == 0 or rng.random() < 0.3:
            return rng.choice([1, -2.5, True, None, 'a "quoted" [bracket] {brace} \\ \u00e9'])
        if rng.random() < 0.5:
            return [document(depth - 1) for _ in range(rng.randint(0, 3))]
        return {f"k{i}": document(depth - 1) for i in range(rng.randint(0, 3))}

    for _ in range(200):
        text = json.dumps(document(wire.MAX_DEPTH))
        assert wire.loads(text) == json.loads(text)
    exactly = nested(wire.MAX_DEPTH - 1, [])  # MAX_DEPTH containers: read whole
    assert wire.loads(exactly) == json.loads(exactly)
    assert wire.nesting(wire.loads(nested(wire.MAX_DEPTH, []))) == wire.MAX_DEPTH


def test_nesting_counts_containers_without_recursion() -> None:
    assert (wire.nesting(1), wire.nesting([]), wire.nesting({"a": [1, {"b": []}]})) == (0, 1, 4)
    deep: Any = 0
    for _ in range(100_000):
        deep = [deep]
    assert wire.nesting(deep) == 100_000


@pytest.fixture
def deep_server() -> Iterator[str]:
    """A loopback HTTP server that answers every GET with an object nested past the parser's limit."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = nested(PAST_THE_PARSER).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *_: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/"
    server.shutdown()
    server.server_close()


def test_kopf_reads_lists_and_watch_events_with_wire(deep_server: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kopf_api, "json", kopf_api.json)
    monkeypatch.setattr(aiohttp.ClientResponse, "json", aiohttp.ClientResponse.json)
    # where kopf decodes: watch lines with its module's json.loads, everything else with aiohttp's response.json()
    assert "json.loads(line" in inspect.getsource(kopf_api.stream)
    assert all("await response.json()" in inspect.getsource(call)
               for call in (kopf_api.get, kopf_api.post, kopf_api.patch, kopf_api.delete))
    kopf_input.read_bounded()
    assert kopf_api.json.loads(nested(PAST_THE_PARSER)) is not None

    async def get() -> Any:
        async with aiohttp.ClientSession() as session, session.get(deep_server) as response:
            return await response.json()

    assert wire.nesting(asyncio.run(get())) == wire.MAX_DEPTH


@pytest.mark.parametrize(("written", "read"), [
    ('{"started": "2026-12-07T10:00:00.000000+00:00", "retries": 1, "success": false}',
     {"started": "2026-12-07T10:00:00.000000+00:00", "retries": 1, "success": False}),
    ("not json", None),
    ('{"retries": "many"}', None),  # kopf would add to it
    ('["a list"]', None),
    ('{"purpose": "x", "extra": 1}', None),
    (nested(PAST_THE_PARSER), None),
])
def test_a_progress_record_a_tenant_wrote_reads_as_none_unless_kopf_can_use_it(written: str, read: Any) -> None:
    storage = kopf_input.TenantProgress(prefix=api.GROUP)
    key: Any = "run"
    annotation = next(iter(storage.make_keys(key)))
    body = kopf.Body({"metadata": {"name": "m", "annotations": {annotation: written}}})
    assert storage.fetch(key=key, body=body) == read


def test_plan_overrides_are_typed_to_the_leaf_in_the_crd() -> None:
    spec = build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    overrides = spec["properties"]["compression"]["properties"]["planOverrides"]

    def nodes(node: dict[str, Any], depth: int = 1) -> Iterator[tuple[dict[str, Any], int]]:
        yield node, depth
        for child in node.get("properties", {}).values():
            yield from nodes(child, depth + (child["type"] in ("object", "array")))
        if "items" in node:
            yield from nodes(node["items"], depth)

    found = list(nodes(overrides))
    assert "x-kubernetes-preserve-unknown-fields" not in json.dumps(spec)
    assert max(depth for _, depth in found) == api.MAX_OVERRIDE_DEPTH
    assert not any("required" in node or "default" in node for node, _ in found)
    assert all("maxLength" in node or "enum" in node for node, _ in found if node["type"] == "string")
    assert all(node["type"] != "object" or node.get("properties") for node, _ in found)  # no free-form map
    assert not any(isinstance(node.get(bound), bool) for node, _ in found for bound in ("minimum", "maximum"))


def test_plan_overrides_nested_past_the_plan_fail_the_spec() -> None:
    def spec(overrides: Any) -> Any:
        return api.CompressedModelSpec.model_validate(
            patched({"spec": {"compression": {"planOverrides": overrides}}})["spec"])

    assert spec({"library": {"ffnWidths": [0.5]}}).compression.plan_overrides == {"library": {"ffnWidths": [0.5]}}
    with pytest.raises(ValidationError, match="planOverrides nests 4 levels deep"):
        spec({"library": {"ffnWidths": [[0.5]]}})
    with pytest.raises(ValidationError, match=f"planOverrides nests {wire.MAX_DEPTH} levels deep"):
        spec(wire.loads(nested(PAST_THE_PARSER)))  # as the operator reads one an older CRD let in
