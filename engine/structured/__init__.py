"""Structured outputs for masked diffusion (engine.structured): a row's regex, choice or
JSON schema enforced at every step whatever order its positions are unmasked in.
`params` reads the request's field (torch-free), `vocabulary` the tokenizer's bytes,
`automaton` compiles a constraint with outlines-core (cached per engine), `guide` is the
per-step dynamic program over the window and its hooks into the engine's step."""
