"""Run in vLLM's environment (`.venv-vllm/bin/python vllm_probe.py request.json`): load each model with vLLM's
offline engine, decode its prompts greedily and report the tokens and the engine's own KV-cache accounting
(the concurrency it holds at max_model_len). Prints one JSON object per model on stdout.

request.json: [{"model": path, "max_model_len": int, "max_num_seqs": int, "kv_cache_memory_bytes": int,
                "prompts": [[token ids], ...], "tokens": int}, ...]
"""

from __future__ import annotations

import json
import sys


def main() -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    with open(sys.argv[1]) as request:
        specs = json.load(request)
    for spec in specs:
        llm = LLM(model=spec["model"], dtype="float32", max_model_len=spec["max_model_len"],
                  max_num_seqs=spec["max_num_seqs"], kv_cache_memory_bytes=spec["kv_cache_memory_bytes"],
                  enforce_eager=True, trust_remote_code=True, seed=0)
        sampling = SamplingParams(temperature=0, max_tokens=spec["tokens"], ignore_eos=True)
        outputs = llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in spec["prompts"]], sampling)
        cache = llm.llm_engine.vllm_config.cache_config
        print(json.dumps({"model": spec["model"], "tokens": [list(o.outputs[0].token_ids) for o in outputs],
                          "max_concurrency": cache.kv_cache_max_concurrency,
                          "kv_cache_tokens": cache.kv_cache_size_tokens}), flush=True)
        del llm


if __name__ == "__main__":  # the engine starts its workers with spawn: they import this file
    main()
