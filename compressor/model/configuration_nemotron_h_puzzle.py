"""The config class of `nemotron_h_puzzle` children (Puzzle children of NemotronH parents), copied into every such
child as `configuration_nemotron_h_puzzle.py` and named in its config.json's `auto_map`: transformers has no
`nemotron_h_puzzle` type, so engines (vLLM with `trust_remote_code`) read a child's config through this class.

vLLM maps `NemotronHPuzzleForCausalLM` to its NemotronH model, which builds each attention, MLP and MoE layer from
`config.get_nemotron_h_config_for_layer(i)` when the config has it: here, the model-wide config with the fields
block `i` of `block_configs` overrides. Mamba layers are built from the model-wide fields only, so a child vLLM
serves has one Mamba shape (`engines.vllm_cannot_load`), which the writer puts in the model-wide fields.
"""

from __future__ import annotations

from typing import Any

from transformers import NemotronHConfig

# the fields a block may override, by block type, as vLLM's NemotronH layers read them
LAYER_FIELDS = {
    "attention": ("num_attention_heads", "num_key_value_heads", "head_dim"),
    "mlp": ("intermediate_size",),
    "moe": ("n_routed_experts", "num_experts_per_tok", "moe_intermediate_size",
            "moe_shared_expert_intermediate_size", "moe_latent_size"),
}


class LayerConfig:
    """The model-wide config as one layer sees it: the block's own fields first."""

    def __init__(self, base: Any, overrides: dict[str, Any]) -> None:
        self.__dict__.update(_base=base, _overrides=overrides)

    def __getattr__(self, name: str) -> Any:
        overrides = self.__dict__["_overrides"]
        return overrides[name] if name in overrides else getattr(self.__dict__["_base"], name)


class NemotronHPuzzleConfig(NemotronHConfig):  # type: ignore[no-untyped-call]
    model_type = "nemotron_h_puzzle"

    def __init__(self, block_configs: list[dict[str, Any]] | None = None, **kwargs: Any) -> None:
        self.block_configs = [dict(entry) for entry in block_configs or []]
        super().__init__(**kwargs)

    def get_nemotron_h_config_for_layer(self, layer_idx: int) -> Any:
        """Block `layer_idx`'s config: its `block_configs` fields over the model-wide ones (a MoE block without a
        shared expert has none)."""
        if layer_idx >= len(self.block_configs):
            return self
        entry = self.block_configs[layer_idx]
        overrides = {name: entry[name] for name in LAYER_FIELDS.get(entry.get("block_type") or "", ())
                     if entry.get(name) is not None}
        if entry.get("block_type") == "moe" and overrides.get("moe_shared_expert_intermediate_size") == 0:
            overrides["n_shared_experts"] = 0
        return LayerConfig(self, overrides) if overrides else self
