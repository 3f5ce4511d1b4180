"""The model: architectures, the decoder that runs them, checkpoints read and written, streamed, quantized."""
