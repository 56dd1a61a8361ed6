"""The OpenAI-compatible HTTP server: request bodies, endpoints, errors, the hardened transport, metrics."""
