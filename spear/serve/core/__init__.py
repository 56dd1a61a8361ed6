"""The engine core: requests of token ids in, token ids out, one scheduled step at a time."""
