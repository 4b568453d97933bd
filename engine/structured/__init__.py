"""Structured outputs for masked diffusion (engine.structured): a row's regex, choice or
JSON schema enforced at every step whatever order its positions are unmasked in.
`params` reads the request's field (torch-free), `vocabulary` the tokenizer's bytes,
`regular` checks the regex as a regular language and counts its DFA up to the cap
(torch-free), `worker` builds outlines-core's token index in a child process with a time
limit, `automaton` compiles a constraint within the engine's caps (cached per engine),
`guide` is the per-step dynamic program over the window and its hooks into the engine's
step."""
