"""How much a streamed model works on at once: the sizes `lazy` chunks by, which the memory model
(`puzzle.footprint`) counts. Light: the operator's dry run imports them."""

LAYER_TOKENS = 1024  # tokens (whole sequences, at least one) a layer runs at once when capturing and scoring
HEAD_SLICE = 8192  # vocabulary rows of a kept-as-stored LM head widened to float32 at a time (`lazy.StoredHead`)
