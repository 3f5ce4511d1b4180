"""A model's chat template, rendered in a worker process bounded in time and output.

The template comes with the parent's tokenizer files, so it is the model owner's code: Jinja in transformers'
sandbox, which keeps it from the host but not from the CPU (two nested `range(100000)` loops run for hours) or
memory. Each model's template renders in one long-lived worker (`python -m tailor.compressor.serving.chat_template
<checkpoint>`, one JSON line in, one out); a render past RENDER_TIMEOUT_S or MAX_PROMPT_CHARS kills the worker (the
next request starts another) and the request gets a 400 saying why, while the server goes on serving.
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from typing import Any

RENDER_TIMEOUT_S = 2.0  # a real template renders in milliseconds
START_TIMEOUT_S = 120.0  # the worker imports transformers and loads the tokenizer once
MAX_PROMPT_CHARS = 4 << 20
ERROR_CHARS = 1024


class TemplateError(Exception):
    """The template could not make a prompt of these messages; `missing`: the model has no chat template."""

    def __init__(self, message: str, missing: bool = False) -> None:
        super().__init__(message)
        self.missing = missing


class ChatRenderer:
    """Renders `checkpoint`'s chat template in its worker, one request at a time."""

    def __init__(self, checkpoint: Path, timeout_s: float = RENDER_TIMEOUT_S, max_chars: int = MAX_PROMPT_CHARS
                 ) -> None:
        self.checkpoint, self.timeout_s, self.max_chars = checkpoint, timeout_s, max_chars
        self._process: asyncio.subprocess.Process | None = None
        self._lock = asyncio.Lock()

    async def render(self, turns: list[dict[str, str]]) -> str:
        async with self._lock:
            process = await self._started()
            assert process.stdin is not None and process.stdout is not None
            process.stdin.write(json.dumps(turns).encode() + b"\n")
            try:
                await process.stdin.drain()
                line = await asyncio.wait_for(process.stdout.readline(), self.timeout_s)
            except TimeoutError:
                await self.close()
                raise TemplateError(f"the chat template took longer than {self.timeout_s:g} s to render these "
                                    "messages; it was stopped") from None
            except (ValueError, ConnectionError):  # a line past the reader's limit; a worker that died writing
                await self.close()
                raise TemplateError(f"the chat template made a prompt past {self.max_chars} characters") from None
            if not line:
                await self.close()
                raise TemplateError("the chat template's renderer stopped (out of memory?) on these messages")
            answer = json.loads(line)
        if "error" in answer:
            raise TemplateError(answer["error"], bool(answer.get("missing")))
        prompt: str = answer["prompt"]
        return prompt

    async def _started(self) -> asyncio.subprocess.Process:
        if self._process is None or self._process.returncode is not None:
            self._process = await asyncio.create_subprocess_exec(
                sys.executable, "-m", __name__, str(self.checkpoint), str(self.max_chars),
                stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, limit=2 * self.max_chars + 4096)
            assert self._process.stdout is not None
            try:
                ready = await asyncio.wait_for(self._process.stdout.readline(), START_TIMEOUT_S)
            except TimeoutError:
                ready = b""
            if ready.strip() != b"ready":
                await self.close()
                raise TemplateError(f"the chat template's renderer did not start for {self.checkpoint}")
        return self._process

    async def close(self) -> None:
        if self._process is not None and self._process.returncode is None:
            self._process.kill()
            await self._process.wait()
        self._process = None


def _answer(tokenizer: Any, turns: Any, max_chars: int) -> dict[str, Any]:
    if not tokenizer.chat_template:
        return {"error": "the model has no chat template", "missing": True}
    try:
        prompt = tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=True)
    except Exception as error:  # the template's own raise_exception, or any error of the owner's code
        return {"error": f"the chat template failed on these messages: {type(error).__name__}: "
                         f"{str(error)[:ERROR_CHARS]}"}
    if len(prompt) > max_chars:
        return {"error": f"the chat template made a prompt past {max_chars} characters"}
    return {"prompt": prompt}


def main(argv: list[str]) -> None:
    """The worker: load the tokenizer (its files only, no code of its own), say "ready", then answer each line of
    messages with the prompt or the error."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(argv[0], trust_remote_code=False)
    max_chars = int(argv[1])
    print("ready", flush=True)
    for line in sys.stdin:
        print(json.dumps(_answer(tokenizer, json.loads(line), max_chars)), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
