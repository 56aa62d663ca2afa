"""Inference engines, client side: the SGLang protocol client, the pool (routing, health, failover, interruptible
generation), fleet control (pause / update weights / resume) and the Redis registry. The engine servers are in
`rollq.engine.server`; `rollq.engine.tiny_model` is the offline test model every part can load."""
