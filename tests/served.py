"""The model the serving tests and the serving benchmark package: its name, sizing and the small Puzzle plan
that makes it from SmolLM2-135M."""

NAME = "smollm2"
CONTEXT = 256
MAX_BATCH = 4
PLAN = {
    "parent": "smollm2-135m", "data": {"text": "shakespeare", "seqLen": 64},
    "target": {"gpu": "cpu", "precision": "bf16", "batch": 1, "context": 512, "throughput": 1.15,
               "costs": "roofline"},
    "library": {"ffnWidths": [0.5], "kvHeads": [1], "linear": False, "noOp": True},
    "bld": {"tokens": 2048, "lr": 0.0005, "batch": 8}, "bldActivationTokens": 1024, "scoringTokens": 128,
    "evalTokens": 512, "gkd": {"tokens": 1024, "lr": 0.0001, "batch": 8}, "measureTokens": 4, "solutions": 1,
}
