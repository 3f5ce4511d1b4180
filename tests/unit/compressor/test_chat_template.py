"""A model's chat template is its owner's code: rendered in a worker bounded in time and output, a hostile one
fails its request with the reason and the next request is served (the real SmolLM2 tokenizer files, with the
template swapped)."""

from __future__ import annotations

import asyncio
import json
import shutil
import time
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from tailor.compressor.model.checkpoint import TOKENIZER_FILES
from tailor.compressor.serving.chat_template import ChatRenderer, TemplateError

TURNS = [{"role": "user", "content": "What is the capital of France?"}]
ATTACK = [{"role": "user", "content": "attack"}]
# templates that behave for ordinary messages and attack on one: 1e10 loop steps, or 10 MB of prompt
FOREVER = ("{% if messages[0].content == 'attack' %}{% for i in range(100000) %}{% for j in range(100000) %}"
           "{% endfor %}{% endfor %}{% endif %}{{ messages[0].content }}")
HUGE = ("{% if messages[0].content == 'attack' %}{% for i in range(100000) %}" + "x" * 100 + "{% endfor %}"
        "{% endif %}{{ messages[0].content }}")


def _tokenizer(smollm2: Path, folder: Path, template: str | None) -> Path:
    folder.mkdir()
    for name in TOKENIZER_FILES:
        if (smollm2 / name).exists() and name != "chat_template.jinja":
            shutil.copy2(smollm2 / name, folder / name)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    if template is not None:
        config["chat_template"] = template
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


async def _render(folder: Path, turns: list[dict[str, str]]) -> str:
    renderer = ChatRenderer(folder)
    try:
        return await renderer.render(turns)
    finally:
        await renderer.close()


def test_a_real_template_renders_as_transformers_does(smollm2: Path) -> None:
    prompt = asyncio.run(_render(smollm2, TURNS))
    assert prompt == AutoTokenizer.from_pretrained(smollm2).apply_chat_template(TURNS, tokenize=False,
                                                                               add_generation_prompt=True)


@pytest.mark.parametrize(("template", "says"), [(FOREVER, "took longer than 2 s"),
                                                (HUGE, "past 4194304 characters")], ids=["forever", "huge"])
def test_a_hostile_template_fails_its_request_in_bounded_time_and_the_next_is_served(
        smollm2: Path, tmp_path: Path, template: str, says: str) -> None:
    hostile = _tokenizer(smollm2, tmp_path / "hostile", template)

    async def run() -> tuple[str, float, str]:
        renderer = ChatRenderer(hostile)
        try:
            with pytest.raises(TemplateError) as failed:
                await renderer._started()  # the worker's start (transformers' import) is not the render's time
                start = time.monotonic()
                await renderer.render(ATTACK)
            took = time.monotonic() - start
            return str(failed.value), took, await renderer.render(TURNS)  # a fresh worker
        finally:
            await renderer.close()

    said, took, served = asyncio.run(run())
    assert says in said and took < 10, (said, took)
    assert served == "What is the capital of France?"


def test_a_model_without_a_template_says_so(smollm2: Path, tmp_path: Path) -> None:
    with pytest.raises(TemplateError) as failed:
        asyncio.run(_render(_tokenizer(smollm2, tmp_path / "none", None), TURNS))
    assert failed.value.missing
