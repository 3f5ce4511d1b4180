"""The config class of `nemotron-nas` (DeciLM) children, copied into every such child as
`configuration_decilm.py` and named in its config.json's `auto_map`: transformers has no `nemotron-nas` type,
so engines (vLLM with `trust_remote_code`) read a child's config through this class.

Each `block_configs` entry's `attention` and `ffn` sections read as attributes, as vLLM's DeciLM model reads
them, and stay dicts (JSON) for everything else. A section that gives `intermediate_size` loses `ffn_mult`:
vLLM prefers `ffn_mult` and rounds the width it implies up to a multiple of 256, which is not the child's
width in general.
"""

from __future__ import annotations

from typing import Any

from transformers import LlamaConfig


class Section(dict[str, Any]):
    """A dict whose keys are also attributes; a missing key is a missing attribute (`hasattr` is False)."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


def _section(values: dict[str, Any]) -> Section:
    kept = {key: value for key, value in values.items() if value is not None}
    if "intermediate_size" in kept:
        kept.pop("ffn_mult", None)
    return Section(kept)


class DeciLMConfig(LlamaConfig):  # type: ignore[no-untyped-call]
    model_type = "nemotron-nas"

    def __init__(self, block_configs: list[dict[str, Any]] | None = None, **kwargs: Any) -> None:
        self.block_configs = [Section({name: _section(part) for name, part in entry.items()})
                              for entry in block_configs or []]
        super().__init__(**kwargs)
