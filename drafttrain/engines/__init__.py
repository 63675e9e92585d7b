"""The serving engines drafttrain starts, stops and reads (vLLM; SGLang untested): for a benchmark, for a draft's
acceptance, and for the target's hidden states (capture). They run from their own Python, never as drafttrain
dependencies; this layer stands on the foundation alone, so training, evaluation and bench all use it."""
