"""The OpenAI/Anthropic-compatible recording proxy that agent workflows talk to."""
