"""The tiny embedded model's own world: its synthetic tasks, character tokenizer and
trainer. Not the engine's job (the engine only loads the trained checkpoint), so kept
apart from it."""
