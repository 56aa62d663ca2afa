"""The engine servers: SGLang's HTTP protocol over a synthetic or reference (transformers) backend, and the
launcher for real SGLang. Workers and the trainer never import this package: they use the client side in
`rollq.engine` (client, pool, fleet, registry, types)."""
