"""The engine's own Llama-family model, its layers, its weights and what runs a step of it."""
