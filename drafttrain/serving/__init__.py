"""Serving what we train in a real engine: start vLLM (or SGLang) servers, drive them with a well-kept load
generator across concurrency, and read the engine's own counters (``drafttrain bench``)."""
