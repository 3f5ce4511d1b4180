"""Quantization through real modelopt: calibration, export, repair, and the loader that restores exports."""

from __future__ import annotations

import contextlib
import json
import shutil
import sys
import warnings
from pathlib import Path

import modelopt.torch.quantization as mtq
import pytest
import torch
import torch.nn.functional as F
from modelopt.torch.export import export_hf_checkpoint
from modelopt.torch.export.unified_export_hf import requantize_resmooth_fused_llm_layers
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer, NemotronHConfig, NemotronHForCausalLM, PretrainedConfig

from tailor.cli.main import main
from tailor.compressor.model.architecture import architecture_from_config
from tailor.compressor.model.checkpoint import CheckpointError, load_decoder, settings_from_config, write_checkpoint
from tailor.compressor.model.fp8 import Fp8Linear, Fp8Round, round_fp8
from tailor.compressor.model.lazy import LazyDecoder, sweep
from tailor.compressor.model.modeling import Decoder
from tailor.compressor.model.moe import unstack_experts
from tailor.compressor.model.nvfp4 import Nvfp4Linear, pack, unpack
from tailor.compressor.puzzle.plan import Corpus
from tailor.compressor.quantize.pipeline import REPORT_FILE, QuantizeJob, run
from tailor.compressor.quantize.ptq import calibrate, repair_exclusions, repair_export
from tailor.compressor.quantize.recipes import QuantFormat, choose_recipe, tensor_group
from tailor.compressor.quantize.streamed import write_quantized
from tailor.compressor.sizing.hardware import GpuCatalog
from tailor.compressor.sizing.memory import RECIPES, KvDtype, weight_bytes

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])

HYBRID = {"model_type": "nemotron_h", "architectures": ["NemotronHForCausalLM"], "vocab_size": 96,
          "hidden_size": 64, "hybrid_override_pattern": "M*E-", "num_attention_heads": 4, "num_key_value_heads": 2,
          "head_dim": 16, "mamba_num_heads": 4, "mamba_head_dim": 16, "n_groups": 2, "ssm_state_size": 16,
          "conv_kernel": 4, "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
          "moe_shared_expert_intermediate_size": 48, "moe_latent_size": 32, "intermediate_size": 96}


def batches(vocab: int, count: int = 3, seed: int = 0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (2, 24), generator=generator) for _ in range(count)]


def quantized_folder(source: Path, recipe: str, folder: Path,
                     kv_cache: KvDtype = KvDtype.BF16) -> tuple[Decoder, list[str]]:
    """Quantize the model in `source` into `folder` a layer at a time, as `tailor quantize` does; return
    modelopt's whole-model calibration of the same model on the same tokens (fake-quantized, with the scales
    the export must hold) and the quantized layers."""
    model = LazyDecoder(source)
    calibration = batches(model.arch.vocab_size)
    folder.mkdir()
    done = write_quantized(model, RECIPES[recipe], torch.cat(calibration), kv_cache, folder, print)
    whole = load_decoder(source).eval()
    layers = calibrate(whole, RECIPES[recipe], lambda m: [m(batch) for batch in calibration], kv_cache)
    assert sorted(layers) == sorted(done.quantized_layers)
    # what the exporter does first: layers that share an input (q/k/v, gate/up) share its scale
    whole.__dict__.update(config=PretrainedConfig(**model.config), device=torch.device("cpu"))
    requantize_resmooth_fused_llm_layers(whole)
    return whole, layers


def stored_tensors(folder: Path) -> dict[str, torch.Tensor]:
    return {name: tensor for file in sorted(folder.glob("*.safetensors")) for name, tensor in load_file(file).items()}


def streamed_logits(folder: Path, ids: torch.Tensor) -> torch.Tensor:
    """Logits of a quantized export read a layer at a time, as the quality gate reads it."""
    lazy = LazyDecoder(folder, quantized_ok=True)
    return lazy.head()(sweep(lazy, lazy.embedding()(ids)))


def test_an_fp8_export_reloads_as_modelopt_quantized_it(tiny_parent: Path, tmp_path: Path) -> None:
    fake_quant, layers = quantized_folder(tiny_parent, "fp8", tmp_path / "fp8")
    assert len(layers) == 4 * 7  # q k v o gate up down in each of the 4 layers; LM head and embedding stay BF16
    restored = load_decoder(tmp_path / "fp8").eval()
    stored = stored_tensors(tmp_path / "fp8")
    x = torch.randn(2, 5, 256, generator=torch.Generator().manual_seed(3))
    for name in layers:
        ours, theirs = restored.get_submodule(name), fake_quant.get_submodule(name)
        assert isinstance(ours, Fp8Linear) and stored[f"{name}.weight"].dtype == torch.float8_e4m3fn
        scale = theirs.weight_quantizer.amax.float() / 448
        assert torch.equal(stored[f"{name}.weight_scale"], scale)
        # modelopt's export rounds w / scale to BF16 before FP8 (its fake quantization does not)
        codes = (theirs.weight.detach().to(torch.bfloat16).float() / scale).to(torch.bfloat16)
        assert torch.equal(stored[f"{name}.weight"].float(), codes.to(torch.float8_e4m3fn).float())
        inputs = x[..., :ours.in_features]
        torch.testing.assert_close(round_fp8(inputs, ours.input_scale), theirs.input_quantizer(inputs), rtol=0,
                                   atol=1e-6)
        expected = F.linear(round_fp8(inputs, ours.input_scale), stored[f"{name}.weight"].float() * scale)
        torch.testing.assert_close(ours(inputs), expected, rtol=0, atol=0)
    ids = batches(restored.arch.vocab_size, 1)[0]
    with torch.no_grad():  # the gate reads the export a layer at a time and computes what the whole model does
        torch.testing.assert_close(streamed_logits(tmp_path / "fp8", ids), restored(ids), rtol=0, atol=1e-5)
    in_bf16 = load_decoder(tmp_path / "fp8", torch.bfloat16).model.layers[0].mlp.up_proj
    assert isinstance(in_bf16, Fp8Linear) and in_bf16.values.dtype == torch.bfloat16
    assert in_bf16.input_scale.dtype == in_bf16.weight_scale.dtype == torch.float32  # scales are not rounded


def decode_nvfp4(data: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    """NVFP4 bytes to values by the format's definition, without modelopt: two E2M1 codes a byte (low nibble
    first; bit 3 the sign), times the FP8 scale of each block of 16, times the global scale."""
    nibbles = torch.stack([data & 0x0F, data >> 4], -1).flatten(-2).long()
    magnitude = E2M1[nibbles & 7]
    values = torch.where(nibbles & 8 > 0, -magnitude, magnitude)
    return values * (scale.float().repeat_interleave(16, -1) * global_scale)


def test_nvfp4_layers_compute_exactly_from_the_exported_bytes(tiny_parent: Path, tmp_path: Path) -> None:
    model = load_decoder(tiny_parent).eval()
    _, layers = quantized_folder(tiny_parent, "nvfp4", tmp_path / "nvfp4")
    stored = stored_tensors(tmp_path / "nvfp4")
    restored = load_decoder(tmp_path / "nvfp4").eval()
    generator = torch.Generator().manual_seed(2)
    agreement = []
    for name in layers:
        layer = restored.get_submodule(name)
        assert isinstance(layer, Nvfp4Linear) and stored[f"{name}.weight"].dtype == torch.uint8
        values = decode_nvfp4(stored[f"{name}.weight"], stored[f"{name}.weight_scale"],
                              stored[f"{name}.weight_scale_2"])
        assert torch.equal(layer.values, values)
        x = torch.randn(3, layer.in_features, generator=generator)
        expected = F.linear(unpack(pack(x, stored[f"{name}.input_scale"])), values)
        torch.testing.assert_close(layer(x), expected, rtol=0, atol=0)
        ours = pack(model.get_submodule(name).weight.detach(), stored[f"{name}.weight_scale_2"])
        agreement.append((ours.data == stored[f"{name}.weight"]).float().mean().item())
    # modelopt's exporter packs from BF16-cast weights; the project's packing of the FP32 weights agrees on
    # nearly every byte
    assert min(agreement) > 0.97


def test_w4a16_leaves_activations_unquantized(tiny_parent: Path, tmp_path: Path) -> None:
    quantized_folder(tiny_parent, "nvfp4-w4a16", tmp_path / "w4a16")
    quant = json.loads((tmp_path / "w4a16" / "hf_quant_config.json").read_text())
    assert quant["quantization"]["quant_algo"] == "W4A16_NVFP4"
    layer = load_decoder(tmp_path / "w4a16").model.layers[1].mlp.gate_proj
    assert isinstance(layer, Nvfp4Linear) and layer.input_scale is None
    x = torch.randn(2, 64)
    torch.testing.assert_close(layer(x), F.linear(x, unpack(layer.packed())), rtol=0, atol=0)


def test_an_fp8_kv_cache_is_calibrated_exported_and_restored(tiny_parent: Path, tmp_path: Path) -> None:
    fake_quant, _ = quantized_folder(tiny_parent, "fp8", tmp_path / "kv", KvDtype.FP8)
    quant = json.loads((tmp_path / "kv" / "hf_quant_config.json").read_text())["quantization"]
    assert quant["kv_cache_quant_algo"] == "FP8"
    stored = stored_tensors(tmp_path / "kv")
    restored = load_decoder(tmp_path / "kv").eval()
    for index in range(4):
        theirs, ours = fake_quant.model.layers[index].self_attn, restored.model.layers[index].self_attn
        for kind in ("k", "v"):
            scale = stored[f"model.layers.{index}.self_attn.{kind}_proj.{kind}_scale"]
            assert torch.equal(scale, getattr(theirs, f"{kind}_bmm_quantizer").amax.float() / 448)
            rounding = getattr(ours, f"{kind}_bmm_quantizer")
            assert isinstance(rounding, Fp8Round) and torch.equal(rounding.scale, scale)
    caches = restored.new_caches(1, 16)
    with torch.no_grad():
        restored(batches(restored.arch.vocab_size, 1)[0][:1, :8], caches)
    keys = caches[0].keys[:, :, :8] / restored.model.layers[0].self_attn.k_bmm_quantizer.scale
    assert torch.equal(keys, keys.to(torch.float8_e4m3fn).float())  # the cache holds FP8 values
    quant["kv_cache_quant_algo"] = None
    (tmp_path / "kv" / "hf_quant_config.json").write_text(json.dumps({"quantization": quant}))
    for read in (load_decoder, lambda folder: LazyDecoder(folder, quantized_ok=True).layer(0)):
        with pytest.raises(CheckpointError, match=r"kv_cache_quant_algo is None but attention "
                                                  r"model\.layers\.0\.self_attn has 2 of its 2 KV-cache scales"):
            read(tmp_path / "kv")


def test_the_hybrid_preset_quantizes_exactly_the_recipes_groups(tmp_path: Path) -> None:
    arch = architecture_from_config(HYBRID)
    torch.manual_seed(0)
    model = Decoder(arch, settings_from_config(HYBRID, "test")).eval()
    with torch.no_grad():  # expert 3 of the MoE layer is never chosen: calibration never reaches it
        model.backbone.layers[2].mixer.gate.e_score_correction_bias[3] = -10.0
    write_checkpoint(model, tmp_path / "parent", HYBRID, tmp_path)
    recipe = RECIPES["nvfp4-mamba-moe"]
    _, layers = quantized_folder(tmp_path / "parent", recipe.name, tmp_path / "hybrid")
    stored = stored_tensors(tmp_path / "hybrid")
    for projection in ("up_proj", "down_proj"):  # it takes its layer's largest input scale (W4A4 needs one)
        scales = [stored[f"backbone.layers.2.mixer.experts.{e}.{projection}.input_scale"] for e in range(4)]
        assert torch.equal(scales[3], torch.stack(scales[:3]).amax(0))
    unstack_experts(model)  # one nn.Linear per expert, as exported
    linear = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    assert sorted(layers) == sorted(n for n in linear if tensor_group(n) in recipe.quantized)
    assert "backbone.layers.0.mixer.in_proj" in layers and "backbone.layers.2.mixer.experts.3.down_proj" in layers
    assert "backbone.layers.1.mixer.q_proj" not in layers  # attention and latent projections stay BF16
    restored = load_decoder(tmp_path / "hybrid")
    assert type(restored.backbone.layers[2].mixer.fc1_latent_proj) is torch.nn.Linear
    packed = sum(stored[f"{n}.weight"].numel() + stored[f"{n}.weight_scale"].numel() for n in layers)
    unquantized = weight_bytes(arch, RECIPES["bf16"]) - sum(
        model.get_submodule(n).weight.numel() * 2 for n in layers)
    assert packed + unquantized == weight_bytes(arch, recipe)  # the bytes the memory model prices


def test_repair_cuts_the_sentinel_and_names_uncovered_layers() -> None:
    config = {"quantization": {"quant_algo": "NVFP4", "exclude_modules": [
        "lm_head.\x00backbone.pt_name_sentinel", "\x00backbone.pt_name_sentinel", "backbone.embeddings",
        "backbone.layers.0*"]}}
    stored = ["backbone.layers.0.mixer.in_proj.weight_scale", "backbone.layers.2.mixer.up_proj.weight_scale"]
    layers = ["backbone.layers.0.mixer.in_proj", "backbone.layers.1.mixer.q_proj", "backbone.layers.2.mixer.up_proj",
              "lm_head"]
    repairs = repair_exclusions(config, stored, layers)
    assert config["quantization"]["exclude_modules"] == ["lm_head", "backbone.embeddings",
                                                         "backbone.layers.1.mixer.q_proj"]
    assert [r.split(" ")[0] for r in repairs] == ["cut", "dropped", "dropped", "added"]


def test_a_transformers_nemotron_h_export_is_repaired_and_restored_where_transformers_fails(tmp_path: Path) -> None:
    config = {k: v for k, v in HYBRID.items() if k not in ("model_type", "architectures")}
    torch.manual_seed(0)
    model = NemotronHForCausalLM(NemotronHConfig(**config)).eval()
    model.config.architectures = ["NemotronHForCausalLM"]  # modelopt's exporter reads it
    ids = batches(96, 1)[0]
    with torch.no_grad():
        unquantized = model(ids).logits
    with contextlib.redirect_stdout(sys.stderr), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mtq.quantize(model, mtq.FP8_DEFAULT_CFG, lambda m: m(ids))
        with torch.no_grad():
            fake_quant = model(ids).logits
        export_hf_checkpoint(model, export_dir=tmp_path)
    exported = json.loads((tmp_path / "hf_quant_config.json").read_text())["quantization"]["exclude_modules"]
    assert "lm_head.\x00backbone.pt_name_sentinel" in exported  # modelopt 0.47's bug, reproduced
    with pytest.raises(CheckpointError, match="lm_head is stored unquantized but not in exclude_modules"):
        load_decoder(tmp_path)
    repairs = repair_export(tmp_path)
    assert len(repairs) == len(exported) + 1 and all(r.startswith("cut") for r in repairs[:-1])
    assert json.loads((tmp_path / "config.json").read_text())["quantization_config"]["ignore"] == [
        "lm_head", "backbone.embeddings", "backbone.layers.0.mixer.conv1d", "backbone.layers.2.mixer.gate"]
    assert repair_export(tmp_path) == []
    assert main(["checkpoint", "repair", str(tmp_path)]) == 0
    with torch.no_grad():
        ours = load_decoder(tmp_path).eval()(ids)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            plain = AutoModelForCausalLM.from_pretrained(tmp_path).eval()(ids).logits  # scales ignored
    ours_error, plain_error = (ours - fake_quant).abs().max(), (plain - fake_quant).abs().max()
    print(f"max |logit - modelopt's|: ours {ours_error:.3g}, plain transformers {plain_error:.3g}; "
          f"quantization itself {(fake_quant - unquantized).abs().max():.3g}")
    assert ours_error < 0.1 * plain_error


def test_a_quantized_folder_that_contradicts_its_config_is_named(tiny_parent: Path, tmp_path: Path) -> None:
    quantized_folder(tiny_parent, "fp8", tmp_path / "good")
    for case, change in (("missing", None), ("excluded", "model.layers.0.self_attn.q_proj"), ("algo", "NVFP4")):
        folder = tmp_path / case
        shutil.copytree(tmp_path / "good", folder)
        quant_file = folder / "hf_quant_config.json"
        quant = json.loads(quant_file.read_text())
        if change is None:
            quant_file.unlink()
            match = "hf_quant_config.json: unreadable"
        elif case == "excluded":
            quant["quantization"]["exclude_modules"].append(change)
            match = "q_proj is stored quantized but matches exclude_modules"
        else:
            quant["quantization"]["quant_algo"] = change
            match = "quant_algo is NVFP4 but .* is stored as fp8"
        if change is not None:
            quant_file.write_text(json.dumps(quant))
        for read in (load_decoder, lambda folder: LazyDecoder(folder, quantized_ok=True).layer(0)):
            with pytest.raises(CheckpointError, match=match):
                read(folder)


def test_auto_picks_nvfp4_on_blackwell_and_fp8_on_hopper_and_ada() -> None:
    catalog = GpuCatalog.load()
    llama = architecture_from_config({"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
                                      "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 100})
    hybrid = architecture_from_config(HYBRID)
    picks = {gpu: choose_recipe(QuantFormat.AUTO, llama, catalog.get(gpu))[0].name for gpu in ("B200", "H100", "L40S")}
    assert picks == {"B200": "nvfp4", "H100": "fp8", "L40S": "fp8"}
    assert choose_recipe(QuantFormat.AUTO, hybrid, catalog.get("GB200"))[0].name == "nvfp4-mamba-moe"
    _, reason = choose_recipe(QuantFormat.NVFP4, llama, catalog.get("H100"))
    assert "no native nvfp4 math" in reason
    for gpu in (None, catalog.get("A100-80GB")):
        with pytest.raises(ValueError, match="--format auto"):
            choose_recipe(QuantFormat.AUTO, llama, gpu)


def test_tailor_quantize_writes_a_complete_folder_or_nothing(tiny_parent: Path, tmp_path: Path) -> None:
    text = "Now is the winter of our discontent made glorious summer by this sun of York. " * 5
    heldout = tmp_path / "other-domain.jsonl"
    heldout.write_text(json.dumps({"text": text}) + "\n")
    windows = len(AutoTokenizer.from_pretrained(tiny_parent)(text)["input_ids"]) // 32
    assert 0 < windows < 4  # fewer than the 128 tokens asked for: only this file is evaluated on
    job = QuantizeJob(model=tiny_parent, out=tmp_path / "out", format=QuantFormat.FP8, seq_len=32,
                      calibration_tokens=256, eval_tokens=128, parent=tiny_parent, corpus=Corpus(heldout=str(heldout)))
    report = run(job, None)
    assert (report.eval_tokens, report.calibration_tokens) == (32 * windows, 256)
    assert report.quant_algo == "FP8" and report.quantized_layers == 28 and report.repairs == []
    assert json.loads((tmp_path / "out" / REPORT_FILE).read_text())["recipe"] == "fp8"
    assert (tmp_path / "out" / "tokenizer.json").exists()
    assert report.unquantized.quality.kl == 0 and report.quantized.quality.kl > 0
    assert report.quantized.kl_to_parent == pytest.approx(report.quantized.quality.kl)
    assert report.bytes_after < report.bytes_before
    broken = job.model_copy(update={"out": tmp_path / "broken", "corpus": Corpus(text=str(tmp_path / "nowhere"))})
    with pytest.raises(ValueError, match="nowhere"):
        run(broken, None)
    assert not list(tmp_path.glob("*broken*"))
