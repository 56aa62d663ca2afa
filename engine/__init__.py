"""Inference engines: SGLang protocol client, pool, fleet control, reference engine (see the engine issue)."""
