"""Between a user and the engine core: requests checked and tokenized, outputs turned into text."""
